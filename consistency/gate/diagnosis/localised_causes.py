# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The cause a localisation points at: the first stage where the two sides part, what differs there, and,
when every forward agrees, the step setting that reproduces each side's log-probs.

Two localisations exist: a replay of the two sides' own code (`rollout_consistency.gate.diagnosis.replay`, what
the check runs; its `Localisation` carries ``facts``), and `rollout_consistency.gate.diagnosis.localise.localise`
over two `SideSpec`s (our step function on both sides: stages ``transition.*``, ``scored_sample``, ``log_prob``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollout_consistency.gate.judging.causes import Diagnosis

from .catalogue import make
from .cause_registry import localised_summaries

if TYPE_CHECKING:  # the step fit loads numpy; this module reads only its settings' fields
    from .step_fit import StepSettings

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
    ("negated", "logprob-convention"),
    ("offset", "logprob-offset"),
)
_SUMMARIES = localised_summaries()


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
        extra.append(
            "the trainer's forwards feed latents no forward of the rollout fed (another layout, scale or a stored "
            "copy): they could not be paired"
        )
    elif stage == "inputs.latents" and "dtype" in settings:
        cause, line = _forward_cause(settings, first)
        extra.append(line.replace("every input agrees; ", "the latents differ by the forward's own cast; "))
    elif stage == "inputs.latents":
        cause, line = _rounded_cause(facts, config, "latents")
        extra.append(line)
    elif stage == "inputs.timestep":
        cause, line = _timestep_cause(facts)
        extra.append(line)
    elif stage in _INPUT_WORDS and _misaligned(facts, stage):
        cause = "misaligned-batch"
        extra += _misaligned_lines(facts["misaligned"], _INPUT_WORDS[stage])
    elif stage in ("inputs.conditioning", "inputs.pooled"):
        cause = "text-conditioning"
    elif stage == "inputs.text_mask" and "one side only" in first.detail and "rows_per_forward" in settings:
        cause = "batch-composition"  # a micro-batch with no padded row passes no mask
    elif stage.startswith("inputs."):
        cause = _STAGE_CAUSES.get(stage, "model-input")
    else:  # blocks / output with identical inputs: what differs in how the forwards run?
        cause, line = _forward_cause(settings, first)
        named, inside = _inside_cause(facts.get("inside"), stage)
        if named is not None:
            cause = named
        else:
            extra.append(line)
        extra += inside
    summary = _SUMMARIES.get(cause, f"The two sides part at {stage}.")
    if cause == "model-input":
        summary = f"A model input is computed differently: {stage}."
    return make(cause, summary, [*evidence, *extra], "replay-stage", source="localisation", details=details)


#: The per-sample inputs a shuffle can leave behind, as the evidence names them.
_INPUT_WORDS = {
    "inputs.conditioning": "text conditioning",
    "inputs.text_mask": "text mask",
    "inputs.pooled": "pooled text",
}


def _misaligned(facts: Mapping[str, Any], stage: str) -> bool:
    """Most paired forwards whose `stage` input differs carry exactly another sample's (measured in the replay)."""
    found = facts.get("misaligned") or {}
    return (
        found.get("stage", stage) == stage
        and bool(found.get("other_sample"))
        and (2 * found["other_sample"] >= found.get("differing", 0))
    )


def _misaligned_lines(found: Mapping[str, Any], what: str) -> list[str]:
    """What the replay matched, and only that: how many forwards carry another sample's `what`, whose, and (where
    the batch holds exact copies) which key's rows went with which latents rows."""
    fed = ", ".join(f"sample {k} got sample {v}'s" for k, v in list(found.get("fed", {}).items())[:4])
    lines = [
        f"in {found['other_sample']} of {found['differing']} paired forwards whose {what} differs, the trainer's "
        f"{what} is exactly the rollout's of another sample at the same step" + (f" ({fed})" if fed else "")
    ]
    return lines + _order_lines(found, f"its `{found.get('key')}` rows")


def _order_lines(found: Mapping[str, Any], what: str) -> list[str]:
    """The per-key pairing (localise._key_pairing), said only where it was matched: the rows of both keys the
    trainer's forwards took, in the order they ran, and, when one key kept the batch's order while the latents'
    did not, that."""
    key, latents_key, order = found.get("key"), found.get("latents_key"), found.get("order")
    if not (key and latents_key and order):
        return []
    pairs = ", ".join(
        f"`{latents_key}` row {a} with `{key}` row {'/'.join(str(r) for r in b)}"
        for a, b in zip(order["latents"], order["other"], strict=True)
        if b
    )
    lines = [f"in the order the trainer's forwards ran (the first step), they paired {pairs}"]
    if found.get("batch_order") and found.get("permuted"):
        lines.append(
            f"{what} follow the batch's order while its `{latents_key}` rows are permuted: `{key}` was left out "
            f"of the permutation the other keys took"
        )
    return lines


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


