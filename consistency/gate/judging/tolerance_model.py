# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which differences a configuration legitimately has, what each profile can promise, and the floor.

A step-1 check compares two computations. Their log-probs agree bit for bit only when both run the same
code on the same float32 inputs in the same batch composition (or in batch-invariant mode). Each setting
that breaks one of these is a *source of difference* that is not a bug:

=====================  ========================================================  ====================
source                 the configuration has it when                              profile for it
=====================  ========================================================  ====================
``kernel``             the attention kernels differ (or the rollout engine is     ``kernel``,
                       vLLM-omni)                                                 ``calibrated``
``batch composition``  the trainer's micro-batches are not the rollout's batches  ``calibrated`` (or
                       (or the rollout is step-wise), and batch-invariant mode    batch-invariant mode
                       is off                                                      for ``exact``)
``implementation``     the trainer's SDE step is other code for the same maths    ``implementation``
``dtype``              the two sides' transformer dtypes differ                   none: align them
=====================  ========================================================  ====================

[`difference_sources`] lists them, [`exact_notice`] is the line the report prints before any figure when
``exact`` cannot be promised (or, with a plug-in side, the condition it rests on: the checker cannot see a
plug-in's kernels), [`rounding_advice`] explains a FAIL at a few ULP, and [`floor_variants`] /
[`calibration_floor`] say what the ``calibrated`` floor measures and combine it: the trainer recomputes the
same stored trajectory once per source with that one thing changed
(`rollout_consistency.gate.sides.floor_tables.measure_floor_tables`), and the floor is the sum of the per-source
figures (differences add at most linearly; the rms adds at most as the
sum of rms). Nothing here reads the environment: everything follows from the settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_consistency.safeguards.object_spec import is_object_spec

from .metrics import METRICS, ConsistencyMetrics, MetricsInputError, MetricValues, compute_metrics
from .settings import JudgingSettings
from .tolerances import Tolerance

#: |Δlogp| at or below this is "rounding-sized" (≈100 float32 ULP of a log-prob near 1).
ROUNDING_SIZED = 1e-5


@dataclass(frozen=True)
class DifferenceSource:
    """One legitimate source of difference: its name, what differs in this configuration, what to use."""

    name: str
    detail: str
    remedy: str


def _trainer_name(settings: JudgingSettings) -> str:
    return "PyTorch" if settings.trainer_backend == "torch" else repr(settings.trainer_backend)


def plugin_sides(settings: JudgingSettings) -> tuple[str, ...]:
    """The sides of `settings` that are the user's own code (plug-ins): the checker cannot see their kernels."""
    return tuple(side for side in ("rollout", "trainer") if is_object_spec(getattr(settings, f"{side}_backend")))


def difference_sources(settings: JudgingSettings) -> tuple[DifferenceSource, ...]:
    """The legitimate sources of difference between the two sides of `settings`.

    A plug-in side is none by itself: whether it runs the other side's code and kernels is the user's to say
    (`exact_notice` states the condition)."""
    sources = []
    if settings.rollout_backend != "torch" and "rollout" not in plugin_sides(settings):
        sources.append(
            DifferenceSource(
                "kernel",
                f"the rollout engine is {settings.rollout_backend}, the trainer {_trainer_name(settings)}",
                "--profile kernel",
            )
        )
    elif settings.rollout_attention != settings.trainer_attention:
        sources.append(
            DifferenceSource(
                "kernel",
                f"rollout attention {settings.rollout_attention!r}, trainer attention {settings.trainer_attention!r}",
                "--profile kernel or calibrated",
            )
        )
    if not settings.rollout_from_file and not settings.batch_invariant:
        rows, micro = settings.rollout_batch_size, settings.micro_batch_size
        if settings.step_execution:
            detail = (
                f"the step-wise rollout forwards the requests running at each step (up to {settings.max_num_seqs}), "
                f"the trainer micro-batches of {micro}"
            )
        elif micro != rows:
            detail = f"the rollout forwards batches of {rows} rows, the trainer micro-batches of {micro}"
        else:
            detail = ""
        if detail:
            sources.append(
                DifferenceSource("batch composition", detail, "--batch-invariant (keeps exact) or --profile calibrated")
            )
    implementation = settings.trainer_step_implementation
    if implementation != "reference":
        sources.append(
            DifferenceSource(
                "implementation",
                f"the trainer's SDE step is the {implementation!r} implementation, the rollout's the reference",
                "--profile implementation or calibrated",
            )
        )
    if settings.rollout_dtype != settings.trainer_dtype:
        sources.append(
            DifferenceSource(
                "dtype",
                f"rollout transformer {settings.rollout_dtype}, trainer {settings.trainer_dtype}",
                "run both sides in one dtype",
            )
        )
    return tuple(sources)


def exact_promised(settings: JudgingSettings) -> bool:
    """Whether ``exact`` (bit-for-bit) is a promise for `settings`: no source of difference at all."""
    return not difference_sources(settings)


def _describe(sources: Sequence[DifferenceSource]) -> str:
    return "; ".join(f"{s.name} ({s.detail}): use {s.remedy}" for s in sources)


def _plugin_condition(settings: JudgingSettings) -> str | None:
    """What ``exact`` rests on when a side is the user's code (``None`` when neither is)."""
    sides = plugin_sides(settings)
    if not sides:
        return None
    # The header line names the plug-ins already; this one says what the verdict rests on.
    named = "the rollout and the trainer are plug-ins" if len(sides) == 2 else f"the {sides[0]} is a plug-in"
    return (
        f"exact holds only if both sides run the same code on the same kernels in the same batch composition: "
        f"{named}, whose kernels the checker cannot see (the plug-in template's pair does; a rollout on another "
        f"engine, vLLM, SGLang or a compiled graph, needs --profile kernel)"
    )


def exact_notice(settings: JudgingSettings) -> str | None:
    """The line printed before any figure when `settings` ask for ``exact`` but cannot be promised it, or when
    the promise rests on a plug-in side's code (the condition, then)."""
    sources, condition = difference_sources(settings), _plugin_condition(settings)
    if not sources:
        return condition
    notice = (
        "exact is NOT promised for this configuration (bits may still agree on this machine; a difference of "
        "a few ULP is not a bug here): " + _describe(sources)
    )
    return notice if condition is None else f"{notice}; {condition}"


def rounding_advice(settings: JudgingSettings, max_abs_dlogp: float) -> str | None:
    """Why an ``exact`` FAIL by a rounding-sized difference happened, and which profile or mode to use.

    ``None`` when the difference is not rounding-sized (a real bug) or not a number.
    """
    if not (math.isfinite(max_abs_dlogp) and 0 < max_abs_dlogp <= ROUNDING_SIZED):
        return None
    ulps = max_abs_dlogp / 2.0**-24
    head = f"max |dlogp| {max_abs_dlogp:.3g} is rounding-sized (~{ulps:.3g} float32 ULP of a log-prob near 1)"
    sources = difference_sources(settings)
    if sources:
        return f"{head}; the configuration has {_describe(sources)}"
    if plugin_sides(settings):
        return (
            f"{head}; {_plugin_condition(settings)}; with the same code, kernels and batches on both sides it is a "
            f"different computation, not noise (for another SDE step, --profile implementation)"
        )
    return (
        f"{head} with the same code, inputs, kernel and batch composition on both sides: that is a different "
        f"computation (a forward that depends on its batch-mates or its position, a RoPE length), not noise"
    )


# ----------------------------------------------------------------------------------------------------
# The calibrated floor: the trainer against itself with one source of difference changed at a time.
def floor_variants(settings: JudgingSettings, default_kernel: str | None) -> dict[str, dict[str, Any]]:
    """Per source: the trainer recompute settings that differ from the trainer's own in that source only.

    The kernel floor is always measured (it also stands for engine differences the configuration cannot
    name); batch composition and implementation when the configuration has them.
    """
    variants: dict[str, dict[str, Any]] = {}
    if default_kernel is not None:
        variants["kernel"] = {"kernel": default_kernel}
    names = {s.name for s in difference_sources(settings)}
    if "batch composition" in names:
        micro, rows = settings.micro_batch_size, settings.rollout_batch_size
        other = rows if micro != rows else (1 if rows > 1 else None)
        if other is not None and other != micro:
            variants["batch composition"] = {"micro_batch_size": other}
    if "implementation" in names:
        variants["implementation"] = {"implementation": "reference"}
    return variants


def combine_floors(parts: Sequence[MetricValues]) -> MetricValues:
    """One floor from per-source floors: mean-type figures add (triangle inequality), the rms adds
    (``approx_kl = ½·(Σ rms)²``), the max adds; a figure gated by its distance from agreement (``ratio_mean``,
    ``ppo_kl``) adds its deviations."""
    if len(parts) == 1:
        return parts[0]
    total: dict[str, float] = {}
    for metric in METRICS.values():
        values = [p.get(metric.name) for p in parts]
        if metric.scale == "rms":
            total[metric.name] = 0.5 * sum(math.sqrt(2.0 * max(v, 0.0)) if math.isfinite(v) else v for v in values) ** 2
        elif metric.agreement is not None:
            total[metric.name] = metric.agreement + sum(metric.deviation(v) for v in values)
        else:
            total[metric.name] = sum(values)
    return MetricValues(total, count=min(p.count for p in parts))


def calibration_floor(
    trainer: np.ndarray, tables: Mapping[str, np.ndarray], **settings: Any
) -> tuple[MetricValues, dict[str, MetricValues]]:
    """The combined floor and each source's own, from the trainer's table and one table per source.

    Args:
        trainer (`(B, W)` float32): the trainer's log-probs as gated.
        tables: source name -> `(B, W)` float32 log-probs of the trainer with that source changed.
        **settings: `compute_metrics` settings (clip ratios, micro-batch size).

    Raises:
        MetricsInputError: a table cannot be compared with the trainer's (shape, dtype), or no table.
    """
    if not tables:
        raise MetricsInputError("no floor was measured")
    parts = {source: compute_metrics(trainer, table, **settings).overall for source, table in tables.items()}
    return combine_floors(list(parts.values())), parts


def exact_promise(
    settings: JudgingSettings, tolerance: Tolerance, metrics: ConsistencyMetrics | None
) -> tuple[Tolerance, str | None]:
    """For an ``exact`` check: the tolerance with the not-promised notice first in its basis (the report
    prints it before any figure), and the advice for a rounding-sized FAIL (or ``None``)."""
    import dataclasses

    notice = exact_notice(settings)
    if notice:
        tolerance = dataclasses.replace(tolerance, basis=f"{notice}. Limits: {tolerance.basis}")
    advice = None
    if metrics is not None and metrics.overall.count:
        advice = rounding_advice(settings, metrics.overall.max_abs_dlogp)
    return tolerance, advice
