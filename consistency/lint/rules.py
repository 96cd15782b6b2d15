# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The rules, by id, in the `RULES` registry (docs/lint.md documents each: what it finds, why, the fix, examples and
limits). A new rule is one module (its id, `needs` and `check`, or `summarise` and `compare`) plus one `Rule` here;
the engine, `--select`/`--ignore`, suppression comments, SARIF and `--list-rules` read the registry."""

from __future__ import annotations

from rollout_consistency.base.registry import Registry

from . import amp, flags, latents, recompute, rope, seeds
from .model import Rule

__all__ = ["RULES", "SYNTAX_ERROR"]


def _no_hits(file):
    return ()


#: rule id -> Rule, in documentation order.
RULES: Registry[Rule] = Registry("lint rule")

for _rule in (
    Rule(
        id=latents.RULE_ID,
        title="a sample scored in float32, then cast to bf16/fp16 or the model dtype and stored, returned or fed on",
        why="the log-prob was computed from the float32 sample, but the rounded one is stored and fed on, so the "
        "trainer re-scores a latent the rollout never scored (verl-omni's SDE scheduler returned "
        "prev_sample.to(model_output.dtype) beside a float32 log-prob)",
        fix="keep latents float32 end to end; cast only a copy for the transformer forward",
        needs=latents.needs,
        check=_no_hits,
        summarise=latents.summarise,
        compare=latents.compare,
    ),
    Rule(
        id=rope.RULE_ID,
        title="text RoPE lengths (txt_seq_lens) from a mask's sum in rollout-engine code",
        why="the mask counts the valid tokens, the embeddings are padded wider: the rollout engine builds the text "
        "RoPE table for other positions than the trainer (which rotates the padded width)",
        fix="txt_seq_lens = [prompt_embeds.shape[1]] * batch_size (the padded width)",
        needs=rope.needs,
        check=rope.check,
    ),
    Rule(
        id=seeds.RULE_ID,
        title="SDE window drawn from the rank, the process, a request's id, the clock or an unseeded RNG",
        why="windows then change with the GPU count, the rank order or the run, and rollouts of one prompt group "
        "get different windows",
        fix="derive SDE windows from explicit launcher arguments only (seed, global step, prompt group)",
        needs=seeds.needs,
        check=seeds.check,
    ),
    Rule(
        id=recompute.RULE_ID,
        title="forward re-run in backward (home-made checkpointing) without restoring the RNG state",
        why="dropout draws a new mask in the re-run, so the gradients belong to a different forward than the loss",
        fix="save and restore the RNG state around the re-run, or use torch.utils.checkpoint.checkpoint "
        "(use_reentrant=False, preserve_rng_state=True)",
        needs=recompute.needs,
        check=recompute.check,
    ),
    Rule(
        id=amp.SCALER_RULE_ID,
        title="GradScaler with bfloat16 autocast",
        why="bf16 has float32's exponent range: the scaler adds skipped steps and an unscale, nothing else",
        fix="remove the GradScaler (or enabled=False) for bf16; keep it for fp16 only",
        needs=amp.needs_scaler,
        check=amp.check_scaler,
    ),
    Rule(
        id=amp.CLIP_RULE_ID,
        title="gradient clipping before scaler.unscale_",
        why="the clip sees gradients multiplied by the loss scale, so its threshold moves with the scale",
        fix="scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update()",
        needs=amp.needs_clip,
        check=amp.check_clip,
    ),
    Rule(
        id=flags.RULE_ID,
        title="TF32 / determinism / cuDNN benchmark flag set in a rollout engine or trainer worker only",
        why="the flags belong to the process: set in the rollout's process and not the trainer's (or differently), "
        "the two sides multiply (or pick kernels) at different precision",
        fix="set the flag identically on both sides, or once in a launcher both sides run",
        needs=flags.needs,
        check=_no_hits,
        summarise=flags.summarise,
        compare=flags.compare,
    ),
):
    RULES.register(_rule)


#: Reported for files that do not parse; always on (no --select/--ignore), never suppressed.
SYNTAX_ERROR = Rule(
    id="syntax-error",
    title="the file does not parse",
    why="a file the lint cannot parse is not checked",
    fix="fix the syntax (or exclude the file with --exclude)",
    needs=lambda data, path: False,
    check=_no_hits,
)
