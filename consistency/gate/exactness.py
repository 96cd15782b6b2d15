# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""When `exact` is promised, and the hint a FAIL under `exact` gets when the configuration does not promise it.

`exact` (bit-for-bit) holds on any machine only when both sides run each sample's forward as the same
computation: the same batch composition, or batch-invariant mode (`--batch-invariant`). A trainer micro-batch
or a step-wise running batch that differs from the rollout batch may take other kernels (MKL and cuBLAS pick
them by CPU and shape) and differ by a few ULP — not a bug, and not something `exact` can promise.
"""

from __future__ import annotations

from dataclasses import replace

from .config import CheckConfig
from .metrics import ConsistencyMetrics
from .verdict import Verdict

__all__ = ["ROUNDING_LEVEL", "batch_composition_mix", "with_batch_composition_hint"]

#: Largest max |Δlogp| read as rounding-level: float32 log-probs of magnitude ~1 are ~1e-7 per ULP, so this
#: is ~100 ULP — kernel and batch-composition differences on the tiny models are 1e-7 to 1e-6.
ROUNDING_LEVEL = 1e-5


def batch_composition_mix(config: CheckConfig) -> str | None:
    """How the configuration runs a sample's forward in batches of another composition than its rollout batch
    (None when it does not, or in batch-invariant mode): the condition under which `exact` is not promised."""
    if config.batch_invariant:
        return None
    mixes = []
    if config.resolved_micro_batch_size != config.rollout_batch_size:
        mixes.append(
            f"trainer micro-batches of {config.resolved_micro_batch_size} re-score rollout batches of "
            f"{config.rollout_batch_size}"
        )
    if config.step_execution and (config.stagger_arrivals or config.max_num_seqs < config.rollout_batch_size):
        mixes.append("the step-wise engine's running batches differ from the trainer's batches")
    return "; ".join(mixes) or None


def with_batch_composition_hint(verdict: Verdict, config: CheckConfig, metrics: ConsistencyMetrics | None) -> Verdict:
    """`verdict`, with a failing metric check of an `exact` FAIL at rounding level explaining that the
    difference may come from batch composition and naming `--batch-invariant` (unchanged otherwise)."""
    if verdict.passed or metrics is None or config.resolved_profile != "exact":
        return verdict
    mix = batch_composition_mix(config)
    worst = metrics.overall.max_abs_dlogp
    if mix is None or not 0 < worst <= ROUNDING_LEVEL:
        return verdict
    hint = (
        f" — max |dlogp| {worst:.3g} is rounding-level and may come from batch composition ({mix}): 'exact' is not "
        f"promised in this configuration. Rerun with --batch-invariant (every sample's forward at batch 1: "
        f"bit-exact across batch compositions), or use --profile kernel"
    )
    # Once, on max_abs_dlogp (or the first failing metric when that one holds): the hint is about the run.
    failing = [c.name for c in verdict.checks if c.kind == "metric" and not c.passed]
    if not failing:
        return verdict
    target = "max_abs_dlogp" if "max_abs_dlogp" in failing else failing[0]
    checks = tuple(replace(c, message=c.message + hint) if c.name == target else c for c in verdict.checks)
    return replace(verdict, checks=checks)
