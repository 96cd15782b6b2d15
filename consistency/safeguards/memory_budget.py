# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""How much memory this process may still take, and a check against it before a large input is loaded.

A dump, a report or a capture says in its header how large it is; [`check_fits`] compares what loading and
processing it will need with [`available_bytes`] — the smallest of the system's available memory
(``MemAvailable``), the cgroup's limit minus its usage, and the address-space and data limits (``ulimit -v``,
``ulimit -d``) minus what this process already maps — and refuses with one line naming the input and the fix,
instead of dying half-way (a ``MemoryError`` deep in a library, or an allocator abort).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MemoryBudgetError", "available_bytes", "check_fits", "format_bytes"]


class MemoryBudgetError(MemoryError):
    """An input too large for the memory this process may take; the message names the input and the fix."""


def available_bytes() -> int | None:
    """The bytes this process may still allocate, or None when nothing can be read (not Linux)."""
    candidates = [_meminfo_available(), _cgroup_headroom()]
    try:
        import resource

        status = _proc_status()
        for limit_name, used_name in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
            soft, _hard = resource.getrlimit(getattr(resource, limit_name))
            if soft != resource.RLIM_INFINITY and used_name in status:
                candidates.append(max(0, soft - status[used_name]))
    except (ImportError, OSError, ValueError, AttributeError):
        pass
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def check_fits(needed: int, what: str, fix: str) -> None:
    """Raise [`MemoryBudgetError`] when `needed` bytes exceed [`available_bytes`].

    Args:
        needed: an estimate of the peak bytes the work will allocate.
        what: the work, as the message starts (``"gating DUMP (1000000 samples x 10 steps)"``).
        fix: what the user can do (``"gate fewer samples"``).
    """
    available = available_bytes()
    if available is not None and needed > available:
        raise MemoryBudgetError(
            f"{what} needs about {format_bytes(needed)} of memory and {format_bytes(available)} are available; {fix}."
        )


def format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            limit_text = Path(limit_path).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # cgroup v1 writes "no limit" as a huge number
            return None
        return max(0, limit - usage)
    return None


def _proc_status() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[name] = int(fields[0]) * 1024
    except (OSError, ValueError):
        pass
    return out
