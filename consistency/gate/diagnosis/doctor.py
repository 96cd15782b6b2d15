# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The doctor: a ranked list of likely causes, each with its evidence and its fix, for every FAIL (and for a
PASS close to its limits).

Two sources of evidence:

* **signatures** in the report's figures alone (all that the tables-only path has): the guards that
  failed, the sign and side of the clipping, whether every entry moves one way (``|mean Δlogp|`` against
  ``mean |Δlogp|``), a uniform offset against a spread, the per-timestep profile, the size against rounding
  and against the measured floor, and the settings the report records (dtypes, kernels, batch, padding);
* **localisation** (`rollout_consistency.gate.diagnosis.localise`): the first stage where a replay of the stored rollout
  through both sides parts. Where it ran, its cause ranks first.

Cause ids are stable (tests and dashboards key on them): the ``--inject`` names for the known pitfalls
(``bf16-latents``, ``stepwise-bf16``, ``mask-sum-rope``, ``per-request-window``) and ``attention-kernel``,
``batch-composition``, ``settings-mismatch``, ``different-weights``, ``model-input``,
``logprob-convention``, ``different-computation``, ``nonfinite``, ``incomplete``, ``worker-failure``,
``calibration``, ``near-limit``, ``expert-switch``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis, format_diagnosis

#: Below this max |Δlogp| a difference is float32 rounding of a forward (a kernel or a batch composition):
#: the same PyTorch code on two kernels differs by about 1e-6 (docs/checker.md, measured floors), a real bug by far more.
ROUNDING_LEVEL = 1e-5
#: A PASS whose worst figure reaches this fraction of its limit gets a diagnosis too.
NEAR_LIMIT_FRACTION = 0.5

_LOW_PRECISION = ("bfloat16", "float16")

FIXES: dict[str, str] = {
    "bf16-latents": (
        "keep latents float32: the scheduler must not cast prev_sample to the model dtype; cast to the "
        "transformer's dtype only for its forward, cast noise_pred to float32 before the scheduler, and store "
        "float32 (rollout_consistency.schedulers.FlowMatchSDEDiscreteScheduler.sample_previous_step refuses non-fp32 input)"
    ),
    "stepwise-bf16": (
        "keep per-request latents float32 throughout the step-wise (continuous batching) path; cast only for "
        "the forward (rollout_consistency.adapters.stepwise)"
    ),
    "mask-sum-rope": (
        "compute the text RoPE lengths from the padded width, txt_seq_lens = [prompt_embeds.shape[1]] * batch "
        "(rollout_consistency.adapters.rope.padded_txt_seq_lens), not from mask.sum()"
    ),
    "per-request-window": (
        "draw one SDE window per prompt group from the launcher's seed "
        "(rollout_consistency.schedulers.draw_sde_window(seed=..., global_step=..., prompt_group=...)), never "
        "per request, from LOCAL_RANK or an unseeded RNG"
    ),
    "attention-kernel": (
        "expected between engines: gate with --profile kernel or calibrated; for bit-exact agreement run the "
        "same attention backend on both sides (rollout_attention = trainer_attention)"
    ),
    "batch-composition": (
        "recompute with the rollout's batch composition (micro_batch_size = rollout batch, same rows), or make "
        "the forward batch-invariant; otherwise gate with --profile calibrated"
    ),
    "settings-mismatch": (
        "give both sides the same settings (guidance / CFG scale, noise_level, sde_type, the log-prob "
        "normaliser, family options): the trainer should read them from the stored trajectory"
    ),
    "different-weights": (
        "load the same checkpoint on both sides and sync the trainer's weights to the rollout engine "
        "(check LoRA targets, EMA, dtype casts of the checkpoint)"
    ),
    "model-input": (
        "feed the transformer the same inputs on both sides: build latents, timestep (t/1000), text "
        "embeddings, masks and guidance with one shared function, in float32"
    ),
    "logprob-convention": (
        "use one log-prob convention on both sides: the mean over all non-batch dims, the same Gaussian "
        "normaliser (include_normalizer) and the same std"
    ),
    "different-computation": (
        "localise it: run the check on the built-in backends or plug both sides' functions into "
        "rollout_consistency.gate.localise to see the first stage where they part"
    ),
    "nonfinite": "find the first NaN/Inf (rollout_consistency.NanCapture); never average non-finite log-probs away",
    "incomplete": (
        "score the same (samples, window steps) on both sides: the trainer must re-score every stored window "
        "step of every sample, with the stored windows"
    ),
    "worker-failure": "see the worker's error in the reason; re-run with --workers 1 to reproduce it in-process",
    "calibration": "fix the calibration setup (calibration_attention) or use --profile kernel",
    "near-limit": "no action needed yet; watch this figure: a small change in the setup will push it over",
    "expert-switch": (
        "score every step with the expert the rollout used: load both experts (transformer, transformer_2) on the "
        "trainer and pick one per step with the rollout's own test, transformer when t >= boundary_ratio * 1000 "
        "(rollout_consistency.adapters.wan.WanExperts.expert_names), never from a step index"
    ),
}


