# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The cause a localisation points at: the first stage where the two sides part, what differs there, and,
when every forward agrees, the step setting that reproduces each side's log-probs.

Two localisations exist: a replay of the two sides' own code (`rollout_consistency.gate.diagnosis.replay`, what
the check runs; its `Localisation` carries ``facts``), and `rollout_consistency.gate.diagnosis.localise.localise`
over two `SideSpec`s (our step function on both sides: stages ``transition.*``, ``scored_sample``, ``log_prob``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis

from .catalogue import make

_STAGE_CAUSES = {
    "weights": "different-weights",
    "inputs.latents": "model-input",
    "inputs.timestep": "model-input",
    "inputs.conditioning": "text-conditioning",
    "inputs.text_mask": "text-conditioning",
    "inputs.text_lengths": "mask-sum-rope",
    "rope": "mask-sum-rope",
    "inputs.guidance": "guidance-mismatch",
    "inputs.pooled": "text-conditioning",
    "transition.mean": "settings-mismatch",
    "transition.std": "settings-mismatch",
    "scored_sample": "bf16-latents",
    "log_prob": "logprob-convention",
}
_RESULT_SETTINGS = ("guidance_scale", "noise_level", "sde_type", "include_normalizer", "options")
#: A step setting that differs between the two sides' fits → the cause it names (in this order of priority).
_SETTING_CAUSES = (
    ("sde_type", "sde-type-mismatch"),
    ("noise_level", "noise-level-mismatch"),
    ("shift", "schedule-shift"),
    ("rounding", "prediction-precision"),
    ("guidance", "guidance-mismatch"),
    ("cfg_rescale", "guidance-mismatch"),
    ("guidance_rescale", "guidance-mismatch"),
    ("cfg_renorm", "guidance-mismatch"),
    ("cfg_renorm_max", "guidance-mismatch"),
    ("step_offset", "step-index"),
    ("reduction", "logprob-reduction"),
    ("normalizer", "logprob-convention"),
    ("offset", "logprob-offset"),
)
_SUMMARIES = {
    "attention-kernel": "The forwards part inside attention: the two sides run different attention kernels.",
    "batch-composition": "The rows per forward differ, and with them the forward's rounding (or an input it gets).",
    "settings-mismatch": "The sides run with different settings.",
    "different-weights": "The two sides' weights differ.",
    "mask-sum-rope": "The text lengths / RoPE the transformer gets differ (mask.sum() against the padded width).",
    "bf16-latents": "The sample the trainer scores is not the one the rollout drew: the latents were rounded to "
    "low precision after the log-prob was computed.",
    "stepwise-bf16": "The step-wise path stores per-request latents rounded to low precision.",
    "logprob-convention": "Everything up to the log-prob agrees; the log-prob's formula (normaliser, std) differs.",
    "guidance-mismatch": "The two sides guide differently (CFG scale, CFG on one side only, its combination, or the "
    "embedded guidance).",
    "noise-level-mismatch": "The two sides step with different noise levels.",
    "sde-type-mismatch": "The two sides step with different SDE types.",
    "step-index": "One side takes the step at another step's timestep or sigma (an index off by one).",
    "logprob-reduction": "One side reduces the log-density by a sum over the latent, the other by the mean.",
    "logprob-offset": "One side's log-probs carry a constant the other's do not.",
    "text-conditioning": "The text conditioning the transformer gets differs (embeddings, padding or mask).",
    "misaligned-batch": "The trainer pairs latents with another sample's text conditioning: the batch is misaligned.",
    "forward-precision": "Same inputs, different precision: the two sides' forwards run in different dtypes or "
    "autocast.",
    "schedule-shift": "The two sides step on different sigma schedules (another shift or time shift).",
    "prediction-precision": "One side rounds its noise prediction to low precision before CFG or the step.",
}


def from_localisation(loc: Any, config: Mapping[str, Any]) -> Diagnosis:
    """The cause `loc` points at (a replay of both sides' own code, or a `SideSpec` localisation)."""
    if loc.facts:
        return _from_replay(loc, config)
    return _from_sides(loc, config)


# ----------------------------------------------------------------------------------------------------
def _from_replay(loc: Any, config: Mapping[str, Any]) -> Diagnosis:
    facts = loc.facts
    first = loc.first
    settings = {name: (a, b) for name, a, b in loc.settings}
    evidence = [loc.describe(), _faithful(facts)]
    details = loc.to_dict()
    if first is None:
        return _from_step_fit(facts, evidence, details, config)
    stage = first.stage
    extra: list[str] = []
    if stage == "weights":
        cause = "different-weights"
    elif stage == "forwards":
        cause = "guidance-mismatch"
        extra.append(
            "one side runs two forwards (CFG) per sample and step where the other runs one: CFG is on one side only"
        )
    elif stage == "pairing":
        cause = "model-input"
        extra.append("the trainer scores latents the rollout never stepped from (another layout, scale or stored copy)")
    elif stage == "inputs.latents" and "dtype" in settings:
        cause, line = _forward_cause(settings, first)
        extra.append(line.replace("every input agrees; ", "the latents differ by the forward's own cast; "))
    elif stage == "inputs.latents":
        cause, line = _rounded_cause(facts, config, "latents")
        extra.append(line)
    elif stage == "inputs.timestep":
        cause, line = _timestep_cause(facts)
        extra.append(line)
    elif stage in ("inputs.conditioning", "inputs.pooled"):
        misaligned = facts.get("misaligned") or {}
        if misaligned.get("other_sample") and 2 * misaligned["other_sample"] >= misaligned.get("differing", 0):
            cause = "misaligned-batch"
            extra.append(
                f"in {misaligned['other_sample']} of {misaligned['differing']} paired forwards whose text differs, "
                f"the trainer's text conditioning is exactly the rollout's of another sample at the same step"
            )
        else:
            cause = "text-conditioning"
    elif stage == "inputs.text_mask" and "one side only" in first.detail and "rows_per_forward" in settings:
        cause = "batch-composition"  # a micro-batch with no padded row passes no mask
    elif stage.startswith("inputs."):
        cause = _STAGE_CAUSES.get(stage, "model-input")
    else:  # blocks / output with identical inputs: what differs in how the forwards run?
        cause, line = _forward_cause(settings, first)
        extra.append(line)
    summary = _SUMMARIES.get(cause, f"The two sides part at {stage}.")
    if cause == "model-input":
        summary = f"A model input is computed differently: {stage}."
    return make(cause, summary, [*evidence, *extra], "replay-stage", source="localisation", details=details)


def _faithful(facts: Mapping[str, Any]) -> str:
    replay = facts.get("replay") or {}
    worst = max(replay.get("rollout_max_abs", 0.0), replay.get("trainer_max_abs", 0.0))
    seconds = facts.get("seconds")
    timing = f" ({seconds:.2g} s, one batch)" if isinstance(seconds, (int, float)) else ""
    if worst:
        return f"the replay of both sides' own code is off the check's log-probs by {worst:.3g}{timing}"
    return f"the replay of both sides' own code reproduces the check's log-probs bit for bit{timing}"


def _rounded_cause(facts: Mapping[str, Any], config: Mapping[str, Any], what: str) -> tuple[str, str]:
    rounded = facts.get("rounded") or {}
    low = {side: rounded.get(side) for side in ("rollout", "trainer")}
    sides = [side for side, dtype in low.items() if dtype]
    if len(sides) == 1:
        side = sides[0]
        cause = "stepwise-bf16" if config.get("step_execution") else "bf16-latents"
        return cause, (
            f"the {side}'s {what} are exactly the other side's rounded to {low[side]}: the {side} steps from (or "
            f"stores) a {low[side]} copy of the float32 {what}"
        )
    return "model-input", f"the {what} the two sides feed differ beyond any one rounding"


def _timestep_cause(facts: Mapping[str, Any]) -> tuple[str, str]:
    neighbour = facts.get("timestep_neighbour") or {}
    offsets = {int(k): v for k, v in (neighbour.get("offsets") or {}).items()}
    differing = neighbour.get("differing", 0)
    if offsets and sum(offsets.values()) == differing:
        offset = max(offsets.items(), key=lambda item: item[1])[0]
        return "step-index", (
            f"in {sum(offsets.values())} of {differing} paired forwards whose timestep differs, the trainer's "
            f"timestep is exactly the schedule's value of another step (mostly step {offset:+d})"
        )
    rounded = facts.get("rounded") or {}
    sides = [side for side in ("rollout", "trainer") if rounded.get(side)]
    if len(sides) == 1:
        return "model-input", (
            f"the {sides[0]}'s timesteps are exactly the other side's rounded to {rounded[sides[0]]}: the "
            f"{sides[0]} rounds the timestep it feeds the transformer"
        )
    fed = facts.get("fed_sigmas") or {}
    line = _fed_schedules_line(fed)
    if line:
        return "schedule-shift", line
    return "model-input", "the timesteps differ, and not by one step of the schedule"


def _by_step(values: Mapping[str, float]) -> dict[int, float]:
    return {int(k): float(v) for k, v in values.items()}


def _fed_schedules_line(fed: Mapping[str, Any]) -> str | None:
    """Both sides fed their model timesteps of a schedule of its own: the shift of each when recovered, or one odds
    factor between them; None when the timesteps differ in another way."""
    from .sigma_schedules import describe, first_difference, odds_ratio, recover_shift

    if not fed:
        return None
    rollout, trainer, steps = _by_step(fed.get("rollout", {})), _by_step(fed.get("trainer", {})), int(fed["steps"])
    at = first_difference(rollout, trainer)
    if at is None:
        return None
    shifts = [recover_shift(side, steps) for side in (rollout, trainer)]
    if all(shifts) and abs(shifts[0][0] - shifts[1][0]) > 1e-3 * max(shifts[0][0], shifts[1][0]):
        return (
            f"the two sides feed the model timesteps of different schedules: the rollout's sigmas from "
            f"{describe(rollout, steps, at)}, the trainer's from {describe(trainer, steps, at)}"
        )
    ratios = [odds_ratio(rollout[k], trainer[k]) for k in sorted(set(rollout) & set(trainer))]
    ratios = [r for r in ratios if r is not None]
    if len(ratios) >= 2 and max(ratios) - min(ratios) <= 1e-4 * max(ratios) and abs(ratios[0] - 1) > 1e-3:
        return (
            f"the two sides feed the model timesteps of different schedules: at every step the trainer's sigma is "
            f"the rollout's time-shifted by {ratios[0]:.4g} (odds σ/(1−σ) × {ratios[0]:.4g}; first at step {at}: "
            f"rollout {rollout[at]:.6g}, trainer {trainer[at]:.6g})"
        )
    return None


def _forward_cause(settings: Mapping[str, tuple[str, str]], first: Any) -> tuple[str, str]:
    def said(name: str) -> str:
        a, b = settings[name]
        return f"{name.replace('_', ' ')}: rollout {a}, trainer {b}"

    if "autocast" in settings or "dtype" in settings:
        name = "autocast" if "autocast" in settings else "dtype"
        return "forward-precision", f"every input agrees; {said(name)} (measured in the replay)"
    if "attention" in settings:
        return "attention-kernel", f"every input agrees; {said('attention')}"
    if "rows_per_forward" in settings:
        return "batch-composition", f"every input agrees; {said('rows_per_forward')} (measured in the replay)"
    return "different-computation", (
        f"every input agrees and the forwards part at {first.stage}, yet kernels, precision and rows per forward "
        f"are the same on both sides: the two forwards compute differently (not noise)"
    )


def _from_step_fit(facts: Mapping[str, Any], evidence: list[str], details: Any, config: Mapping[str, Any]) -> Diagnosis:
    fit = facts.get("step_fit") or {}
    disagreement = fit.get("disagreement", 0.0)
    rollout, trainer = fit.get("rollout"), fit.get("trainer")

    def unknown(line: str, kind: str = "replay-unexplained") -> Diagnosis:
        summary = "Every forward agrees; the disagreement lies in the step outside the model, in no setting measured."
        return make("different-computation", summary, [*evidence, line], kind, source="localisation", details=details)

    if not disagreement:
        return unknown("the replayed log-probs agree: the disagreement did not reproduce in the replay", "unknown")
    if rollout is None or trainer is None:
        return unknown(
            "every forward agrees, but no replayed (sample, step) has its next sample recorded, so the step outside "
            "the model could not be re-derived"
        )
    tolerance = max(0.25 * disagreement, 1e-7)  # a fit explaining three quarters of the disagreement
    fits = (
        f"the rollout's log-probs are reproduced by {rollout['describe']} (max error {rollout['error']:.2g}); the "
        f"trainer's by {trainer['describe']} (max error {trainer['error']:.2g}); the tables differ by up to "
        f"{disagreement:.3g}"
    )
    errors = {"rollout": rollout["error"], "trainer": trainer["error"]}
    differences = _differences(rollout["settings"], trainer["settings"])
    if differences and max(errors.values()) <= tolerance:
        cause = differences[0]
        lines = ["every forward of both sides agrees: the difference is in the step outside the model", fits]
        lines.append(_stage_line(cause, rollout["settings"], trainer["settings"], fit, facts))
        return make(
            cause, _SUMMARIES[cause], [*evidence, *lines], "replay-step", source="localisation", details=details
        )
    # One side's table is not reproduced from what it fed and produced, while the other's is. The replay shows no
    # more than that: what the side did instead (another sample, another combination) is not measured.
    bad = max(errors, key=errors.get)
    good = "trainer" if bad == "rollout" else "rollout"
    if errors[bad] > max(100 * errors[good], 1e-5):  # far beyond the float32 noise of a faithful reproduction
        line = (
            f"every forward agrees and the {good}'s log-probs are reproduced from the recorded samples, but the "
            f"{bad}'s are not (max error {errors[bad]:.2g} against {errors[good]:.2g}) under any setting tried "
            f"({_TRIED})"
        )
        rounded = fit.get("rollout_next_rounded")
        if bad == "rollout" and (rounded or config.get("rollout_dtype") in _LOW):
            cause = "stepwise-bf16" if config.get("step_execution") else "bf16-latents"
            if rounded:
                line += (
                    f"; the samples the rollout stepped on, fed to its model in float32, are all exactly {rounded} "
                    f"values"
                )
            else:
                line += f"; the report records the rollout's model dtype {config.get('rollout_dtype')}"
            return make(
                cause, _SUMMARIES[cause], [*evidence, line, fits], "replay-step", source="localisation", details=details
            )
        return unknown(f"{line}; {fits}")
    return unknown(f"{fits}; no candidate setting explains the difference")


#: What the step fit tries, as the evidence of an unreproduced table names it.
_TRIED = (
    "CFG scale and combination, a prediction rounded to bfloat16, noise level, SDE type, a shift of the sigma "
    "schedule, the sigma's step index, sum or mean, the normaliser, an offset"
)
_CFG_SETTINGS = ("guidance", "cfg_rescale", "guidance_rescale", "cfg_renorm", "cfg_renorm_max", "rounding")


def _stage_line(
    cause: str, rollout: Mapping[str, Any], trainer: Mapping[str, Any], fit: Mapping[str, Any], facts: Mapping[str, Any]
) -> str:
    """The stage a step-fit cause sits at, in what was measured: the two schedules (their shift where recovered),
    or the CFG stage (the forwards agree; which part of the combination differs)."""
    if cause == "schedule-shift":
        return _fitted_schedules_line(rollout, trainer, fit)
    if cause not in ("guidance-mismatch", "prediction-precision"):
        return ""
    from .step_fit import StepSettings

    differing = [name for name in _CFG_SETTINGS if rollout.get(name) != trainer.get(name)]
    passes = facts.get("passes") or {}
    two_pass = passes.get("rollout") == [2] and passes.get("trainer") == [2]
    own = {
        side: StepSettings(**{k: v for k, v in settings.items() if k in _CFG_SETTINGS}, noise_level=0, sde_type="sde")
        for side, settings in (("rollout", rollout), ("trainer", trainer))
    }
    words = {side: _combination(settings, "rounding" in differing) for side, settings in own.items()}
    if two_pass:
        head = (
            f"CFG stage: the conditional and unconditional predictions agree bit for bit in all "
            f"{facts.get('compared_forwards', 0)} paired forwards; the combined prediction the step receives differs"
        )
    else:
        head = (
            f"the predictions agree bit for bit in all {facts.get('compared_forwards', 0)} paired forwards; the "
            f"prediction the step receives differs"
        )
    return f"{head} ({', '.join(differing)}): the rollout's is {words['rollout']}, the trainer's {words['trainer']}"


def _combination(settings: Any, rounding: bool) -> str:
    parts = []
    if rounding and not settings.rounding:
        parts.append("unrounded")
    if settings.rounding == "outputs":
        parts.append("rounded to bfloat16 before " + ("CFG" if settings.guidance is not None else "the step"))
    if settings.guidance is not None:
        parts.append(f"uncond + {settings.guidance:.4g}·(cond − uncond)")
    if settings.cfg_rescale:
        parts.append("rescaled per token by ‖cond‖/‖combined‖")
    if settings.guidance_rescale:
        parts.append(f"rescaled by guidance_rescale {settings.guidance_rescale:.3g} toward std(cond)/std(combined)")
    if settings.cfg_renorm:
        parts.append(f"renormalised to {settings.cfg_renorm:.3g}·‖cond‖ over the whole sample")
    if settings.cfg_renorm_max:
        parts.append(f"renormalised to at most {settings.cfg_renorm_max:.3g}·‖cond‖ over the whole sample")
    if settings.rounding == "combined":
        parts.append("rounded to bfloat16 before the step")
    return ", ".join(parts) if parts else "the model's output as returned"


def _fitted_schedules_line(rollout: Mapping[str, Any], trainer: Mapping[str, Any], fit: Mapping[str, Any]) -> str:
    """Each side's sigmas as its fit found them (the plan's shifted by its `shift`), named by their shift where
    one is recovered, else by their first differing entries."""
    from .sigma_schedules import describe, first_difference, shift_schedule

    plan = list(fit.get("sigmas") or ())
    if len(plan) < 2:
        return ""
    steps = len(plan) - 1
    sides = {
        side: dict(enumerate(shift_schedule(plan, float(settings.get("shift", 1.0)))[:steps]))
        for side, settings in (("rollout", rollout), ("trainer", trainer))
    }
    at = first_difference(sides["rollout"], sides["trainer"])
    if at is None:
        return ""
    return (
        f"the step's sigmas that reproduce each table: the rollout's from {describe(sides['rollout'], steps, at)}, "
        f"the trainer's from {describe(sides['trainer'], steps, at)}"
    )


_LOW = ("bfloat16", "float16")


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    causes = []
    for name, cause in _SETTING_CAUSES:
        x, y = a.get(name), b.get(name)
        if isinstance(x, float) or isinstance(y, float):
            x, y = (0.0 if x is None else float(x)), (0.0 if y is None else float(y))
            same = abs(x - y) <= (0.5 if name == "offset" else 1e-3) * max(
                abs(x), abs(y), 1e-300 if name == "offset" else 1.0
            )
        else:
            same = x == y
        if not same and cause not in causes:
            causes.append(cause)
    return causes


# ----------------------------------------------------------------------------------------------------
def _from_sides(loc: Any, config: Mapping[str, Any]) -> Diagnosis:
    """A `SideSpec` localisation (`rollout_consistency.gate.diagnosis.localise.localise`): our step function on
    both sides."""
    first = loc.first
    settings = set(loc.setting_names())
    evidence = [loc.describe()]
    if loc.replay_max_abs:
        evidence.append(f"the replay of the rollout is off its stored log-probs by {loc.replay_max_abs:.3g}")
    else:
        evidence.append("the replay of the rollout reproduces its stored log-probs bit for bit")
    details = loc.to_dict()
    if first is None:
        cause = "settings-mismatch" if settings & set(_RESULT_SETTINGS) else "different-computation"
        summary = "One step's computation agrees on both sides; the disagreement lies outside it."
        return make(cause, summary, evidence, "replay-unexplained", source="localisation", details=details)
    stage = first.stage.partition("[")[0]
    if stage in ("embed", "velocity") or stage.startswith("blocks."):
        if "attention" in settings:
            cause = "attention-kernel"
        elif settings & set(_RESULT_SETTINGS):
            cause = "settings-mismatch"
        elif "rows_per_forward" in settings:
            cause = "batch-composition"
        elif "velocity" in settings:
            cause = "model-input"
        else:
            cause = "different-computation"
    elif stage.startswith("inputs.") and "one side only" in first.detail and "rows_per_forward" in settings:
        cause = "batch-composition"
    else:
        cause = _STAGE_CAUSES.get(stage, "different-computation")
        if cause == "text-conditioning":
            cause = "model-input"
        if cause == "bf16-latents" and config.get("step_execution"):
            cause = "stepwise-bf16"
        if stage.startswith("inputs.") and "velocity" not in settings and settings & set(_RESULT_SETTINGS):
            cause = "settings-mismatch"
    summary = _SUMMARIES.get(cause, f"The two sides part at {first.stage}.")
    if cause == "model-input":
        summary = f"A model input is computed differently: {first.stage}."
    return make(cause, summary, evidence, "replay-stage", source="localisation", details=details)
