# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The ``experts`` guard: for a model with experts by timestep (Wan 2.2's ``transformer`` / ``transformer_2``),
both sides must score every stored step with the same expert.

A trainer that switches experts one step after the rollout did (an index off by one against the boundary), or
holds one expert throughout (a training adapter that loads only ``transformer``), scores some steps with another
network: the log-ratio there is as large as the two experts differ, and nothing in the figures says why. Each
side records which expert took each step (the rollout in `Trajectory.experts`, the built-in trainer from its
model, a trainer plug-in through its optional ``experts(batch)``); this module compares the records step by step
and names the first steps where they part, with both experts. Imports neither torch nor diffusers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ExpertComparison", "compare_experts"]

GUARD = "experts"


@dataclass(frozen=True)
class ExpertComparison:
    """What the two sides' expert records say.

    Attributes:
        compared: both sides recorded an expert for every entry that was compared (the guard then ran).
        problems: one message per disagreement kind (empty: the sides agree, or nothing was compared).
        notes: why no comparison was made, when one side recorded experts and the other did not.
        by_timestep: ``[{"timestep", "rollout": [names], "trainer": [names]}, ...]``, per schedule timestep, the
            experts each side used there (for `Report.run["experts"]`).
    """

    compared: bool
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    by_timestep: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)


def compare_experts(results: Sequence[Any], *, boundary: tuple[float, str, str] | None = None) -> ExpertComparison:
    """Compare the ``experts`` records of a check's batch results (`BatchResult.experts`: ``{"rollout": rows,
    "trainer": rows}``, rows one tuple of names per sample, in window order) entry by entry.

    Args:
        boundary: the boundary rule, ``(boundary timestep, high-noise expert, low-noise expert)``: the high-noise
            expert where ``t >= boundary``. With it, the message names the side whose record breaks the rule;
            without it, it says that which side breaks it was not measured."""
    rows: list[tuple[int, int, float, str, str]] = []  # (sample, schedule step, timestep, rollout, trainer)
    missing_side = set()
    for result in results:
        n = len(result.sample_indices)
        experts = getattr(result, "experts", None) or {}
        rollout, trainer = experts.get("rollout"), experts.get("trainer")
        if rollout is None and trainer is None:
            continue
        if rollout is None or trainer is None:
            missing_side.add("rollout" if rollout is None else "trainer")
            continue
        for i in range(n):
            start = int(result.window_starts[i])
            for k, (mine, theirs) in enumerate(zip(rollout[i], trainer[i], strict=True)):
                rows.append((int(result.sample_indices[i]), start + k, float(result.timesteps[i][k]), mine, theirs))
    notes = tuple(
        f"experts: only the {'trainer' if side == 'rollout' else 'rollout'} recorded which expert scored each step "
        f"(the {side} side records none: a trainer plug-in reports it through an `experts(batch)` method); not compared"
        for side in sorted(missing_side)
    )
    if not rows:
        return ExpertComparison(compared=False, notes=notes)
    by_timestep: dict[float, dict[str, set[str]]] = {}
    for _, _, t, mine, theirs in rows:
        entry = by_timestep.setdefault(t, {"rollout": set(), "trainer": set()})
        entry["rollout"].add(mine)
        entry["trainer"].add(theirs)
    summary = tuple(
        {"timestep": t, "rollout": sorted(v["rollout"]), "trainer": sorted(v["trainer"])}
        for t, v in sorted(by_timestep.items(), key=lambda item: -item[0])
    )
    differing = [r for r in rows if r[3] != r[4]]
    if not differing:
        return ExpertComparison(compared=True, notes=notes, by_timestep=summary)
    # One line per (step, rollout expert, trainer expert): the samples that share it are counted, not listed.
    kinds: dict[tuple[int, float, str, str], list[int]] = {}
    for sample, step, t, mine, theirs in differing:
        kinds.setdefault((step, t, mine, theirs), []).append(sample)
    parts = [
        f"step {step} (t={t:.6g}): rollout {mine}, trainer {theirs} ({len(samples)} sample{'s' * (len(samples) > 1)})"
        for (step, t, mine, theirs), samples in sorted(kinds.items())
    ]
    shown = "; ".join(parts[:6]) + (f"; … ({len(parts) - 6} more)" if len(parts) > 6 else "")
    message = (
        f"{len(differing)} of {len(rows)} stored step(s) were scored by another expert on each side: {shown}. "
        f"{_who_breaks(differing, boundary)}"
    )
    return ExpertComparison(compared=True, problems=(message,), notes=notes, by_timestep=summary)


def _who_breaks(differing: Sequence[tuple[int, int, float, str, str]], boundary: tuple[float, str, str] | None) -> str:
    """The side(s) whose expert at the differing steps is not the one the boundary rule gives (only what the
    records and the rule show)."""
    if boundary is None:
        return (
            "No boundary_ratio was given, so which side breaks the boundary rule was not measured: both must pick "
            "each step's expert with the same test (t >= boundary_ratio * 1000 for transformer)"
        )
    at, high, low = boundary

    def rule(t: float) -> str:
        return high if t >= at else low

    breaking = [
        side
        for side, column in (("rollout", 3), ("trainer", 4))
        if any(row[column] != rule(row[2]) for row in differing)
    ]
    first = min(differing, key=lambda row: (row[1], row[0]))
    said = f"The boundary rule (t >= {at:.6g}: {high}, below: {low}) gives {rule(first[2])} at step {first[1]}"
    if not breaking:  # names outside the rule's two (a plug-in's own names): neither record is the rule's
        return f"Neither record names the rule's experts ({high}, {low}): which side breaks the rule was not measured"
    if len(breaking) == 2:
        return f"{said}: both sides break it at some of these steps; both must pick each step's expert by that test"
    side = breaking[0]
    other = "trainer" if side == "rollout" else "rollout"
    return (
        f"{said}: the {side} breaks it (the {other} follows it); the {side} must pick each step's expert by that "
        f"test, never from a step index"
    )
