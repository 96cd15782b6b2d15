# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The log-prob dump: a user's two step-1 tables in one safetensors file, gated later (CLI, pytest, Python).

Format ``rollout-consistency/logprob-dump``, version 1 (metadata keys ``format`` and ``format_version``):

=====================  ==========  =======  ===========================================================
tensor                 shape       dtype    meaning
=====================  ==========  =======  ===========================================================
``rollout_log_probs``  ``(N, T)``  F32      log-prob of each stored SDE step as the rollout computed it
``trainer_log_probs``  ``(N, T)``  F32      the trainer's recomputation, before any optimizer update
``timesteps``          ``(N, T)``  F32      optional: the timestep value of each step
``sample_ids``         ``(N,)``    I64/I32  optional: your id of each row (unique)
``prompt_groups``      ``(N,)``    I64/I32  optional: prompt group of each sample (with ``window_starts``:
                                            the ``windows`` guard)
``window_starts``      ``(N,)``    I64/I32  optional: first SDE step of each sample's window
``advantages``         ``(N,)``    F32      optional: advantage of each sample (verl's advantage-dependent
                                            clip fractions)
=====================  ==========  =======  ===========================================================

Metadata key ``tables_sha256``: the SHA-256 of the tensors (each one's name, dtype, shape and bytes, in name
order), written by `write_dump` and checked by `read_dump` when present: a dump changed after it was written is
refused. Other metadata keys (strings) are kept and shown in the report's notes. Reading validates the header —
format, version, tensor names, dtypes and shapes, the data's extent against the file's size — and checks that
gating that many cells fits the memory left (`rollout_consistency.safeguards.memory_budget`) before any data is loaded,
then the values (timesteps and advantages finite, window starts >= 0, ids unique); every error is one line
naming the fix. A FIFO, a device or a socket is refused unread (`rollout_consistency.safeguards.paths`). NaN/inf
*log-probs* are allowed: they are a finding, and the gate FAILs them (``finite``). A dump the in-loop recorder
wrote carries its coverage (`rollout_consistency.gate.tables.coverage`). Adding an optional tensor keeps
version 1; renaming or removing one, or changing a dtype, bumps it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.aliasing import ALIASED_FIX, shares_memory
from rollout_consistency.gate.judging.views import host_array
from rollout_consistency.safeguards.atomic_write import write_all
from rollout_consistency.safeguards.memory_budget import check_fits
from rollout_consistency.safeguards.paths import open_regular

from . import api
from .coverage import COVERAGE_KEY, parse_coverage, settings_with_coverage

DUMP_FORMAT = "rollout-consistency/logprob-dump"
DUMP_FORMAT_VERSION = 1
#: Metadata key of the tensors' checksum (`tables_checksum`).
CHECKSUM_KEY = "tables_sha256"