# ----------------------------------------------------------------------------------------------------
def needs_diagnosis(report: Any) -> bool:
    """A FAIL, or a PASS whose worst gated figure reaches `NEAR_LIMIT_FRACTION` of its limit."""
    return not report.passed or _near_limit(report) is not None


def diagnose(report: Any, localisation: Any = None) -> tuple[Diagnosis, ...]:
    """Ranked likely causes of `report`'s disagreement (empty for a clean PASS).

    Args:
        report: a `rollout_consistency.gate.judging.report.Report` (a `gate()` report too).
        localisation: a `rollout_consistency.gate.diagnosis.localise.Localisation` of the same setup, if one ran.
    """
    if not needs_diagnosis(report):
        return ()
    config = dict(report.config or {})
    found: list[Diagnosis] = []
    found += _from_guards(report, config)
    if localisation is not None:
        found.append(from_localisation(localisation, config))
    found += _from_signatures(report, config)
    near = _near_limit(report)
    if report.passed and near is not None:
        found.append(near)
    return _rank(found)


def attach_diagnosis(report: Any, localisation: Any = None) -> Any:
    """`report` with its ``diagnosis`` filled (a copy; the report is frozen)."""
    return dataclasses.replace(report, diagnosis=tuple(d.to_dict() for d in diagnose(report, localisation)))


def diagnose_check(report: Any, config: Any, plan: Sequence[Any]) -> Any:
    """The check's hook: diagnose a FAIL (or near-limit PASS), localising it when both sides' code is here.

    Localisation replays the batch holding the worst sample (built-in torch rollout only: a vLLM-omni engine
    or a trajectory file has no rollout code to replay in this process).
    """
    if not needs_diagnosis(report):
        return report
    localisation = None
    metrics = report.metrics
    if (
        config.rollout_backend == "torch"
        and config.trajectory is None
        and metrics is not None
        and metrics.overall.count
        and metrics.overall.max_abs_dlogp > 0
    ):
        worst = max(metrics.by_sample, key=lambda s: _finite(s.values.max_abs_dlogp)).index
        batch = next((b for b in plan if worst in b.sample_indices), None)
        if batch is not None:
            from .localise import localise_check

            localisation = localise_check(config, batch)
    return attach_diagnosis(report, localisation)


# ----------------------------------------------------------------------------------------------------
def _rank(found: list[Diagnosis]) -> tuple[Diagnosis, ...]:
    """Highest confidence first; one entry per cause (its best), evidence of the others appended."""
    best: dict[str, Diagnosis] = {}
    for d in sorted(found, key=lambda d: -d.confidence):
        if d.cause not in best:
            best[d.cause] = d
        else:
            kept = best[d.cause]
            extra = tuple(e for e in d.evidence if e not in kept.evidence)
            best[d.cause] = dataclasses.replace(kept, evidence=kept.evidence + extra)
    return tuple(sorted(best.values(), key=lambda d: -d.confidence))


def _make(cause: str, summary: str, evidence: Sequence[str], confidence: float, source: str = "signature"):
    return Diagnosis(cause, summary, tuple(evidence), FIXES[cause], max(0.0, min(1.0, confidence)), source)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.inf


def _failed(report: Any) -> dict[str, Any]:
    return {c.name: c for c in report.verdict.checks if not c.passed}


