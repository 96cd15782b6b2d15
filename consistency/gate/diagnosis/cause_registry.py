# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The doctor's causes: one `Cause` record per cause id, in the `CAUSES` registry.

A record holds everything the package says about a cause: its id (stable: tests and dashboards key on it), the
sentence a diagnosis says, the fix, the kinds of evidence that can name it (keys of the catalogue's
``CONFIDENCE``), whether it is no bug, and the families it belongs to. The catalogue's ``FIXES`` and
``NOT_A_BUG``, the sentences `figure_causes` and `localised_causes` say, and docs/doctor.md's table of causes
(`causes_table`, held by tests/test_cause_registry.py) all derive from it: a new cause is one record here (or one
``CAUSES.register(Cause(...))`` call) plus the module that names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_consistency.base.registry import Registry, markdown_table

__all__ = ["CAUSES", "Cause", "causes_table", "fixes", "localised_summaries", "summaries"]


@dataclass(frozen=True)
class Cause:
    """One cause the doctor can name.

    Attributes:
        id: the stable cause id (``"bf16-latents"``), `Diagnosis.cause`.
        summary: one sentence, what the figures or a guard saw (`figure_causes` says it; the docs' table shows it).
        fix: what to do, one sentence naming the function or setting (`Diagnosis.fix`).
        kinds: the kinds of evidence that can name it (keys of `catalogue.CONFIDENCE`), most direct first.
        replay_summary: the sentence a replay of both sides' own code says (`localised_causes`): its own words,
            True for `summary`'s, False for none (the replay then says where the two sides part).
        localised_fix: the fix once the replay has run both sides' own code, when it differs from `fix`.
        not_a_bug: rounding of two kernels or two batch compositions, no bug (the catalogue's ``NOT_A_BUG``).
        families: the model families the cause belongs to (a family's own bug, named only for them); empty: any.
    """

    id: str
    summary: str
    fix: str
    kinds: tuple[str, ...]
    replay_summary: str | bool = False
    localised_fix: str | None = None
    not_a_bug: bool = False
    families: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The registry's key: the id."""
        return self.id

    @property
    def localised_summary(self) -> str | None:
        """What a replay's diagnosis of this cause says, or None (it says where the sides part)."""
        if self.replay_summary is True:
            return self.summary
        return self.replay_summary or None


#: Every cause, in the docs' order. A new cause is one `Cause` here (or one `CAUSES.register` call).
CAUSES: Registry[Cause] = Registry("cause")

