# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`Registry`: entries known by name, in registration order — the one mechanism behind the package's extension points.

The gate's judging: `METRICS` (the gated figures), `STATISTICS` (the mismatch statistics, reported and never
gated) and `PROFILES` (the tolerance profiles); the doctor's `CAUSES`; the lint's `RULES`; and the built-in model
families (`builtin_families.BUILTIN_FAMILIES`). A new entry is one frozen dataclass of plain values and functions
and one call to the registry's `register`; everything that lists, computes, gates, renders or documents them
iterates the registry, so nothing else changes. Imports nothing of ours (every layer may use it).

A registry iterates over its names (``", ".join(METRICS)``, ``name in PROFILES``, ``argparse`` choices), and
``registry[name]`` is the entry.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Registry", "closest_name", "markdown_table"]


class _Named(Protocol):
    @property
    def name(self) -> str: ...


EntryT = TypeVar("EntryT", bound=_Named)


def closest_name(name: str, candidates: tuple[str, ...] | list[str]) -> str:
    """` Did you mean 'x'?` suffix for an unknown name, or an empty string."""
    lowered = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.5)
    return f" Did you mean {lowered[match[0]]!r}?" if match else ""


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A Markdown table (the docs' tables of registered entries); a bar inside a cell is escaped, even in backticks."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class Registry(Generic[EntryT]):
    """Entries by name, in registration order (the order reports, tables and JSON list them in).

    Args:
        kind: what an entry is (``"metric"``), for error messages.
    """

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, EntryT] = {}

    def register(self, entry: EntryT, *, replace: bool = False) -> EntryT:
        """Make `entry` known by `entry.name`; returns it (``FOO = METRICS.register(Metric(...))``).

        Registering the same object again is a no-op; another entry under a taken name is a ValueError unless
        `replace=True` (which keeps its place in the order).
        """
        name = entry.name
        known = self._entries.get(name)
        if known is not None and known is not entry and not replace:
            raise ValueError(f"a {self._kind} named {name!r} is already registered; pick another name.")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> EntryT:
        """Forget `name` (KeyError naming the known ones when it is not registered); returns its entry."""
        entry = self[name]
        del self._entries[name]
        return entry

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Registry[EntryT]]:
        """Undo every registration made inside the ``with`` block on exit (tests, examples)."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries.clear()
            self._entries.update(saved)

    def __getitem__(self, name: str) -> EntryT:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        """The message for an unknown `name`: the known names and the closest one."""
        names = self.names()
        return f"Unknown {self._kind} {name!r}; expected one of {', '.join(names)}.{closest_name(str(name), names)}"

    def get(self, name: str, default: EntryT | None = None) -> EntryT | None:
        return self._entries.get(name, default)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def values(self) -> tuple[EntryT, ...]:
        return tuple(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self._kind!r}: {', '.join(self._entries)})"