def _from_guards(report: Any, config: Mapping[str, Any]) -> list[Diagnosis]:
    failed = _failed(report)
    out = []
    if "windows" in failed:
        out.append(
            _make(
                "per-request-window",
                "The SDE window is drawn per request, not per prompt group from the launcher's seed.",
                [f"windows guard: {failed['windows'].message[:300]}"],
                0.97,
                "guard",
            )
        )
    rollout = failed.get("rollout")
    if rollout is not None and "Mixed dtypes" in rollout.message:
        out.append(
            _make(
                "stepwise-bf16",
                "The step-wise engine keeps per-request latents in the model's low precision; a fresh float32 "
                "request cannot join them.",
                [f"rollout failed: {rollout.message[:300]}"],
                0.96,
                "guard",
            )
        )
    if "experts" in failed:  # both sides' records say which network scored each step: no guessing
        out.append(
            _make(
                "expert-switch",
                "The rollout and the trainer scored some steps with different experts (Wan 2.2's transformer / "
                "transformer_2): one side switches at another step, or holds one expert throughout.",
                [f"experts guard: {failed['experts'].message[:400]}"],
                0.995,
                "guard",
            )
        )
    if "finite" in failed:
        out.append(_make("nonfinite", "A log-prob is NaN or Inf.", [failed["finite"].message[:300]], 0.95, "guard"))
    for name in ("complete", "shapes", "nonempty"):
        if name in failed and not (name == "nonempty" and rollout is not None):
            out.append(
                _make(
                    "incomplete",
                    "The two sides did not score the same (samples, window steps).",
                    [f"{name} guard: {failed[name].message[:300]}"],
                    0.9,
                    "guard",
                )
            )
            break
    if "workers" in failed:
        out.append(_make("worker-failure", "A worker died or failed.", [failed["workers"].message[:300]], 0.9, "guard"))
    if "calibration" in failed:
        out.append(
            _make("calibration", "The calibration floor could not be measured.", [failed["calibration"].message], 0.8)
        )
    return out


