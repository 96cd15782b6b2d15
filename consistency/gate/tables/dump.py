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

Other metadata keys (strings) are kept and shown in the report's notes. Reading validates the header —
format, version, tensor names, dtypes and shapes — before any data is loaded, then the values (timesteps and
advantages finite, ids unique); every error is one line naming the fix. NaN/inf *log-probs* are allowed:
they are a finding, and the gate FAILs them (``finite``). Adding an optional tensor keeps version 1;
renaming or removing one, or changing a dtype, bumps it.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DUMP_FORMAT = "rollout-consistency/logprob-dump"
DUMP_FORMAT_VERSION = 1

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
_NUMPY_DTYPE = {"F32": np.float32, "I64": np.int64, "I32": np.int32}


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
        """`rollout_consistency.gate.gate` on this dump's tables, with `settings` (a `GateSettings`) and/or its
        fields as keywords (profile, clip_ratio, ...); the notes default to the dump's metadata."""
        from .api import gate

        extra = {k: v for k, v in self.metadata.items() if k not in ("format", "format_version")}
        notes = [f"dump metadata: {', '.join(f'{k}={v}' for k, v in sorted(extra.items()))}"] if extra else []
        if "notes" not in overrides and (settings is None or not settings.notes):
            overrides["notes"] = notes
        return gate(**self.arrays(), settings=settings, **overrides)


def write_dump(
    path: str | os.PathLike[str],
    rollout_log_probs: Any,
    trainer_log_probs: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    **columns: Any,
) -> Path:
    """Write a dump (format version 1), atomically: a reader never sees half a file.

    Args:
        path: the ``.safetensors`` file to write (its directory is created).
        rollout_log_probs, trainer_log_probs (`(N, T)` float32, NumPy or torch): the two tables. float32 only:
            rounding float64 log-probs here would change the numbers being compared; convert both sides
            before the comparison, not after.
        metadata: extra string metadata (e.g. ``{"trainer": "flow_grpo", "run": "..."}``).
        **columns: the optional tensors by name, as in the module docstring: ``timesteps`` (`(N, T)`),
            ``sample_ids``, ``prompt_groups``, ``window_starts`` (`(N,)` int), ``advantages`` (`(N,)`); `None`
            leaves one out.

    Raises:
        DumpFormatError: a table or vector of the wrong shape or dtype, or a column the format does not have
            (nothing is written).
    """
    unknown = sorted(set(columns) - set(_SPEC))
    if unknown:
        raise DumpFormatError(
            f"write_dump: no column {', '.join(map(repr, unknown))}; the optional ones are "
            f"{', '.join(n for n in _SPEC if n not in _TABLES)}."
        )
    given = {"rollout_log_probs": rollout_log_probs, "trainer_log_probs": trainer_log_probs, **columns}
    tensors: dict[str, np.ndarray] = {}
    for name, value in given.items():
        if value is None:
            continue
        array = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
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
    header = {name: (_st_dtype(a.dtype), tuple(a.shape)) for name, a in tensors.items()}
    _check_header(header, meta, where="write_dump")
    from safetensors.numpy import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=meta)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def read_dump(path: str | os.PathLike[str]) -> LogProbDump:
    """Read and validate a dump: the header first (format, version, names, dtypes, shapes), then the values.

    Raises:
        FileNotFoundError: no such file.
        DumpFormatError: anything else wrong, in one line naming the fix.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dump file; write one with rollout_consistency.gate.write_dump.")
    try:
        with safe_open(str(path), framework="numpy") as handle:
            meta = dict(handle.metadata() or {})
            header = {
                name: (handle.get_slice(name).get_dtype(), tuple(handle.get_slice(name).get_shape()))
                for name in handle.keys()  # noqa: SIM118 (a safe_open handle is not iterable)
            }
            _check_header(header, meta, where=str(path))
            arrays = {name: handle.get_tensor(name) for name in header}
    except SafetensorError as error:
        raise DumpFormatError(
            f"{path}: not a readable safetensors file ({error}); write it with rollout_consistency.gate.write_dump."
        ) from error
    _check_values(arrays, where=str(path))
    return LogProbDump(**arrays, metadata=meta)


# ----------------------------------------------------------------------------------------------------
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


def _check_values(arrays: Mapping[str, np.ndarray], *, where: str) -> None:
    for name in ("timesteps", "advantages"):
        if name in arrays and not np.isfinite(arrays[name]).all():
            raise DumpFormatError(f"{where}: {name!r} holds NaN or inf; store the values your trainer used.")
    ids = arrays.get("sample_ids")
    if ids is not None and np.unique(ids).size != ids.size:
        raise DumpFormatError(f"{where}: 'sample_ids' repeat; each row must be one sample (drop the duplicates).")
