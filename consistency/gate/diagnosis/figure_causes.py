# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Causes from the figures alone: the report's metrics, the settings it records, and (where the doctor runs
next to them: `gate()`, the check) the two log-prob tables' signature
(`rollout_consistency.gate.diagnosis.table_signatures`).

Honest by construction:

* a cause is named first only when the figures separate it (a constant ratio, a constant offset, an offset per
  timestep, Δ moving with the log-prob itself, or a signature together with a setting the report records);
* otherwise every cause that would give these figures is listed at one shared confidence, with the command that
  separates them (`LOCALISE_HINT`);
* ``attention-kernel`` and ``batch-composition`` (no bug) are named only when the report records that the two
  sides' kernels or batch compositions differ, or a measured floor explains the size; a rounding-sized
  difference with no recorded source is a different computation, never noise;
* evidence lines state what the report records, never what it does not; a family's own cause
  (``mask-sum-rope``: Qwen-Image) only for that family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis

from .catalogue import LOCALISE_HINT, make
from .cause_registry import CAUSES, summaries
from .table_signatures import reduction_count

#: Below this max |Δlogp| a difference is float32 rounding of a forward: the same PyTorch code on two kernels
#: differs by about 1e-6 (docs/checker.md, measured floors), a real bug usually by far more.
ROUNDING_LEVEL = 1e-5
_LOW_PRECISION = ("bfloat16", "float16")

#: Causes that shift the transition's mean, by the direction of Δlogp they give (the figures cannot tell them apart).
_SHIFT_CANDIDATES = {
    "lower": (
        "bf16-latents",
        "guidance-mismatch",
        "model-input",
        "step-index",
        "different-weights",
        "forward-precision",
        "noise-level-mismatch",
        "sde-type-mismatch",
        "schedule-shift",
        "prediction-precision",
    ),
    "both": (
        "guidance-mismatch",
        "model-input",
        "text-conditioning",
        "different-weights",
        "misaligned-batch",
        "forward-precision",
        "noise-level-mismatch",
        "sde-type-mismatch",
        "schedule-shift",
        "prediction-precision",
    ),
    "higher": (
        "noise-level-mismatch",
        "sde-type-mismatch",
        "guidance-mismatch",
        "model-input",
        "forward-precision",
        "schedule-shift",
        "prediction-precision",
    ),
}
_SUMMARIES = summaries()


def from_figures(report: Any, config: Mapping[str, Any], signature: Mapping[str, Any] | None = None) -> list[Diagnosis]:
    """Ranked causes from `report`'s figures, its recorded `config` and the tables' `signature` (if read)."""
    m = report.metrics
    if m is None or not m.overall.count or m.overall.max_abs_dlogp == 0:
        return []
    o = m.overall
    if not o.is_finite() and not signature:
        return []
    steps = list(m.by_timestep or m.by_position)
    mean = -o.ppo_kl
    coherence = abs(mean) / o.mean_abs_dlogp if o.mean_abs_dlogp else 0.0
    floor = report.tolerance.floor
    rounding = ROUNDING_LEVEL if floor is None or not floor.max_abs_dlogp else 4 * floor.max_abs_dlogp
    small = o.max_abs_dlogp <= rounding
    size = (
        f"mean Δlogp {mean:.3g}, mean |Δlogp| {o.mean_abs_dlogp:.3g}, max |Δlogp| {o.max_abs_dlogp:.3g} "
        f"({'within' if small else 'far above'} float32 rounding of a forward, ~{rounding:.0e}"
        f"{'' if floor is None else ', from the measured floor'})"
    )
    direction = "lower" if coherence >= 0.6 and mean < 0 else "higher" if coherence >= 0.6 else "both"
    shape = (
        f"Δlogp {'< 0' if mean < 0 else '> 0'} in {coherence:.0%} of the mass (|mean Δlogp| / mean |Δlogp|)"
        if direction != "both"
        else f"two-sided spread: |mean Δlogp| is {coherence:.0%} of mean |Δlogp|"
    )
    clip = (
        f"clipping: higher side {o.pg_clipfrac_higher:.3g}, lower side {o.pg_clipfrac_lower:.3g} "
        f"(clip_ratio {m.clip_ratio_low:g}/{m.clip_ratio_high:g})"
    )
    decisive, weak = _from_signature(signature, size, config, mean) if signature else ([], [])
    if decisive:
        return decisive
    if small:
        return _rounding_level(config, [size, shape], floor is not None)
    recorded = _recorded(config, direction, [shape, clip, size, _profile(steps)])
    if recorded or weak:
        return recorded + weak
    candidates = _SHIFT_CANDIDATES[direction]
    if _float32_recorded(config):
        candidates = tuple(c for c in candidates if c != "bf16-latents")
    evidence = [shape, clip, size, _profile(steps), LOCALISE_HINT]
    return [
        make(cause, _SUMMARIES[cause], evidence, "candidates", share=len(candidates), source="signature")
        for cause in candidates
    ]