def _from_signatures(report: Any, config: Mapping[str, Any]) -> list[Diagnosis]:
    m = report.metrics
    if m is None or not m.overall.count or not m.overall.is_finite() or m.overall.max_abs_dlogp == 0:
        return []
    o = m.overall
    steps = list(m.by_timestep or m.by_position)
    mean = -o.ppo_kl  # signed mean Δlogp (trainer − rollout)
    coherence = abs(mean) / o.mean_abs_dlogp if o.mean_abs_dlogp else 0.0  # 1: every entry moves one way
    spread = max(s.values.ratio_std for s in steps) if steps else o.ratio_std
    floor = report.tolerance.floor
    rounding = ROUNDING_LEVEL if floor is None or not floor.max_abs_dlogp else 4 * floor.max_abs_dlogp
    small = o.max_abs_dlogp <= rounding
    clip = (
        f"clipping: higher side {o.pg_clipfrac_higher:.3g}, lower side {o.pg_clipfrac_lower:.3g} "
        f"(clip_ratio {m.clip_ratio_low:g}/{m.clip_ratio_high:g})"
    )
    size = (
        f"mean Δlogp {mean:.3g}, mean |Δlogp| {o.mean_abs_dlogp:.3g}, max |Δlogp| {o.max_abs_dlogp:.3g} "
        f"({'within' if small else 'far above'} float32 rounding of a forward, ~{rounding:.0e}"
        f"{'' if floor is None else ', from the measured floor'})"
    )
    samples_one_way = [s for s in m.by_sample if s.values.count and (-s.values.ppo_kl) * mean > 0]
    share = len(samples_one_way) / max(1, sum(1 for s in m.by_sample if s.values.count))
    out: list[Diagnosis] = []
    low_precision = config.get("rollout_dtype") in _LOW_PRECISION or config.get("trainer_dtype") in _LOW_PRECISION
    stepwise = bool(config.get("step_execution"))

    if coherence > 0.9 and mean < 0 and not small:
        profile = _profile(steps)
        evidence = [
            f"Δlogp < 0 in {coherence:.0%} of the mass (|mean Δlogp| / mean |Δlogp|) and in {share:.0%} of the "
            f"samples: the trainer finds the stored samples less likely than the rollout did",
            clip + (": all on the lower side" if o.pg_clipfrac_higher == 0 and o.pg_clipfrac_lower > 0 else ""),
            size,
        ]
        if profile:
            evidence.append(profile)
        if low_precision:
            evidence.append(
                f"transformer dtype rollout {config.get('rollout_dtype')}, trainer {config.get('trainer_dtype')}: "
                f"a round trip through it moves the stored sample off the point the rollout scored"
            )
        base = 0.55 + (0.2 if low_precision else 0.0) + (0.1 if o.pg_clipfrac_higher == 0 else 0.0)
        summary = (
            "Stored latents rounded to the model's low precision after the log-prob was computed: the trainer "
            "scores a point further from the mean."
        )
        out.append(_make("bf16-latents", summary, evidence, base - (0.15 if stepwise else 0.0)))
        out.append(
            _make(
                "stepwise-bf16",
                "The step-wise (continuous batching) path keeps per-request latents in low precision.",
                evidence + (["step_execution is on"] if stepwise else ["step_execution is off"]),
                base if stepwise else base - 0.3,
            )
        )
    if coherence > 0.9 and not small and spread < 0.05 * abs(mean):
        out.append(
            _make(
                "logprob-convention",
                "A uniform offset: every entry moves by the same amount, as a different normaliser, reduction or "
                "std would move it.",
                [f"per-step spread {spread:.3g} against |mean Δlogp| {abs(mean):.3g}", size],
                0.7,
            )
        )
    if coherence > 0.9 and mean > 0 and not small:
        out.append(
            _make(
                "settings-mismatch",
                "The trainer finds every stored sample more likely than the rollout did: it scores under another "
                "std or mean (noise_level, sde_type, guidance).",
                [f"Δlogp > 0 in {coherence:.0%} of the mass", clip, size],
                0.55,
            )
        )

    two_sided = coherence < 0.6
    padded_text = config.get("model_family") == "qwen-image" and (
        config.get("pad_prompts_to_max_length") or config.get("step_execution") or config.get("num_prompts", 1) > 1
    )
    if two_sided and not small:
        unmasked = config.get("mask_text_padding") is False
        evidence = [
            f"two-sided spread: |mean Δlogp| is {coherence:.0%} of mean |Δlogp|; {clip}",
            size,
            _width_evidence(config),
        ]
        confidence = 0.35
        if padded_text:
            confidence += 0.2
        if unmasked:
            confidence += 0.25
            evidence.append("mask_text_padding is off: padded text keys reach attention, so the RoPE length matters")
        elif config.get("model_family") == "qwen-image":
            evidence.append("mask_text_padding is on: a wrong RoPE length is invisible under the key-padding mask")
            confidence -= 0.2
        if config.get("model_family") != "qwen-image":
            confidence = 0.1
        out.append(
            _make(
                "mask-sum-rope",
                "The text RoPE length is taken from mask.sum() (valid tokens) while the embeddings are padded wider: "
                "the two sides rotate text tokens differently.",
                evidence,
                confidence,
            )
        )
        cfg = config.get("true_cfg_scale", 1) > 1 or config.get("guidance_scale", 1) > 1
        out.append(
            _make(
                "different-computation",
                "The two sides compute different forwards (far above rounding, no one-sided bias): different "
                "weights, inputs or settings.",
                [size] + (["CFG is on: a guidance that differs between sides spreads Δlogp both ways"] if cfg else []),
                0.4,
            )
        )
    if small:
        out.extend(_rounding_level(config, size, coherence))
    return out


