# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The doctor's catalogue of causes: their ids, their fixes, what a confidence means, and [`make`], which builds a
`Diagnosis` (`rollout_consistency.gate.judging.causes`, the record a report carries) with its measured confidence.

Cause ids are stable (tests and dashboards key on them). The ``--inject`` names for the known pitfalls
(``bf16-latents``, ``stepwise-bf16``, ``mask-sum-rope``, ``per-request-window``); what a replay or the tables
can name in users' code (``guidance-mismatch``, ``noise-level-mismatch``, ``sde-type-mismatch``, ``step-index``,
``logprob-reduction``, ``logprob-offset``, ``logprob-convention``, ``model-input``, ``text-conditioning``,
``misaligned-batch``, ``different-weights``, ``forward-precision``, ``schedule-shift``, ``prediction-precision``,
``settings-mismatch``); the two causes that
are no bug (`NOT_A_BUG`: ``attention-kernel``, ``batch-composition``), named only where the report records, or
the replay measured, that the sides' kernels or batches differ; ``different-computation`` (the sides differ and
the evidence cannot say where); ``expert-switch`` (Wan 2.2: the sides scored a step with different experts);
``aliased-tables`` (the two tables are one buffer: nothing was compared); ``window-plan`` (a side's tables are not
the plan's window: another width or other timesteps); and ``nonfinite``, ``incomplete``, ``worker-failure``,
``calibration``, ``near-limit``.

**What a confidence means.** Each diagnosis rests on one kind of evidence (`CONFIDENCE`'s keys); its
confidence is the share of the measured cases in which a diagnosis resting on that kind of evidence named the
right cause (the doctor's corpus of users' loops and the ``--inject`` pitfalls, `scripts/measure_doctor.py`).
Causes the evidence cannot separate share one kind's confidence equally: a list of ``k`` equally likely
candidates at ``c / k`` each says "one of these, the figures cannot tell which".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis

#: Causes that are no bug: rounding of two kernels or two batch compositions.
NOT_A_BUG = frozenset({"attention-kernel", "batch-composition"})

#: Evidence kind → the share of measured cases in which it named the right cause first (or, for shared
#: candidates, held it), as (right + 1) / (cases + 2): measured by scripts/measure_doctor.py on the doctor's
#: corpus and the --inject pitfalls (docs/doctor.md has the counts); a kind with no measured case stays at 1/2.
CONFIDENCE: Mapping[str, float] = {
    "guard": 0.83,  # a failed guard names its cause (windows, experts, NaN, missing steps, dead workers, weights): 4/4
    "replay-stage": 0.92,  # the first stage where both sides' own forwards part, and what differs there: 11/11
    "replay-step": 0.93,  # every forward agrees; a step setting reproduces each side's table: 13/13
    "replay-unexplained": 0.5,  # forwards agree, no candidate reproduces one side's table: not measured
    "table-ratio": 0.67,  # trainer = c · rollout: 1/1
    "table-offset": 0.67,  # one constant everywhere: 1/1
    "table-step-offset": 0.8,  # one constant per timestep: 3/3
    "table-std": 0.5,  # Δ moves with the log-prob within a timestep: not measured
    "recorded-setting": 0.8,  # a signature and a setting the report records: 3/3
    "recorded-rounding": 0.5,  # rounding-sized, the report records different kernels or batches: not measured
    "candidates": 0.9,  # a shift of the transition mean, shared by the candidates listed: 17/18 lists hold it
    "unknown": 0.33,  # nothing separates the causes: 0/1
    "near-limit": 0.3,  # a PASS near its limit (no cause claimed)
}

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
    "guidance-mismatch": (
        "give both sides the same guidance: CFG on or off on both, the same scale, the same combination (true "
        "CFG's rescale to the conditional prediction's norm) and the same embedded guidance value; the trainer "
        "should read them from what the rollout stored"
    ),
    "noise-level-mismatch": "use one noise_level on both sides: the trainer should read the rollout's stored value",
    "sde-type-mismatch": "use one sde_type (sde / cps / dance_sde) on both sides: the trainer should read the rollout's",
    "schedule-shift": (
        "build one sigma schedule for both sides: the same shift (or dynamic-shifting mu) and the same base, from one "
        "shared function; the trainer should take each step's sigma from the rollout's stored schedule, not rebuild it"
    ),
    "prediction-precision": (
        "keep the noise prediction float32 from the forward to the step on both sides: cast the transformer's output "
        "with noise_pred.float() before CFG, and combine and step in float32"
    ),
    "step-index": (
        "score stored step k with step k's timestep and sigma: look the sigma up by the stored timestep value "
        "(scheduler.index_for_timestep), never by a separate or shifted counter"
    ),
    "logprob-reduction": (
        "reduce the log-density by the mean over all non-batch dimensions on both sides (Flow-GRPO's "
        "convention), never a sum on one side"
    ),
    "logprob-offset": (
        "compute the same log-prob formula on both sides: remove the constant one side adds (an epsilon, a term "
        "written another way)"
    ),
    "logprob-convention": (
        "use one log-prob convention on both sides: the mean over all non-batch dims, the same Gaussian "
        "normaliser (include_normalizer) and the same std"
    ),
    "different-weights": (
        "load the same checkpoint on both sides and sync the trainer's weights to the rollout engine "
        "(check LoRA targets, EMA, dtype casts of the checkpoint)"
    ),
    "model-input": (
        "feed the transformer the same inputs on both sides: build latents, timestep (t/1000), masks and "
        "guidance with one shared function, in float32"
    ),
    "text-conditioning": (
        "feed the transformer the same text conditioning on both sides: the same embeddings, padding width "
        "and text mask (encoder_hidden_states_mask), from one shared encode step"
    ),
    "misaligned-batch": (
        "keep each sample's text conditioning with its latents: apply one permutation to every key of the "
        "batch when shuffling (flow_grpo's `samples = {k: v[perm] ...}`), and re-check after adding a key"
    ),
    "forward-precision": (
        "run the transformer in one precision on both sides: the same parameter dtype and the same autocast "
        "(or none); `rollout-consistency precision` compares the two sides' settings"
    ),
    "different-computation": (
        "localise it: plug both sides into the check as plug-ins that expose their `model` "
        "(rollout-consistency check --rollout-backend your_rollout.py:make_rollout --trainer-backend "
        "your_trainer.py:make_trainer): the doctor replays both and names the first stage where they part"
    ),
    "aliased-tables": (
        "give the gate the trainer's own recomputation: the trainer must score the rollout's stored samples with "
        "its model and return a new table, never the rollout's log-probs or a view of them, and never write into "
        "what the rollout stored (verl / verl-omni: algorithm.rollout_correction.bypass_mode=True sets "
        "old_log_probs := rollout_log_probs; turn it off for the step-1 gate)"
    ),
    "window-plan": (
        "sample exactly the window each request names (request.windows: its start and size) on the plan's "
        "schedule (request.scheduler_setup); a rollout that samples with the SDE on every step needs "
        "--sde-window-size all"
    ),
    "nonfinite": "find the first NaN/Inf (rollout_consistency.NanCapture); never average non-finite log-probs away",
    "incomplete": (
        "score the same (samples, window steps) on both sides: the trainer must re-score every stored window "
        "step of every sample, with the stored windows"
    ),
    "worker-failure": (
        "see the worker's (or the rollout engine's) error in the reason; re-run with --workers 1 to reproduce it "
        "in-process"
    ),
    "calibration": "fix the calibration setup (calibration_attention) or use --profile kernel",
    "near-limit": "no action needed yet; watch this figure: a small change in the setup will push it over",
    "expert-switch": (
        "score every step with the expert the rollout used: load both experts (transformer, transformer_2) on the "
        "trainer and pick one per step with the rollout's own test, transformer when t >= boundary_ratio * 1000 "
        "(rollout_consistency.adapters.wan.WanExperts.expert_names), never from a step index"
    ),
}

#: A cause's fix once the replay has run both sides' own code (telling the user to localise would send them to run
#: what they just ran).
LOCALISED_FIXES: dict[str, str] = {
    "different-computation": (
        "the replay ran both sides' own code and no setting it measures explains the difference: compare the two "
        "sides' code where the evidence points (the step outside the model: how each side combines its predictions "
        "for CFG, the sigmas it steps with, the sample it scores against the one the rollout stored, and the step's "
        "arguments)"
    ),
}

#: The command that separates causes the figures cannot (the end of a tables-only diagnosis's evidence).
LOCALISE_HINT = (
    "the figures cannot separate these; to localise, run the check with both sides as plug-ins exposing "
    "`model` (rollout-consistency check --rollout-backend FILE.py:make_rollout --trainer-backend "
    "FILE.py:make_trainer): the doctor replays both sides' own code and names the stage where they part"
)


def make(
    cause: str,
    summary: str,
    evidence: Sequence[str],
    kind: str,
    *,
    share: int = 1,
    source: str = "signature",
    details: Mapping[str, Any] | None = None,
) -> Diagnosis:
    """A `Diagnosis` whose confidence is evidence `kind`'s, shared by `share` equally likely candidates."""
    evidence = tuple(e for e in evidence if e)
    confidence = CONFIDENCE[kind] / max(1, share)
    fix = LOCALISED_FIXES.get(cause, FIXES[cause]) if source == "localisation" else FIXES[cause]
    return Diagnosis(cause, summary, evidence, fix, confidence, source, details, kind)