# ----------------------------------------------------------------------------------------------------
def _from_signature(
    signature: Mapping[str, Any], size: str, config: Mapping[str, Any], mean: float
) -> tuple[list[Diagnosis], list[Diagnosis]]:
    """``(decisive, weak)``: causes the tables name on their own, and candidates they narrow down to."""
    kind = signature.get("kind")
    details = {"tables": dict(signature)}
    if kind == "ratio":
        return _from_ratio(signature, size, details), []
    if kind == "uniform-offset":
        line = (
            f"every entry differs by the same {signature['offset']:+.3g} (spread {signature['spread']:.2g}): a "
            f"constant added to one side's log-probs"
        )
        summary = "One side's log-probs carry a constant the other's do not."
        return [make("logprob-offset", summary, [line, size], "table-offset", source="tables", details=details)], []
    if kind == "per-step-offset":
        offsets = signature["step_offsets"]
        line = (
            f"Δlogp is one number per timestep ({', '.join(f'{v:+.3g}' for v in offsets[:6])}), the same for every "
            f"sample up to {signature['within_spread']:.2g}"
        )
        summary = "Everything but a per-step term agrees: the log-prob's normaliser (or std term) differs."
        if signature.get("exact"):
            line += ": a normaliser or std term on one side only"
            found = make("logprob-convention", summary, [line, size], "table-step-offset", source="tables")
            return [dataclasses.replace(found, details=details)], []
        line += (
            ", more than float rounding: one side's log-density has another variance term (cps scores "
            "-mean((x' - mean)^2) with none), one side takes the step at another step's sigma, or the scored "
            "sample moved by the same amount in every sample (a rounding of many latent values)"
        )
        options = [
            ("sde-type-mismatch", _SUMMARIES["sde-type-mismatch"]),
            ("logprob-convention", summary),
            ("step-index", _SUMMARIES["step-index"]),
        ]
        if mean < 0 and not _float32_recorded(config):
            options.append(("bf16-latents", _SUMMARIES["bf16-latents"]))
        evidence = [line, size, LOCALISE_HINT]
        weak = [
            make(c, text, evidence, "table-step-offset", share=len(options), source="tables") for c, text in options
        ]
        return [], [dataclasses.replace(d, details=details) for d in weak]
    if kind == "std-scaling":
        slopes = ", ".join(f"{s:.4g}" for s in signature["slopes"][:6])
        steady = signature["steady"]
        line = (
            f"within each timestep Δlogp moves with the rollout's log-prob itself (|correlation| ≥ "
            f"{min(abs(c) for c in signature['correlations']):.3f}; trainer/rollout slopes {slopes}), as scoring the "
            f"same residual under different transition stds gives"
        )
        reading = (
            "the slope is the same at every timestep: a constant ratio of stds, as a different noise level gives"
            if steady
            else "the slope changes with the timestep: another std formula, as a different SDE type gives"
        )
        first, second = (
            ("noise-level-mismatch", "sde-type-mismatch") if steady else ("sde-type-mismatch", "noise-level-mismatch")
        )
        evidence = [line, reading, size]
        weak = [
            make(first, _SUMMARIES[first], evidence, "table-std", source="tables"),
            make(second, _SUMMARIES[second], evidence, "table-std", share=2, source="tables"),
        ]
        return [], [dataclasses.replace(d, details=details) for d in weak]
    return [], []