for _cause in (
    Cause(
        "bf16-latents",
        summary=(
            "Stored latents rounded to low precision after the log-prob was computed: the trainer scores a "
            "point further from the mean."
        ),
        fix=(
            "keep latents float32: the scheduler must not cast prev_sample to the model dtype; cast to the "
            "transformer's dtype only for its forward, cast noise_pred to float32 before the scheduler, and "
            "store float32 "
            "(rollout_consistency.schedulers.FlowMatchSDEDiscreteScheduler.sample_previous_step refuses "
            "non-fp32 input)"
        ),
        kinds=("candidates", "table-step-offset", "recorded-setting", "replay-stage", "replay-step"),
        replay_summary=(
            "The sample the trainer scores is not the one the rollout drew: the latents were rounded to low "
            "precision after the log-prob was computed."
        ),
    ),
    Cause(
        "stepwise-bf16",
        summary="The step-wise (continuous batching) path keeps per-request latents in low precision.",
        fix=(
            "keep per-request latents float32 throughout the step-wise (continuous batching) path; cast only "
            "for the forward (rollout_consistency.adapters.stepwise)"
        ),
        kinds=("guard", "recorded-setting", "replay-stage", "replay-step"),
        replay_summary="The step-wise path stores per-request latents rounded to low precision.",
    ),
    Cause(
        "mask-sum-rope",
        summary=(
            "The text RoPE length is taken from mask.sum() (valid tokens) while the embeddings are padded "
            "wider: the two sides rotate text tokens differently."
        ),
        fix=(
            "compute the text RoPE lengths from the padded width, txt_seq_lens = [prompt_embeds.shape[1]] * "
            "batch (rollout_consistency.adapters.rope.padded_txt_seq_lens), not from mask.sum()"
        ),
        kinds=("recorded-setting", "replay-stage"),
        replay_summary="The text lengths / RoPE the transformer gets differ (mask.sum() against the padded width).",
        families=("qwen-image",),
    ),
    Cause(
        "per-request-window",
        summary="The SDE window is drawn per request, not per prompt group from the launcher's seed.",
        fix=(
            "draw one SDE window per prompt group from the launcher's seed "
            "(rollout_consistency.schedulers.draw_sde_window(seed=..., global_step=..., prompt_group=...)), "
            "never per request, from LOCAL_RANK or an unseeded RNG"
        ),
        kinds=("guard",),
    ),
    Cause(
        "guidance-mismatch",
        summary="The sides guide differently (CFG scale, CFG on one side only, the embedded guidance).",
        fix=(
            "give both sides the same guidance: CFG on or off on both, the same scale, the same combination "
            "(true CFG's rescale to the conditional prediction's norm) and the same embedded guidance value; "
            "the trainer should read them from what the rollout stored"
        ),
        kinds=("candidates", "replay-stage", "replay-step"),
        replay_summary=(
            "The two sides guide differently (CFG scale, CFG on one side only, its combination, or the "
            "embedded guidance)."
        ),
    ),
    Cause(
        "noise-level-mismatch",
        summary="The two sides step with different noise levels.",
        fix="use one noise_level on both sides: the trainer should read the rollout's stored value",
        kinds=("candidates", "table-std", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "sde-type-mismatch",
        summary="The two sides step with different SDE types.",
        fix="use one sde_type (sde / cps / dance_sde) on both sides: the trainer should read the rollout's",
        kinds=("candidates", "table-std", "table-step-offset", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "step-index",
        summary="One side scores a step with another step's timestep or sigma.",
        fix=(
            "score stored step k with step k's timestep and sigma: look the sigma up by the stored timestep "
            "value (scheduler.index_for_timestep), never by a separate or shifted counter"
        ),
        kinds=("candidates", "table-step-offset", "replay-stage", "replay-step"),
        replay_summary="One side takes the step at another step's timestep or sigma (an index off by one).",
    ),
    Cause(
        "logprob-reduction",
        summary="One side reduces the log-density by a sum over the latent, the other by the mean.",
        fix=(
            "reduce the log-density by the mean over all non-batch dimensions on both sides (Flow-GRPO's "
            "convention), never a sum on one side"
        ),
        kinds=("table-ratio", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "logprob-offset",
        summary="One side's log-probs carry a constant the other's do not.",
        fix=(
            "compute the same log-prob formula on both sides: remove the constant one side adds (an epsilon, "
            "a term written another way)"
        ),
        kinds=("table-offset", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "logprob-convention",
        summary="Everything but a per-step term agrees: the log-prob's normaliser (or std term) differs.",
        fix=(
            "use one log-prob convention on both sides: the mean over all non-batch dims, the same Gaussian "
            "normaliser (include_normalizer) and the same std"
        ),
        kinds=("table-step-offset", "table-ratio", "replay-stage", "replay-step"),
        replay_summary="Everything up to the log-prob agrees; the log-prob's formula (normaliser, std) differs.",
    ),
    Cause(
        "model-input",
        summary="A model input (latents, timestep, mask) is computed differently on the two sides.",
        fix=(
            "feed the transformer the same inputs on both sides: build latents, timestep (t/1000), masks and "
            "guidance with one shared function, in float32"
        ),
        kinds=("guard", "candidates", "replay-stage"),
    ),
    Cause(
        "text-conditioning",
        summary="The text conditioning (embeddings, padding, mask) differs between the sides.",
        fix=(
            "feed the transformer the same text conditioning on both sides: the same embeddings, padding "
            "width and text mask (encoder_hidden_states_mask), from one shared encode step"
        ),
        kinds=("candidates", "replay-stage"),
        replay_summary="The text conditioning the transformer gets differs (embeddings, padding or mask).",
    ),
    Cause(
        "misaligned-batch",
        summary="The trainer pairs latents with another sample's text conditioning.",
        fix=(
            "keep each sample's text conditioning with its latents: apply one permutation to every key of "
            "the batch when shuffling (flow_grpo's `samples = {k: v[perm] ...}`), and re-check after adding "
            "a key"
        ),
        kinds=("candidates", "replay-stage", "replay-step"),
        replay_summary=(
            "The trainer pairs a sample's latents with another sample's rows of one input (text conditioning, text "
            "mask, pooled text): the batch is misaligned."
        ),
    ),
    Cause(
        "different-weights",
        summary="The two sides' weights differ.",
        fix=(
            "load the same checkpoint on both sides and sync the trainer's weights to the rollout engine "
            "(check LoRA targets, EMA, dtype casts of the checkpoint)"
        ),
        kinds=("guard", "candidates", "replay-stage"),
        replay_summary=True,
    ),
    Cause(
        "forward-precision",
        summary="The two sides' forwards run in different precisions (dtype or autocast).",
        fix=(
            "run the transformer in one precision on both sides: the same parameter dtype and the same "
            "autocast (or none); `rollout-consistency precision` compares the two sides' settings"
        ),
        kinds=("candidates", "replay-stage"),
        replay_summary="Same inputs, different precision: the two sides' forwards run in different dtypes or autocast.",
    ),
    Cause(
        "schedule-shift",
        summary="The two sides step on different sigma schedules (another shift or time shift).",
        fix=(
            "build one sigma schedule for both sides: the same shift (or dynamic-shifting mu) and the same base, from "
            "one shared function; the trainer should take each step's sigma from the rollout's stored schedule, not "
            "rebuild it"
        ),
        kinds=("guard", "candidates", "replay-stage", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "prediction-precision",
        summary="One side rounds its noise prediction to low precision before CFG or the step.",
        fix=(
            "keep the noise prediction float32 from the forward to the step on both sides: cast the transformer's "
            "output with noise_pred.float() before CFG, and combine and step in float32"
        ),
        kinds=("candidates", "replay-step"),
        replay_summary=True,
    ),
    Cause(
        "train-mode",
        summary="A module runs in training mode on one side: its dropout is active there and not on the other.",
        fix=(
            "score in eval mode on both sides: call model.eval() (verl-omni: the engine's eval context) before the "
            "forwards that recompute old log-probs, or give the policy no dropout (lora_dropout=0); a dropout active "
            "on one side draws a new mask every forward, so its log-probs never equal the other side's"
        ),
        kinds=("replay-stage",),
        replay_summary=True,
    ),
    Cause(
        "adapter-scale",
        summary="The two sides' adapters differ: LoRA scaling, active adapters or merged state.",
        fix=(
            "give both sides the same adapter state: the same LoraConfig (lora_alpha / r is the scaling), the same "
            "active adapters (set_adapter), merged on both or on neither, and the same scale at call time "
            "(joint_attention_kwargs={'scale': ...}, set_adapters(adapter_weights=...)); sync it with the weights"
        ),
        kinds=("replay-stage",),
        replay_summary=True,
    ),
    Cause(
        "attention-processor",
        summary="The two sides run different attention processors.",
        fix=(
            "set the same attention processor on both sides (transformer.set_attn_processor(...); compare "
            "transformer.attn_processors); where the two are the same maths on different kernels, gate with "
            "--profile kernel"
        ),
        kinds=("replay-stage",),
        replay_summary=True,
    ),
    Cause(
        "settings-mismatch",
        summary="The sides run with different settings.",
        fix=(
            "give both sides the same settings (guidance / CFG scale, noise_level, sde_type, the log-prob "
            "normaliser, family options): the trainer should read them from the stored trajectory"
        ),
        kinds=("replay-stage", "replay-unexplained"),
        replay_summary=True,
    ),
    Cause(
        "attention-kernel",
        summary="Rounding-level differences of two attention kernels (not a bug).",
        fix=(
            "expected between engines: gate with --profile kernel or calibrated; for bit-exact agreement run "
            "the same attention backend on both sides (rollout_attention = trainer_attention)"
        ),
        kinds=("recorded-rounding", "replay-stage"),
        replay_summary="The forwards part inside attention: the two sides run different attention kernels.",
        not_a_bug=True,
    ),
    Cause(
        "batch-composition",
        summary="Rounding-level differences of a forward that depends on its batch-mates (not a bug).",
        fix=(
            "recompute with the rollout's batch composition (micro_batch_size = rollout batch, same rows), "
            "or make the forward batch-invariant; otherwise gate with --profile calibrated"
        ),
        kinds=("recorded-rounding", "replay-stage"),
        replay_summary="The rows per forward differ, and with them the forward's rounding (or an input it gets).",
        not_a_bug=True,
    ),
    Cause(
        "different-computation",
        summary="The sides disagree and nothing recorded or measured says where.",
        fix=(
            "localise it: plug both sides into the check as plug-ins that expose their `model` "
            "(rollout-consistency check --rollout-backend your_rollout.py:make_rollout --trainer-backend "
            "your_trainer.py:make_trainer): the doctor replays both and names the first stage where they "
            "part"
        ),
        kinds=("guard", "unknown", "replay-stage", "replay-unexplained"),
        localised_fix=(
            "the replay ran both sides' own code and no setting it measures explains the difference: compare "
            "the two sides' code where the evidence points (a step outside the model: the sample the trainer "
            "scores, its next_latents / prev_sample, against the one the rollout stored and stepped to, and "
            "the step's arguments)"
        ),
    ),
    Cause(
        "expert-switch",
        summary=(
            "The rollout and the trainer scored some steps with different experts (Wan 2.2's transformer / "
            "transformer_2)."
        ),
        fix=(
            "on the side the evidence names, pick each step's expert with the boundary test, transformer when t >= "
            "boundary_ratio * 1000 (rollout_consistency.adapters.wan.WanExperts.expert_names), never from a step "
            "index; a trainer loads both experts (transformer, transformer_2)"
        ),
        kinds=("guard",),
    ),
    Cause(
        "aliased-tables",
        summary=(
            "The two log-prob tables are one buffer, or the trainer wrote into the rollout's: nothing was compared."
        ),
        fix=(
            "give the gate the trainer's own recomputation: the trainer must score the rollout's stored "
            "samples with its model and return a new table, never the rollout's log-probs or a view of them, "
            "and never write into what the rollout stored (verl / verl-omni: "
            "algorithm.rollout_correction.bypass_mode=True sets old_log_probs := rollout_log_probs; turn it "
            "off for the step-1 gate)"
        ),
        kinds=("guard",),
    ),
    Cause(
        "window-plan",
        summary="A side sampled or scored other steps than the plan's SDE window (another width or schedule).",
        fix=(
            "sample exactly the window each request names (request.windows: its start and size) on the "
            "plan's schedule (request.scheduler_setup); a rollout that samples with the SDE on every step "
            "needs --sde-window-size all"
        ),
        kinds=("guard",),
    ),
    Cause(
        "nonfinite",
        summary="A log-prob is NaN or Inf.",
        fix=("find the first NaN/Inf (rollout_consistency.NanCapture); never average non-finite log-probs away"),
        kinds=("guard",),
    ),
    Cause(
        "incomplete",
        summary="The two sides did not score the same (samples, window steps).",
        fix=(
            "score the same (samples, window steps) on both sides: the trainer must re-score every stored "
            "window step of every sample, with the stored windows"
        ),
        kinds=("guard",),
    ),
    Cause(
        "worker-failure",
        summary="A worker or the rollout engine failed on a batch: those samples were never compared.",
        fix=(
            "see the worker's (or the rollout engine's) error in the reason; re-run with --workers 1 to "
            "reproduce it in-process"
        ),
        kinds=("guard",),
    ),
    Cause(
        "calibration",
        summary="The calibration floor could not be measured.",
        fix="fix the calibration setup (calibration_attention) or use --profile kernel",
        kinds=("guard",),
    ),
    Cause(
        "near-limit",
        summary="PASS, but a figure is near its limit.",
        fix="no action needed yet; watch this figure: a small change in the setup will push it over",
        kinds=("near-limit",),
    ),
):
    CAUSES.register(_cause)


def fixes() -> dict[str, str]:
    """Cause id -> fix, for every registered cause."""
    return {cause.id: cause.fix for cause in CAUSES.values()}


def summaries() -> dict[str, str]:
    """Cause id -> the sentence a diagnosis from the figures says."""
    return {cause.id: cause.summary for cause in CAUSES.values()}


def localised_summaries() -> dict[str, str]:
    """Cause id -> the sentence a replay's diagnosis says, for the causes that have one."""
    return {cause.id: text for cause in CAUSES.values() if (text := cause.localised_summary)}


def causes_table() -> str:
    """The docs' table of the registered causes (docs/doctor.md holds exactly this; a test checks it)."""
    rows = [
        (
            f"`{cause.id}`",
            cause.summary,
            ", ".join(f"`{kind}`" for kind in cause.kinds),
            ", ".join(cause.families) or "all",
            "no bug" if cause.not_a_bug else "",
        )
        for cause in CAUSES.values()
    ]
    return markdown_table(("cause", "what was seen", "evidence that names it", "families", "not a bug"), rows)