def _rounding_level(config: Mapping[str, Any], size: str, coherence: float) -> list[Diagnosis]:
    """Causes of a rounding-level difference, ranked by what the config says differed between the sides.

    A gate report (tables only) records neither side's kernels nor batches: both causes are then named at
    equal, low confidence and the evidence says what was not recorded.
    """
    direction = "one-sided" if coherence > 0.9 else "spread both ways" if coherence < 0.6 else "mostly one way"
    evidence = [size, f"{direction}: |mean Δlogp| is {coherence:.0%} of mean |Δlogp|"]
    attention_known = "rollout_attention" in config or "trainer_attention" in config
    batches_known = "rollout_batch_size" in config
    kernels_differ = attention_known and (
        config.get("rollout_attention") != config.get("trainer_attention")
        or config.get("rollout_backend") not in (None, "torch")
    )
    batch_differs = batches_known and (
        config.get("micro_batch_size") not in (None, config.get("rollout_batch_size"))
        or bool(config.get("stagger_arrivals"))
    )
    attention = (
        f"attention: rollout {config.get('rollout_attention')} ({config.get('rollout_backend') or 'torch'}), "
        f"trainer {config.get('trainer_attention')}"
        if attention_known
        else "the report does not record either side's attention kernel"
    )
    batches = (
        f"rollout batch {config.get('rollout_batch_size')}, trainer micro-batch "
        f"{config.get('micro_batch_size') or config.get('rollout_batch_size')}"
        + (", staggered arrivals" if config.get("stagger_arrivals") else "")
        if batches_known
        else "the report does not record either side's batch composition"
    )
    unknown = 0.3
    return [
        _make(
            "attention-kernel",
            "Rounding-level differences of two attention kernels (not a bug).",
            [*evidence, attention],
            (0.75 if kernels_differ else 0.3) if attention_known else unknown,
        ),
        _make(
            "batch-composition",
            "Rounding-level differences of a forward that depends on its batch-mates (other kernels per shape).",
            [*evidence, batches],
            (0.7 if batch_differs and not kernels_differ else 0.35) if batches_known else unknown,
        ),
    ]


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
        + (" (the SDE std shrinks as t → 0, so a fixed rounding of the sample weighs more)" if trend == "grows" else "")
    )


def _width_evidence(config: Mapping[str, Any]) -> str:
    if config.get("pad_prompts_to_max_length"):
        return (
            f"prompts are padded to max_sequence_length {config.get('max_sequence_length')}, past the longest prompt: "
            f"mask.sum() and the padded width differ"
        )
    if config.get("step_execution"):
        return "the step-wise engine pads every request to a shared text width"
    return "prompts of different lengths share a forward, padded to the longest"


def _near_limit(report: Any) -> Diagnosis | None:
    from rollout_consistency.gate.judging.tolerances import deviation

    m = report.metrics
    if m is None or not report.passed:
        return None
    worst = None
    for metric, limit in report.tolerance.limits.items():
        if not limit:
            continue
        fraction = deviation(metric, m.overall.get(metric)) / limit
        if fraction >= NEAR_LIMIT_FRACTION and (worst is None or fraction > worst[1]):
            worst = (metric, fraction, limit)
    if worst is None:
        return None
    metric, fraction, limit = worst
    return _make(
        "near-limit",
        f"PASS, but {metric} is at {fraction:.0%} of its limit.",
        [f"{metric} = {m.overall.get(metric):.3g}, {report.tolerance.profile} limit {limit:.3g}"],
        0.3,
    )


# ----------------------------------------------------------------------------------------------------
_STAGE_CAUSES = {
    "weights": "different-weights",
    "inputs.latents": "model-input",
    "inputs.timestep": "model-input",
    "inputs.conditioning": "model-input",
    "inputs.text_mask": "model-input",
    "inputs.text_lengths": "mask-sum-rope",
    "rope": "mask-sum-rope",
    "inputs.guidance": "settings-mismatch",
    "inputs.pooled": "model-input",
    "transition.mean": "settings-mismatch",
    "transition.std": "settings-mismatch",
    "scored_sample": "bf16-latents",
    "log_prob": "logprob-convention",
}
_RESULT_SETTINGS = ("guidance_scale", "noise_level", "sde_type", "include_normalizer", "options")


