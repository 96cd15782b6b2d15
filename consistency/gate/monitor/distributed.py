# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""One step's statistics reduced across torch.distributed ranks: one collective per step, the figures of the
global batch on every rank, equal to one process's figures of the same batch bit for bit.

::

    stats = StepStats.from_tables(rollout_log_probs, old_log_probs, timesteps=timesteps)  # this rank's shard
    merged = reduce_step_stats(stats, step=global_step, shape=tuple(old_log_probs.shape))
    if torch.distributed.get_rank() == 0:
        verdict = judge.judge(global_step, merged.figures())                              # the verdict on rank 0

Under DDP or FSDP each rank holds whole samples (rows) of the global batch. Every sum a `StepStats` keeps is an
`ExactSum` (an integer), counts are integers and maxima are exact, so merging the ranks' statistics in any order
gives the statistics of the whole batch — every figure, per timestep too, is **bit for bit** the single-process
figure of the same global batch. (The condition: no sample's row is split across ranks, which data-parallel
sharding never does.)

**One collective.** Each rank packs its statistics into one int64 tensor of a fixed length — a header (the step,
the rank, the world size, the shard's shape, the counts, the maxima and clip ranges as their float64 bits), every
exact sum as `LIMBS` 64-bit two's-complement limbs (enough for any sum of fewer than 2**63 float64 values) plus its
non-finite part, and up to ``max_timesteps`` per-timestep slots — and one ``all_gather`` brings every rank's
tensor to every rank, which unpacks and merges them in rank order. The length depends only on
``max_timesteps``, so every rank sends the same size without asking first.

**Failing closed.** A rank that finds a problem in its own shard (more timestep values than ``max_timesteps``)
still joins the collective and says so in its header, so every rank raises the same `DistributedMonitorError`
rather than leaving the others waiting. After the gather, every rank checks that all ranks are at the same
step, hold shards with the same number of columns and the same clip range, and were started with the same world
size; any disagreement is a `DistributedMonitorError` on every rank, naming the ranks — never a merged figure. A
rank that never joins (it crashed, or skipped the monitor at this step) makes the others' wait end after
``timeout_s`` with a `DistributedMonitorError`, not a hang.

torch.distributed is imported only when `reduce_step_stats` runs.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .exact_sum import ExactSum
from .figures import StepStats, TimestepStats

__all__ = ["DEFAULT_MAX_TIMESTEPS", "LIMBS", "DistributedMonitorError", "pack_stats", "reduce_step_stats", "unpack"]

#: 64-bit limbs per exact sum: |numerator| < 2**63 values × 2**1024 × 2**SHIFT(1128) < 2**2215, plus a sign bit.
LIMBS = 35
#: Per-timestep slots in a packed step, unless the caller gives another bound.
DEFAULT_MAX_TIMESTEPS = 128

_MAGIC = 0x52435354  # "RCST"
_VERSION = 1
_HEADER = (
    "magic",
    "version",
    "step",
    "rank",
    "world",
    "rows",
    "columns",
    "entries",
    "samples",
    "nonfinite",
    "clip_higher",
    "clip_lower",
    "max_abs",
    "clip_ratio_low",
    "clip_ratio_high",
    "timesteps",
    "too_many_timesteps",
    "sums",
)
_FLOAT_FIELDS = {"max_abs", "clip_ratio_low", "clip_ratio_high"}
_SUM = LIMBS + 1  # limbs, then the non-finite part's float64 bits
_SLOT = 4 + _SUM  # t, entries, nonfinite, max_abs, then Σ|Δ|


class DistributedMonitorError(RuntimeError):
    """The ranks cannot give one step's figures: they disagree, one is missing, or one's shard does not fit."""


def reduce_step_stats(
    stats: StepStats,
    *,
    step: int,
    shape: Sequence[int],
    max_timesteps: int = DEFAULT_MAX_TIMESTEPS,
    timeout_s: float = 300.0,
    group: Any = None,
) -> StepStats:
    """The statistics of the global batch: this rank's `stats` merged with every other rank's (one all_gather).

    Args:
        stats: this rank's `StepStats` (`StepStats.from_tables` on its shard).
        step: the training step (every rank must pass the same).
        shape: this rank's table shape ``(rows, columns)``; ranks must agree on the columns.
        max_timesteps: per-timestep slots sent (the same on every rank); more timestep values is an error.
        timeout_s: how long to wait for the other ranks before `DistributedMonitorError`.
        group: the process group (default: the world).

    Without an initialised process group, or with one rank, returns `stats` unchanged.

    Raises:
        DistributedMonitorError: ranks at different steps, with different columns, clip ranges or world sizes, a
            rank with more than ``max_timesteps`` timestep values, or a rank that did not join within
            ``timeout_s``. Every rank that joins raises the same error.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return stats
    world = dist.get_world_size(group)
    if world == 1:
        return stats
    rank = dist.get_rank(group)
    packed = torch.from_numpy(pack_stats(stats, step=step, rank=rank, world=world, shape=shape, slots=max_timesteps))
    gathered = [torch.empty_like(packed) for _ in range(world)]
    work = dist.all_gather(gathered, packed, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DistributedMonitorError(
            f"step {step}: not every one of the {world} ranks joined the monitor's reduction within {timeout_s:g} s "
            f"(a rank crashed, or skipped the monitor at this step; every rank must call it once per step): {first}"
        ) from error
    return unpack([tensor.numpy() for tensor in gathered], expected_world=world, sum_names=list(stats.sums))


def pack_stats(stats: StepStats, *, step: int, rank: int, world: int, shape: Sequence[int], slots: int) -> np.ndarray:
    """One rank's statistics as a 1-D int64 array of a length that depends only on `slots` (module docstring)."""
    if len(tuple(shape)) != 2:
        raise DistributedMonitorError(f"shape must be (rows, columns) of the rank's table, got {tuple(shape)}.")
    if slots < 1:
        raise DistributedMonitorError(f"max_timesteps must be at least 1, got {slots}.")
    names = sorted(stats.sums)
    rows, columns = (int(n) for n in shape)
    header = {
        "magic": _MAGIC,
        "version": _VERSION,
        "step": int(step),
        "rank": int(rank),
        "world": int(world),
        "rows": rows,
        "columns": columns,
        "entries": stats.entries,
        "samples": stats.samples,
        "nonfinite": stats.nonfinite,
        "clip_higher": stats.clip_higher,
        "clip_lower": stats.clip_lower,
        "max_abs": _bits(stats.max_abs),
        "clip_ratio_low": _bits(stats.clip_ratio_low),
        "clip_ratio_high": _bits(stats.clip_ratio_high),
        "timesteps": len(stats.by_timestep),
        "too_many_timesteps": int(len(stats.by_timestep) > slots),
        "sums": len(names),
    }
    out = np.zeros(len(_HEADER) + (len(names) + 1) * _SUM + slots * _SLOT, dtype=np.int64)
    out[: len(_HEADER)] = [header[name] for name in _HEADER]
    at = len(_HEADER)
    for total in [stats.sums[name] for name in names] + [stats.abs_delta]:
        out[at : at + _SUM] = _pack_sum(total)
        at += _SUM
    for t, row in list(stats.by_timestep.items())[:slots]:
        out[at : at + 4] = [_bits(t), row.entries, row.nonfinite, _bits(row.max_abs)]
        out[at + 4 : at + _SLOT] = _pack_sum(row.abs_delta)
        at += _SLOT
    return out


def unpack(packed: Sequence[np.ndarray], *, expected_world: int, sum_names: Sequence[str]) -> StepStats:
    """Every rank's packed statistics (in rank order) checked against each other and merged (module docstring);
    `sum_names`: the names of this rank's `StepStats.sums`."""
    headers = [dict(zip(_HEADER, (int(v) for v in array[: len(_HEADER)]), strict=True)) for array in packed]
    _check(headers, expected_world, _slots(packed[0], len(sum_names)))
    names = sorted(sum_names)
    merged: StepStats | None = None
    for array, header in zip(packed, headers, strict=True):
        one = _unpack_one(array, header, names)
        merged = one if merged is None else merged.merge(one)
    assert merged is not None
    return merged


def _slots(array: np.ndarray, sums: int) -> int:
    return (array.size - len(_HEADER) - (sums + 1) * _SUM) // _SLOT


def _check(headers: list[dict[str, int]], expected_world: int, slots: int) -> None:
    def where(show: Any) -> str:
        return ", ".join(f"rank {h['rank']} {show(h)}" for h in headers)

    if any(h["magic"] != _MAGIC or h["version"] != _VERSION for h in headers):
        raise DistributedMonitorError(
            "a rank sent something that is not this version's packed statistics; run the same rollout-consistency "
            "on every rank."
        )
    if [h["rank"] for h in headers] != list(range(len(headers))) or len(headers) != expected_world:
        ranks = ", ".join(str(h["rank"]) for h in headers)
        raise DistributedMonitorError(f"expected ranks 0..{expected_world - 1}, got ranks {ranks}.")
    if len({h["world"] for h in headers}) > 1:
        raise DistributedMonitorError(f"the ranks disagree on the world size: {where(lambda h: h['world'])}.")
    if len({h["step"] for h in headers}) > 1:
        raise DistributedMonitorError(
            f"the ranks are at different steps ({where(lambda h: 'at step ' + str(h['step']))}): a rank skipped or "
            f"repeated the monitor; call it once per step on every rank."
        )
    step = headers[0]["step"]
    over = [h for h in headers if h["too_many_timesteps"]]
    if over:
        shown = ", ".join(f"rank {h['rank']} has {h['timesteps']}" for h in over)
        raise DistributedMonitorError(
            f"step {step}: {shown} timestep values, more than the {slots} slots sent; raise "
            f"max_timesteps to at least {max(h['timesteps'] for h in over)} on every rank."
        )
    if len({h["columns"] for h in headers}) > 1:
        raise DistributedMonitorError(
            f"step {step}: the ranks' tables have different numbers of columns "
            f"({where(lambda h: 'has ' + str((h['rows'], h['columns'])))}); every rank must score the same steps."
        )
    if len({(h["clip_ratio_low"], h["clip_ratio_high"]) for h in headers}) > 1:
        raise DistributedMonitorError(f"step {step}: the ranks use different clip ranges; give every rank the same.")
    if len({h["sums"] for h in headers}) > 1:
        raise DistributedMonitorError(f"step {step}: the ranks keep different sums; run the same version everywhere.")


def _unpack_one(array: np.ndarray, header: dict[str, int], names: list[str]) -> StepStats:
    count = header["sums"]
    if len(names) != count:
        raise DistributedMonitorError("a rank keeps different sums than this one; run the same version everywhere.")
    at = len(_HEADER)
    totals = []
    for _ in range(count + 1):
        totals.append(_unpack_sum(array[at : at + _SUM]))
        at += _SUM
    by_timestep = {}
    for _ in range(header["timesteps"]):
        t, entries, nonfinite, max_abs = array[at : at + 4].tolist()
        by_timestep[_float(t)] = TimestepStats(
            int(entries), int(nonfinite), _unpack_sum(array[at + 4 : at + _SLOT]), _float(max_abs)
        )
        at += _SLOT
    return StepStats(
        entries=header["entries"],
        samples=header["samples"],
        nonfinite=header["nonfinite"],
        sums=dict(zip(names, totals[:count], strict=True)),
        abs_delta=totals[count],
        max_abs=_float(header["max_abs"]),
        clip_higher=header["clip_higher"],
        clip_lower=header["clip_lower"],
        by_timestep=by_timestep,
        clip_ratio_low=_float(header["clip_ratio_low"]),
        clip_ratio_high=_float(header["clip_ratio_high"]),
    )


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _pack_sum(total: ExactSum) -> np.ndarray:
    width = 64 * LIMBS
    if total.numerator.bit_length() >= width:  # cannot happen below 2**63 values; refuse rather than wrap
        raise DistributedMonitorError("an exact sum is wider than the packed limbs; this is a bug, please report it.")
    raw = (total.numerator & ((1 << width) - 1)).to_bytes(8 * LIMBS, "little")
    limbs = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    return np.concatenate([limbs, np.array([_bits(total.special)], dtype=np.int64)])


def _unpack_sum(limbs: np.ndarray) -> ExactSum:
    raw = np.ascontiguousarray(limbs[:LIMBS], dtype="<i8").tobytes()
    special = _float(int(limbs[LIMBS]))
    return ExactSum(int.from_bytes(raw, "little", signed=True), 0.0 if special == 0.0 else special)