def _from_ratio(signature: Mapping[str, Any], size: str, details: Mapping[str, Any]) -> list[Diagnosis]:
    """trainer = c · rollout at every entry: a sign (c < 0), a count of latent values (a sum against a mean: c a
    whole number n >= 2 or 1/n), or neither (another scaling of the log-density). Each sentence says only what
    the fitted c shows."""
    ratio, count = signature["ratio"], signature.get("count")
    measured = (
        f"the trainer's log-probs are {ratio:.6g} × the rollout's at every entry (relative residual "
        f"{signature['residual']:.1g})"
    )
    convention = "One side's log-prob has another sign or scale than the other's (its formula differs)."
    reduction = "One side reduces the log-density by a sum over the latent, the other by the mean."
    if ratio < 0 and abs(abs(ratio) - 1) <= 1e-3:
        line = (
            f"trainer = −1 × rollout at every entry (fitted ratio {ratio:.6g}, relative residual "
            f"{signature['residual']:.1g}): the two sides' log-probs have opposite signs"
        )
        return [make("logprob-convention", convention, [line, size], "table-ratio", source="tables", details=details)]
    magnitude = reduction_count(abs(ratio))
    if ratio < 0 and magnitude is not None:  # a flipped sign and a count: two differences, both measured
        line = (
            f"{measured}: opposite signs, and a factor of {magnitude if abs(ratio) > 1 else f'1/{magnitude}'} in "
            f"size, as a sum against a mean over {magnitude} latent values gives"
        )
        return [
            make("logprob-convention", convention, [line, size], "table-ratio", source="tables", details=details),
            make("logprob-reduction", reduction, [line, size], "table-ratio", source="tables", details=details),
        ]
    if count is not None:
        line = f"{measured}: a sum against a mean over {count} latent values"
        return [make("logprob-reduction", reduction, [line, size], "table-ratio", source="tables", details=details)]
    sign = "opposite signs and " if ratio < 0 else ""
    line = (
        f"{measured}: {sign}a constant factor that is no whole number of latent values (not a sum against a mean): "
        f"the two sides scale the log-density differently"
    )
    return [make("logprob-convention", convention, [line, size], "table-ratio", source="tables", details=details)]


def _rounding_level(config: Mapping[str, Any], evidence: list[str], measured_floor: bool) -> list[Diagnosis]:
    """A rounding-sized difference: no bug only where the report records a source; otherwise not noise."""
    backend = config.get("rollout_backend")
    attention_known = "rollout_attention" in config and "trainer_attention" in config
    kernels_differ = attention_known and (
        config.get("rollout_attention") != config.get("trainer_attention") or backend == "vllm-omni"
    )
    batch_differs = "rollout_batch_size" in config and (
        config.get("micro_batch_size") not in (None, config.get("rollout_batch_size"))
        or bool(config.get("step_execution"))
    )
    out = []
    if kernels_differ:
        line = (
            f"the report records different attention: rollout {config.get('rollout_attention')} "
            f"({backend or 'torch'}), trainer {config.get('trainer_attention')}"
        )
        out.append(
            make(
                "attention-kernel",
                "Rounding-level differences of two attention kernels (not a bug).",
                [*evidence, line],
                "recorded-rounding",
            )
        )
    if batch_differs:
        line = (
            f"the report records different batch compositions: rollout batch {config.get('rollout_batch_size')}, "
            f"trainer micro-batch {config.get('micro_batch_size') or config.get('rollout_batch_size')}"
            + (", step-wise rollout" if config.get("step_execution") else "")
        )
        out.append(
            make(
                "batch-composition",
                "Rounding-level differences of a forward that depends on its batch-mates (not a bug).",
                [*evidence, line],
                "recorded-rounding",
                share=2 if kernels_differ else 1,
            )
        )
    if out:
        return out
    if measured_floor:
        recorded = "the measured floor explains this size, but the report records no kernel or batch difference"
    elif attention_known:
        recorded = "the report records the same attention kernel and batch composition on both sides"
    else:
        recorded = "the report records neither side's attention kernel nor its batch composition"
    return [
        make(
            "different-computation",
            "A rounding-sized difference with no recorded source: the two sides compute something differently "
            "(not noise).",
            [*evidence, recorded, LOCALISE_HINT],
            "unknown",
        )
    ]