def from_localisation(loc: Any, config: Mapping[str, Any]) -> Diagnosis:
    """The cause the first differing stage (and the settings that differ) point at."""
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
        return Diagnosis(cause, summary, tuple(evidence), FIXES[cause], 0.5, "localisation", details)
    stage = first.stage.partition("[")[0]
    if stage in ("embed", "velocity") or stage.startswith("blocks."):
        # Same inputs, different forward: what differs in how the forward runs?
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
        # The micro-batch changes what the forward gets (e.g. no text mask when none of its rows is padded).
        cause = "batch-composition"
    else:
        cause = _STAGE_CAUSES.get(stage, "different-computation")
        if cause == "bf16-latents" and config.get("step_execution"):
            cause = "stepwise-bf16"
        if stage.startswith("inputs.") and "velocity" not in settings and settings & set(_RESULT_SETTINGS):
            cause = "settings-mismatch"
    summaries = {
        "attention-kernel": "The forwards part inside attention: the two sides run different attention kernels.",
        "batch-composition": "The rows per forward differ, and with them the forward (or an input it gets).",
        "settings-mismatch": "The sides run with different settings.",
        "different-weights": "The two sides' weights differ.",
        "model-input": f"A model input is computed differently: {first.stage}.",
        "mask-sum-rope": "The text lengths / RoPE the transformer gets differ (mask.sum() against the padded width).",
        "bf16-latents": "The sample the trainer scores is not the one the rollout drew: the stored latents were "
        "rounded after the log-prob was computed.",
        "stepwise-bf16": "The step-wise path stores per-request latents rounded to low precision.",
        "logprob-convention": "Everything up to the log-prob agrees; the log-prob formula differs.",
        "different-computation": f"The two sides part at {first.stage}.",
    }
    return Diagnosis(cause, summaries[cause], tuple(evidence), FIXES[cause], 0.99, "localisation", details)


# ----------------------------------------------------------------------------------------------------
# `rollout-consistency doctor REPORT.json` (registered in cli.py)
def add_parser(subparsers: Any) -> Any:
    """The ``doctor`` sub-command's parser (its ``run`` default is set by the caller)."""
    parser = subparsers.add_parser(
        "doctor",
        help="name the likely causes of a step-1 report's FAIL (a report written earlier with --json)",
        description=(
            "Read a step-1 report (rollout-consistency check --json) and print its ranked likely causes, each "
            "with evidence and fix. The figures' signatures are re-read; a localisation stored in the report "
            "(built-in backends) is kept. Exit 0 with a diagnosis, 2 on bad input."
        ),
    )
    parser.add_argument("report", metavar="REPORT.json", help="a step-1 report written by check --json")
    parser.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON (a list of causes)")
    return parser


class DoctorInputError(ValueError):
    """The doctor's input is not a readable step-1 report."""


def run(args: Any) -> int:
    """Print the diagnosis of ``args.report``; 0 when done (DoctorInputError for bad input)."""
    import json
    from pathlib import Path

    from rollout_consistency.atomic_write import OutputPathError, check_output_paths, write_all
    from rollout_consistency.gate.judging.report import Report

    try:
        check_output_paths({"--json": args.json}, {"REPORT.json": args.report})
    except OutputPathError as error:
        raise DoctorInputError(str(error)) from error
    try:
        with open(args.report, encoding="utf-8") as handle:
            data = json.load(handle)
        report = Report.from_dict(data)
    except FileNotFoundError as error:
        raise DoctorInputError(
            f"{args.report}: no such file; write one with `rollout-consistency check --json`"
        ) from error
    except OSError as error:
        raise DoctorInputError(f"cannot read {args.report}: {error.strerror or error}") from error
    except (ValueError, KeyError, TypeError) as error:
        raise DoctorInputError(
            f"{args.report} is not a step-1 report ({error}); write one with `rollout-consistency check --json`"
        ) from error
    stored = [Diagnosis.from_dict(d) for d in report.diagnosis if d.get("source") == "localisation"]
    diagnoses = _rank([*stored, *diagnose(report)]) if needs_diagnosis(report) else ()
    print(f"rollout-consistency doctor: {args.report}: {report.status}")
    if diagnoses:
        print("\n".join(format_diagnosis(diagnoses, limit=len(diagnoses))))
    else:
        print("  nothing to diagnose: a PASS well within its limits")
    if args.json:
        text = json.dumps([d.to_dict() for d in diagnoses], indent=2, allow_nan=False) + "\n"
        try:
            write_all([(args.json, lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))])
        except OSError as error:
            raise DoctorInputError(f"cannot write {args.json}: {error.strerror or error}") from error
    return 0