def _inside_cause(inside: Mapping[str, Any] | None, stage: str) -> tuple[str | None, list[str]]:
    """The cause the look inside the first differing block names (None: no state difference where the sides part),
    and what it measured (`rollout_consistency.gate.diagnosis.inside_block`)."""
    from .module_state import describe

    if not inside:
        return None, []
    if "error" in inside:
        return None, [f"the look inside {stage} raised {inside['error']}: nothing is said of its submodules"]
    if not inside.get("reproduced"):
        return None, [
            f"a second run of both sides did not reproduce the forward looked at ({stage} differs from the replay's): "
            f"nothing is said of its submodules"
        ]
    located = inside.get("first")
    if located is None:
        return None, [
            f"inside {stage}, no submodule's inputs agree while its outputs differ ({inside.get('modules', 0)} modules "
            f"compared): its inputs already differ"
        ]
    if not located["sampled"]:
        size = f"its outputs differ in size, {located['values']} values on the rollout"
    else:
        sampled = "" if located["sampled"] >= located["values"] else f", over {located['sampled']} sampled"
        size = f"max |Δ| {located['max_abs']:.3g} of its {located['values']} output values{sampled}"
    lines = [f"first differing submodule: {located['module']} ({size}), its input tensors agree bit for bit"]
    differences = inside.get("differences") or []
    if not differences:
        lines.append(
            f"no state of {located['module']} or its submodules differs (training, dropout, adapters, "
            f"attention processor, dtype)"
        )
        return None, lines
    top = differences[0]
    states = inside["states"][top["module"]]
    lines.append(describe(top["module"], top["field"], states[0], states[1]))
    same = [d["module"] for d in inside.get("elsewhere") or () if d["field"] == top["field"]][:3]
    if same:
        more = (inside.get("elsewhere_fields") or {}).get(top["field"], len(same)) - len(same)
        tail = f" and {more} more of the modules looked at" if more > 0 else ""
        lines.append(f"{top['field']} differs the same way in {', '.join(same)}{tail}")
    return top["cause"], lines


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
    # Reproduced: within the fit's relative tolerance at every entry (step_fit.REPRODUCED_RTOL), and a good part
    # of the disagreement explained; a fit that only comes closer is not said to reproduce anything.
    reproduced = {
        side: f["error"] <= tolerance and f.get("reproduced", True)
        for side, f in (("rollout", rollout), ("trainer", trainer))
    }
    fits = "; ".join(_fit_line(side, f, reproduced[side]) for side, f in (("rollout", rollout), ("trainer", trainer)))
    fits += f"; the tables differ by up to {disagreement:.3g}"
    differences = _differences(rollout["settings"], trainer["settings"])
    if differences and all(reproduced.values()):
        cause = differences[0]
        lines = ["every forward of both sides agrees: the difference is in the step outside the model", fits]
        lines.append(_stage_line(cause, rollout["settings"], trainer["settings"], fit, facts))
        return make(
            cause, _SUMMARIES[cause], [*evidence, *lines], "replay-step", source="localisation", details=details
        )
    pairing = fit.get("next_pairing") or {}
    if pairing.get("reproduced") and pairing.get("moved"):
        return make(
            "misaligned-batch",
            "The trainer scores each sample's step against another sample's next latents: the batch is misaligned.",
            [*evidence, *_next_pairing_lines(pairing), fits],
            "replay-step",
            source="localisation",
            details=details,
        )
    # One side's table is reproduced from what it fed and what its forwards took next, the other's is not by any
    # candidate: said as measured, without naming what that side computed instead.
    bad = max(
        ("rollout", "trainer"),
        key=lambda side: (not reproduced[side], {"rollout": rollout, "trainer": trainer}[side]["error"]),
    )
    good = "trainer" if bad == "rollout" else "rollout"
    if reproduced[good] and not reproduced[bad]:
        line = (
            f"every forward agrees and the {good}'s log-probs are reproduced from the recorded forwards and the "
            f"samples they took next, but the {bad}'s are reproduced by no candidate setting tried "
            f"({_TRIED})"
        )
        if bad == "trainer" and pairing.get("reproduced") is False:
            line += " (nor by pairing its steps with another sample's next latents)"
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


def _fit_line(side: str, fit: Mapping[str, Any], reproduced: bool) -> str:
    if reproduced:
        return f"the {side}'s log-probs are reproduced by {fit['describe']} (max error {fit['error']:.2g})"
    return (
        f"the {side}'s are not reproduced by any candidate setting (closest: {fit['describe']}, max error "
        f"{fit['error']:.2g})"
    )


def _next_pairing_lines(pairing: Mapping[str, Any]) -> list[str]:
    """The next-latents pairing as measured: which (sample, step) were reproduced with which sample's next latents,
    and the per-key pairing where the batch holds exact copies."""
    steps: dict[tuple[int, int], list[str]] = {}
    for sample, step, other in pairing["scored"]:
        if sample != other:
            steps.setdefault((sample, other), []).append(str(step))
    shown = ", ".join(f"sample {s} with sample {o}'s at step {'/'.join(j)}" for (s, o), j in list(steps.items())[:4])
    more = f", … ({len(steps) - 4} more)" if len(steps) > 4 else ""
    lines = [
        "every forward of both sides agrees, and the rollout's step settings reproduce the trainer's log-probs "
        f"(max relative error {pairing['error']:.2g}) only when its step for a sample scores the next latents the "
        f"rollout stepped to from another sample: {pairing['moved']} of {pairing['units']} (sample, step): "
        f"{shown}{more}"
    ]
    key = pairing.get("key")
    return lines + _order_lines(pairing, f"the next latents it scored (`{key}` rows)")


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


def _combination(settings: StepSettings, rounding: bool) -> str:
    parts = []
    if rounding and not settings.rounding:
        parts.append("unrounded")
    if settings.rounding == "outputs":  # the forwards' outputs: before the combination, where there is one
        parts.append(f"rounded to bfloat16 before {settings.rounded_before}")
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
        parts.append(f"rounded to bfloat16 before {settings.rounded_before}")
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