_TABLES = ("rollout_log_probs", "trainer_log_probs")
#: name -> (rank, allowed safetensors dtypes); rank 2 = (N, T), rank 1 = (N,).
_SPEC: dict[str, tuple[int, tuple[str, ...]]] = {
    "rollout_log_probs": (2, ("F32",)),
    "trainer_log_probs": (2, ("F32",)),
    "timesteps": (2, ("F32",)),
    "sample_ids": (1, ("I64", "I32")),
    "prompt_groups": (1, ("I64", "I32")),
    "window_starts": (1, ("I64", "I32")),
    "advantages": (1, ("F32",)),
}
#: Bytes per element of safetensors' dtypes (any of them may appear in a file; _check_header refuses the wrong ones).
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ITEM_BYTES |= {"U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
#: safetensors' own bound on the JSON header.
_MAX_HEADER_BYTES = 100_000_000
#: Peak bytes `gate` allocates per (sample, step) cell and per sample, measured on 4e6-cell dumps (200-270 bytes
#: per cell, whatever the shape; tests/test_fail_closed.py), with headroom.
GATE_BYTES_PER_CELL, GATE_BYTES_PER_SAMPLE = 320, 2048


class DumpFormatError(ValueError):
    """A file that is not a valid log-prob dump; the message says what to change."""


@dataclass(frozen=True)
class LogProbDump:
    """A dump's contents. Tables are float32 NumPy arrays of shape `(N, T)`; the optional vectors are `(N,)`."""

    rollout_log_probs: np.ndarray
    trainer_log_probs: np.ndarray
    timesteps: np.ndarray | None = None
    sample_ids: np.ndarray | None = None
    prompt_groups: np.ndarray | None = None
    window_starts: np.ndarray | None = None
    advantages: np.ndarray | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors present, by name (the keyword arguments of `rollout_consistency.gate.gate`)."""
        return {name: getattr(self, name) for name in _SPEC if getattr(self, name) is not None}

    def gate(self, settings: Any = None, **overrides: Any) -> Any:
        """`rollout_consistency.gate.gate` on this dump's tables, with `settings` (a `TableSettings`) and/or its
        fields as keywords (profile, clip_ratio, ...); the notes default to the dump's metadata."""
        own = ("format", "format_version", COVERAGE_KEY, CHECKSUM_KEY)
        extra = {k: v for k, v in self.metadata.items() if k not in own}
        notes = [f"dump metadata: {', '.join(f'{k}={v}' for k, v in sorted(extra.items()))}"] if extra else []
        if "notes" not in overrides and (settings is None or not settings.notes):
            overrides["notes"] = notes
        if COVERAGE_KEY in self.metadata:  # written by the recorder: the same coverage, the same verdict
            coverage = parse_coverage(self.metadata[COVERAGE_KEY])
            return api.gate(**self.arrays(), settings=settings_with_coverage(coverage, settings, overrides))
        return api.gate(**self.arrays(), settings=settings, **overrides)


def write_dump(
    path: str | os.PathLike[str],
    rollout_log_probs: Any,
    trainer_log_probs: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    **columns: Any,
) -> Path:
    """Write a dump (format version 1), atomically: a reader never sees half a file
    (`rollout_consistency.safeguards.atomic_write.write_all`).

    Args:
        path: the ``.safetensors`` file to write (its directory is created; ``/dev/null`` discards it; a device
            other than that is refused).
        rollout_log_probs, trainer_log_probs (`(N, T)` float32, NumPy or torch): the two tables. float32 only:
            rounding float64 log-probs here would change the numbers being compared; convert both sides
            before the comparison, not after.
        metadata: extra string metadata (e.g. ``{"trainer": "flow_grpo", "run": "..."}``).
        **columns: the optional tensors by name, as in the module docstring: ``timesteps`` (`(N, T)`),
            ``sample_ids``, ``prompt_groups``, ``window_starts`` (`(N,)` int), ``advantages`` (`(N,)`); `None`
            leaves one out.

    Returns:
        The absolute path written.

    Raises:
        DumpFormatError: a table or vector of the wrong shape or dtype, a column the format does not have, or
            two tables that are one array or share memory (nothing would be compared; the file could not show it
            later): nothing is written.
        OSError: the disk is full, a file-size limit, no permission: one line naming the path, with its errno
            (the command line exits 2 with it); nothing is written and no temporary file is left.
        rollout_consistency.safeguards.output_paths.OutputPathError: `path` is a directory or a device other than
            ``/dev/null``.
    """
    unknown = sorted(set(columns) - set(_SPEC))
    if unknown:
        raise DumpFormatError(
            f"write_dump: no column {', '.join(map(repr, unknown))}; the optional ones are "
            f"{', '.join(n for n in _SPEC if n not in _TABLES)}."
        )
    if shares_memory(rollout_log_probs, trainer_log_probs):  # the file would hold two copies: refused here
        raise DumpFormatError(
            f"write_dump: rollout_log_probs and trainer_log_probs are one array (or share memory): nothing would be "
            f"compared; {ALIASED_FIX}."
        )
    given = {"rollout_log_probs": rollout_log_probs, "trainer_log_probs": trainer_log_probs, **columns}
    tensors: dict[str, np.ndarray] = {}
    for name, value in given.items():
        if value is None:
            continue
        array = host_array(value, f"write_dump: {name}", DumpFormatError)
        rank = _SPEC[name][0]
        if rank == 1 and array.dtype.kind in "iu":
            array = array.astype(np.int64)
        elif name == "advantages" and array.dtype == np.float64:
            array = array.astype(np.float32)  # advantages are not compared bit for bit
        elif name == "timesteps" and array.dtype == np.float64:
            # Timesteps are grouped by exact value: refuse a cast that could merge two of them.
            if not np.array_equal(array.astype(np.float32).astype(np.float64), array):
                raise DumpFormatError("timesteps: pass the float32 timesteps the scheduler used (float64 given).")
            array = array.astype(np.float32)
        tensors[name] = np.ascontiguousarray(array)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(format=DUMP_FORMAT, format_version=str(DUMP_FORMAT_VERSION))
    meta[CHECKSUM_KEY] = tables_checksum(tensors)
    header = {name: (_st_dtype(a.dtype), tuple(a.shape)) for name, a in tensors.items()}
    _check_header(header, meta, where="write_dump")
    _check_values(tensors, where="write_dump")  # never write a dump that read_dump refuses
    from safetensors.numpy import save

    data = save(tensors, metadata=meta)  # serialised here: a full disk is then an OSError of our own write
    try:
        (target,) = write_all([(path, lambda temporary: Path(temporary).write_bytes(data))])
    except OSError as error:
        raise OSError(
            error.errno, f"{error.strerror or error}; the dump was not written (no partial file is left)", str(path)
        ) from error
    return Path(target.path)


def read_dump(path: str | os.PathLike[str]) -> LogProbDump:
    """Read and validate a dump: the header first (format, version, names, dtypes, shapes), then the values.

    Raises:
        FileNotFoundError: no such file.
        DumpFormatError: anything else wrong, in one line naming the fix.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    header, meta = _read_header(path)
    _check_header(header, meta, where=str(path))
    rows, steps = header["rollout_log_probs"][1]
    check_fits(
        rows * steps * GATE_BYTES_PER_CELL + rows * GATE_BYTES_PER_SAMPLE,
        f"gating {path} ({rows} samples x {steps} steps)",
        "gate fewer samples at a time (write dumps of fewer rows) or raise the memory limit",
    )
    try:
        with safe_open(str(path), framework="numpy") as handle:
            arrays = {name: handle.get_tensor(name) for name in header}
    except SafetensorError as error:
        raise DumpFormatError(
            f"{path}: not a readable safetensors file ({error}); write it with rollout_consistency.gate.write_dump."
        ) from error
    if CHECKSUM_KEY in meta and meta[CHECKSUM_KEY] != tables_checksum(arrays):
        raise DumpFormatError(
            f"{path}: the tensors do not match the checksum written with them ({CHECKSUM_KEY}): the file was changed "
            f"or damaged after it was written; write it again (or copy the original)."
        )
    _check_values(arrays, where=str(path))
    _check_coverage(meta, where=str(path))
    return LogProbDump(**arrays, metadata=meta)


def tables_checksum(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 (hex) of the tensors: each one's name, safetensors dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{_st_dtype(array.dtype)}|{list(array.shape)}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """(name -> (dtype, shape), metadata) from the safetensors header alone, with the data's extent checked
    against the file's size (a truncated or extended file is refused before any data is read)."""

    try:
        handle = open_regular(path, "dump")
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{path}: no such dump file; write one with rollout_consistency.gate.write_dump."
        ) from error
    with handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if length < 0 or length > min(_MAX_HEADER_BYTES, size - 8):
            raise DumpFormatError(
                f"{path}: not a safetensors file ({size} bytes, header length {length}); write it with "
                f"rollout_consistency.gate.write_dump."
            )
        text = handle.read(length)
    try:
        raw = json.loads(text)
        meta = {str(k): str(v) for k, v in (raw.pop("__metadata__", None) or {}).items()}
        header, end = {}, 0
        for name, entry in raw.items():
            dtype, shape, (begin, stop) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            item = _ITEM_BYTES.get(dtype)
            if min(shape, default=0) < 0 or begin < 0 or (item is not None and stop - begin != count * item):
                raise ValueError(f"tensor {name!r}: its data offsets do not match dtype {dtype} and shape {shape}")
            header[name] = (dtype, shape)
            end = max(end, int(stop))
    except (ValueError, TypeError, KeyError, AttributeError) as error:  # JSON, UTF-8 and layout errors
        raise DumpFormatError(
            f"{path}: not a readable safetensors file (bad header: {error}); write it with "
            f"rollout_consistency.gate.write_dump."
        ) from error
    if 8 + length + end != size:
        raise DumpFormatError(
            f"{path}: the header describes {8 + length + end} bytes but the file holds {size}; it is truncated or "
            f"has trailing bytes (copy it again, or write it again with rollout_consistency.gate.write_dump)."
        )
    return header, meta