def _recorded(config: Mapping[str, Any], direction: str, evidence: Sequence[str]) -> list[Diagnosis]:
    """Signature + a setting the report records: a one-sided loss with low-precision sides recorded, or (Qwen-Image
    only) a two-sided spread with padded, unmasked text recorded."""
    low = [side for side in ("rollout", "trainer") if config.get(f"{side}_dtype") in _LOW_PRECISION]
    if direction == "lower" and low and not _plugin(config):
        line = (
            f"the report records transformer dtype rollout {config.get('rollout_dtype')}, trainer "
            f"{config.get('trainer_dtype')}: a round trip through it would move a stored sample off the point the "
            f"rollout scored (the figures do not show that one happened)"
        )
        stepwise = bool(config.get("step_execution"))
        step_line = "the report records step_execution on" if stepwise else "the report records step_execution off"
        first, second = ("stepwise-bf16", "bf16-latents") if stepwise else ("bf16-latents", "stepwise-bf16")
        return [
            make(first, _SUMMARIES[first], [*evidence, line, step_line], "recorded-setting"),
            make(second, _SUMMARIES[second], [*evidence, line, step_line], "recorded-setting", share=3),
        ]
    padded = config.get("pad_prompts_to_max_length") or config.get("step_execution")
    if (
        direction == "both"
        and config.get("model_family") in CAUSES["mask-sum-rope"].families
        and padded
        and config.get("mask_text_padding") is False
    ):
        width = (
            f"the report records pad_prompts_to_max_length (to {config.get('max_sequence_length')} tokens)"
            if config.get("pad_prompts_to_max_length")
            else "the report records a step-wise rollout, which pads every request to a shared text width"
        )
        masked = (
            "the report records mask_text_padding off: padded text keys reach attention, so the RoPE length matters"
        )
        return [make("mask-sum-rope", _SUMMARIES["mask-sum-rope"], [*evidence, width, masked], "recorded-setting")]
    return []


def _plugin(config: Mapping[str, Any]) -> bool:
    return any(":" in str(config.get(f"{side}_backend") or "") for side in ("rollout", "trainer"))


def _float32_recorded(config: Mapping[str, Any]) -> bool:
    """Both built-in sides recorded as float32 (then no round trip rounds a stored sample)."""
    return (
        not _plugin(config)
        and config.get("rollout_dtype") == "float32"
        and config.get("trainer_dtype") == "float32"
        and config.get("rollout_backend") in ("torch", None)
    )


def _profile(steps: Sequence[Any]) -> str:
    """How the signed mean Δlogp moves along the denoising order (high noise first)."""
    values = [(s.timestep if s.timestep is not None else s.position, -s.values.ppo_kl) for s in steps]
    if len(values) < 2:
        return ""
    first, last = abs(values[0][1]), abs(values[-1][1])
    trend = "grows" if last > 1.5 * first else ("shrinks" if first > 1.5 * last else "stays flat")
    return (
        f"per-timestep profile: |mean Δlogp| {trend} along denoising, {first:.3g} at t={values[0][0]:.4g} to "
        f"{last:.3g} at t={values[-1][0]:.4g}"
    )
