# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Pair the two sides' model calls by what they computed: the same sample at the same denoising step.

Users' loops carry no sample ids, batch rows in their own ways (CFG as one forward of ``[negative;
positive]`` or as two forwards, one sample per forward, shuffled micro-batches, permuted timesteps), so calls are
paired by content, never by position:

1. **The rollout's rows are labelled** ``(sample, step)``: rows are grouped by the timestep they were given
   (the denoising order of the distinct values is the step), and within a group the distinct latents, in
   order of first appearance, are the batch's samples in order. Every rollout starts from noise and walks
   the schedule, so this holds for batched, per-sample and step-wise loops alike.
2. **Each trainer row is paired** with the rollout row whose latents are nearest (relative max difference
   below `SAME_LATENTS`: low-precision rounding, never another step or sample); rows with equal latents
   (the passes of CFG) are told apart by their text conditioning.
3. **Units** ``(sample, step)`` then hold each side's forwards (passes) over that sample and step; the passes
   of a unit are paired by conditioning, and each pair is compared stage by stage (`compare_pair`).

Shapes: recorded rows are float64 ``(rows, -1)`` (`rollout_consistency.gate.diagnosis.replay`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Below this max |Δ| / max |x|, two latents rows are the same sample at the same step (bf16 rounding is
#: 2⁻⁹ relative; consecutive steps or other samples differ by tenths).
SAME_LATENTS = 1e-2
_PROBE = 256  # values per row compared first, to find the nearest row cheaply


@dataclass(frozen=True)
class RowRef:
    """One row of one forward: ``call`` (index into the side's calls) and ``row``."""

    call: int
    row: int


@dataclass
class Unit:
    """One (sample, step) of the batch and each side's forwards over it (rows of their calls)."""

    sample: int
    step: int
    rollout: list[RowRef] = field(default_factory=list)
    trainer: list[RowRef] = field(default_factory=list)
    latent_distance: float = 0.0  # the largest relative distance of a trainer row paired here


@dataclass
class Matching:
    """The units, the trainer rows paired to none, and the distinct timestep values in denoising order."""

    units: dict[tuple[int, int], Unit]
    unmatched: list[RowRef]
    step_values: list[float]
    labelled: bool


# ----------------------------------------------------------------------------------------------------
def _latents(call: Any) -> Any:
    value = call.inputs.get("inputs.latents")
    return value if _is_rows(value) else None


def _is_rows(value: Any) -> bool:
    return hasattr(value, "shape") and getattr(value, "dim", lambda: 0)() == 2


def row_timestep(call: Any, row: int) -> float | None:
    value = call.inputs.get("inputs.timestep")
    if not _is_rows(value) or value.shape[1] != 1:
        return None
    return float(value[row, 0])


def label_rollout(calls: Sequence[Any], n: int) -> tuple[dict[RowRef, tuple[int, int]], list[float], bool]:
    """``RowRef → (sample, step)`` for the rollout's rows, the step values (denoising order), and whether every
    step group held exactly `n` samples."""
    groups: dict[float, list[RowRef]] = {}
    for call in calls:
        if _latents(call) is None:
            continue
        for row in range(call.rows):
            value = row_timestep(call, row)
            if value is not None:
                groups.setdefault(value, []).append(RowRef(call.index, row))
    values = sorted(groups, reverse=True)
    labels: dict[RowRef, tuple[int, int]] = {}
    complete = True
    for step, value in enumerate(values):
        seen: dict[bytes, int] = {}
        for ref in groups[value]:
            key = _latents(calls[ref.call])[ref.row].numpy().tobytes()
            if key not in seen:
                seen[key] = len(seen)
            labels[ref] = (seen[key], step)
        complete = complete and len(seen) == n
    return labels, values, complete


def match_calls(rollout_calls: Sequence[Any], trainer_calls: Sequence[Any], n: int) -> Matching:
    """Label the rollout's rows, pair every trainer row with its rollout row, and collect the units."""
    import torch

    labels, values, complete = label_rollout(rollout_calls, n)
    units: dict[tuple[int, int], Unit] = {}
    refs = list(labels)
    for ref in refs:
        sample, step = labels[ref]
        units.setdefault((sample, step), Unit(sample, step)).rollout.append(ref)
    unmatched: list[RowRef] = []
    if not refs:
        return Matching(units, [RowRef(c.index, r) for c in trainer_calls for r in range(c.rows)], values, False)
    bank = torch.stack([_latents(rollout_calls[r.call])[r.row] for r in refs])
    width = bank.shape[1]
    stride = max(1, width // _PROBE)
    probe = bank[:, ::stride]
    scale = bank.abs().amax(dim=1).clamp_min(1e-30)
    for call in trainer_calls:
        latents = _latents(call)
        if latents is None or latents.shape[1] != width:
            unmatched.extend(RowRef(call.index, r) for r in range(call.rows))
            continue
        for row in range(call.rows):
            x = latents[row]
            near = ((probe - x[::stride]).abs().amax(dim=1) / scale).argsort()[:8]
            distances = [(float((bank[i] - x).abs().max() / scale[i]), int(i)) for i in near]
            best = min(d for d, _ in distances)
            if not best < SAME_LATENTS:
                unmatched.append(RowRef(call.index, row))
                continue
            ties = [refs[i] for d, i in distances if d <= best * (1 + 1e-9) + 1e-15]
            chosen = min(ties, key=lambda r: conditioning_distance(rollout_calls[r.call], r.row, call, row))
            unit = units[labels[chosen]]
            unit.trainer.append(RowRef(call.index, row))
            unit.latent_distance = max(unit.latent_distance, best)
    return Matching(units, unmatched, values, complete)


def conditioning_distance(a_call: Any, a_row: int, b_call: Any, b_row: int) -> float:
    """Max |Δ| of the text conditioning (and pooled text) of two rows; inf when their shapes differ."""
    total = 0.0
    for stage in ("inputs.conditioning", "inputs.pooled"):
        a, b = a_call.inputs.get(stage), b_call.inputs.get(stage)
        if a is None and b is None:
            continue
        if not (_is_rows(a) and _is_rows(b)) or a.shape[1] != b.shape[1]:
            return math.inf
        total = max(total, float((a[a_row] - b[b_row]).abs().max()))
    return total


def pair_passes(unit: Unit, rollout_calls: Sequence[Any], trainer_calls: Sequence[Any]):
    """The unit's passes paired by conditioning: ``([(rollout ref, trainer ref)], rollout left, trainer left)``."""
    left = list(unit.rollout)
    pairs = []
    extra = []
    for t in unit.trainer:
        if not left:
            extra.append(t)
            continue
        t_call = trainer_calls[t.call]
        r = min(left, key=lambda r: conditioning_distance(rollout_calls[r.call], r.row, t_call, t.row))
        left.remove(r)
        pairs.append((r, t))
    return pairs, left, extra


# ----------------------------------------------------------------------------------------------------
# Per-key pairing: which row of which key of the batch the trainer received a recorded value came from.
@dataclass(frozen=True)
class KeyRow:
    """Where a value sits in the batch the trainer received: ``batch[key][row]``, entry ``entry`` of the row's
    values cut into pieces of the value's size (a step index for ``(n, steps, ...)`` latents, 0 for a
    per-sample tensor)."""

    key: str
    row: int
    entry: int


def batch_keys(batch: Any, n: int) -> dict[str, Any]:
    """The batch's per-sample tensors (first dimension `n`), by key, as float64 ``(n, -1)``: a dict's items, or
    an object's attributes (a `Trajectory`), with one level of nested dicts (``conditioning.prompt_embeds``)."""
    import torch

    def items(value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict):
            return list(value.items())
        return list(getattr(value, "__dict__", {}).items())

    out: dict[str, Any] = {}
    for name, value in items(batch):
        nested = [(f"{name}.{k}", v) for k, v in items(value)] if isinstance(value, dict) else [(str(name), value)]
        for key, tensor in nested:
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[0] == n and not tensor.is_complex():
                out[key] = tensor.detach().to("cpu", torch.float64).reshape(n, -1)
    return out


def locate(value: Any, keys: dict[str, Any]) -> list[KeyRow]:
    """Every place in `keys` (`batch_keys`) holding exactly `value` (a recorded row, float64): equality, not
    nearness, so a value found is the one the trainer took from there (a cast copy is found nowhere)."""
    size = value.numel()
    found: list[KeyRow] = []
    if not size:
        return found
    for key, rows in keys.items():
        if rows.shape[1] % size:
            continue
        view = rows.reshape(rows.shape[0], rows.shape[1] // size, size)
        hits = (view == value.reshape(1, 1, size)).all(dim=2).nonzero().tolist()
        found += [KeyRow(key, row, entry) for row, entry in hits]
    return found