def _st_dtype(dtype: np.dtype) -> str:
    return {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}.get(
        np.dtype(dtype), str(np.dtype(dtype))
    )


def _check_header(header: Mapping[str, tuple[str, tuple[int, ...]]], meta: Mapping[str, str], *, where: str) -> None:
    """Names, dtypes and shapes from the header alone (no data read)."""
    found = meta.get("format")
    if found != DUMP_FORMAT:
        raise DumpFormatError(
            f"{where}: metadata 'format' is {found!r}, expected {DUMP_FORMAT!r}; write the file with "
            f"rollout_consistency.gate.write_dump (a trajectory file goes to `rollout-consistency check --trajectory`)."
        )
    version = meta.get("format_version")
    if version != str(DUMP_FORMAT_VERSION):
        raise DumpFormatError(
            f"{where}: dump format_version {version!r} is not supported (this version reads "
            f"{DUMP_FORMAT_VERSION}); re-write it with this version's write_dump or upgrade rollout-consistency."
        )
    for name in header:
        if name not in _SPEC:
            close = difflib.get_close_matches(name, list(_SPEC), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known tensors: {', '.join(_SPEC)}."
            raise DumpFormatError(f"{where}: unknown tensor {name!r}.{hint}")
    for name in _TABLES:
        if name not in header:
            raise DumpFormatError(f"{where}: required tensor {name!r} is missing; both log-prob tables are needed.")
    shape = header["rollout_log_probs"][1]
    for name, (dtype, dims) in header.items():
        rank, dtypes = _SPEC[name]
        if dtype not in dtypes:
            raise DumpFormatError(
                f"{where}: {name!r} has dtype {dtype}, expected {' or '.join(dtypes)}"
                + (
                    "; store the float32 log-probs both sides computed (bf16 has lost the digits compared here, and "
                    "a cast here would change them)."
                    if rank == 2
                    else "."
                )
            )
        if len(dims) != rank:
            expected = "(N, T)" if rank == 2 else "(N,)"
            raise DumpFormatError(f"{where}: {name!r} has shape {dims}, expected {expected}.")
    if len(shape) == 2 and shape[0] == 0:
        raise DumpFormatError(f"{where}: the tables have no rows; dump at least one sample.")
    for name, (_dtype, dims) in header.items():
        expected_shape = shape if _SPEC[name][0] == 2 else shape[:1]
        if dims != expected_shape:
            raise DumpFormatError(
                f"{where}: {name!r} has shape {dims}, expected {expected_shape} (rollout_log_probs is {shape}); every "
                f"tensor must describe the same (N samples, T steps)."
            )


def _check_coverage(meta: Mapping[str, str], *, where: str) -> None:
    if COVERAGE_KEY not in meta:
        return
    try:
        parse_coverage(meta[COVERAGE_KEY])
    except ValueError as error:
        raise DumpFormatError(
            f"{where}: metadata {COVERAGE_KEY!r} is not the recorder's coverage; write the dump with Step1Recorder "
            f"or drop the key."
        ) from error


def _check_values(arrays: Mapping[str, np.ndarray], *, where: str) -> None:
    for name in ("timesteps", "advantages"):
        if name in arrays and not np.isfinite(arrays[name]).all():
            raise DumpFormatError(f"{where}: {name!r} holds NaN or inf; store the values your trainer used.")
    starts = arrays.get("window_starts")
    if starts is not None and (starts < 0).any():
        raise DumpFormatError(
            f"{where}: 'window_starts' holds {int(starts.min())}; a window starts at step 0 or later (store the "
            f"first SDE step of each sample's window)."
        )
    ids = arrays.get("sample_ids")
    if ids is not None and np.unique(ids).size != ids.size:
        raise DumpFormatError(f"{where}: 'sample_ids' repeat; each row must be one sample (drop the duplicates).")
