# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step 2: after one optimizer update and the user's weight sync, the rollout must sample the new policy.

Step 1 (before any update) cannot see a broken weight sync: both sides still hold the initial weights. With
``weight_sync`` set, `rollout_consistency.gate.check` also runs, in this process:

1. the step-1 plan's rollouts (``global_step``) and the trainer's log-probs of them;
2. **one optimizer update on the trainer**: Adam (``weight_sync_lr``) on Flow-GRPO's clipped policy loss
   ``mean(max(-A·ratio, -A·clip(ratio, 1±clip_ratio)))`` over every window step, micro-batch by micro-batch
   (gradients accumulated, one ``step()``), with GRPO advantages from rewards drawn by a generator seeded with
   (``seed``, ``global_step``) and normalised per prompt group. A trainer plug-in runs its own real loss
   instead (its ``train_step``, `rollout_consistency.gate.sides.plugins`);
3. the guard that the update changed the trainer's log-probs (else step 2 tests nothing: a FAIL);
4. **the weight sync** ``sync(trainer, rollout)``: each side is a [`SideHandle`] (``.model``, ``.plugin``).
   Built in: ``"load_state_dict"`` (``rollout.model.load_state_dict(trainer.model.state_dict())``) and
   ``"peft"`` (the trainer's LoRA tensors into the rollout's peft model,
   ``set_peft_model_state_dict(rollout, get_peft_model_state_dict(trainer))``); or a
   ``"package.module:function"`` of your own. It may return a mapping; ``{"bound_modules": 0}`` says a LoRA
   reached no module;
5. the check again on the plan of ``global_step + 1``, with the same profile (its floorless form: no floor is
   measured for step 2), judged by what step 1 judges by (`rollout_consistency.gate.batch_judging`).

Both sides holding one module (or parameters sharing storage) is a ``weight_sync`` FAIL before any update: the
update would reach the rollout with no sync, so a sync that copies nothing would pass (step 2 cannot test it).
A rollout that still samples the old weights, or whose LoRA is bound to no module, FAILs with a
``weight_sync`` reason that says so (the rollout's weight fingerprint unchanged by the sync, the peft layers
it has active, the step-2 figures). Running the sides: `rollout_consistency.gate.sides.weight_sync`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_consistency.safeguards.fence import UserCodeError

from .batch_judging import stacked_tables, unmeasured_tolerance
from .config import CheckConfig, ConfigError
from .judging.metrics import MetricsInputError, compute_metrics
from .judging.tolerances import get_profile
from .judging.verdict import decide
from .sides.backends import run_batch
from .sides.plan import make_plan
from .sides.plugins import fingerprints
from .sides.weight_sync import (
    SideHandle,
    call_sync,
    lora_binding,
    open_sides,
    resolve_sync,
    shared_parameters,
    update_trainer,
)

__all__ = ["Step2Result", "run_weight_sync_check"]


@dataclass(frozen=True)
class Step2Result:
    """What step 2 adds to the report: failures (``weight_sync`` reasons), notes, and ``report.run["step2"]``."""

    problems: tuple[str, ...]
    notes: tuple[str, ...]
    info: Mapping[str, Any] = field(default_factory=dict)


def run_weight_sync_check(config: CheckConfig) -> Step2Result:
    """Step 2 for `config` (``config.weight_sync`` set): see the module docstring."""
    name = config.weight_sync
    if name is None:
        raise ConfigError("run_weight_sync_check needs config.weight_sync.")
    sync = resolve_sync(name, config.user_code_timeout_s)
    notes: list[str] = []
    if config.workers > 1 or config.ray_address is not None:
        notes.append("step 2 (weight sync) ran in this process: one trainer updates, one rollout is synced")
    # One process: the factories of a user's sides see the settings this backend runs with.
    backend, trainer, rollout = open_sides(config.replace(workers=1, ray_address=None).sides)
    shared = shared_parameters(rollout.model, trainer.model)
    if shared:  # the update reaches the rollout without any sync: a no-op sync would pass
        return Step2Result(
            (
                f"step 2 cannot test the weight sync {name!r}: the rollout and the trainer hold one module ({shared} "
                f"parameter tensors in common), so the trainer's update reaches the rollout with no sync at all and "
                f"a sync that copies nothing would pass; give the rollout its own copy of the weights (as a rollout "
                f"engine holds), or run without --weight-sync",
            ),
            tuple(notes),
            {"sync": name, "shared_parameters": shared},
        )

    update = update_trainer(backend, trainer, rollout, make_plan(config.sides))
    before, after = update.before, update.after
    moved = float(np.max(np.abs(after.astype(np.float64) - before))) if before.size else 0.0
    info: dict[str, Any] = {"sync": name, "update_max_abs_dlogp": moved, "learning_rate": config.weight_sync_lr}
    if not (moved > 0 and math.isfinite(moved)):
        return Step2Result(
            (
                f"the optimizer update changed the trainer's log-probs by {moved:.3g}: step 2 cannot test the weight "
                f"sync (no trainable parameter reaches the loss, or weight_sync_lr is too small)",
            ),
            tuple(notes),
            info,
        )

    try:
        sync_out = call_sync(sync, name, trainer, rollout, config.user_code_timeout_s)
    except UserCodeError:
        raise  # it ended the process or hung: a usage error, not a finding about the sync
    except Exception as error:  # the user's sync failing is this check's finding, not a crash
        return Step2Result((f"the weight sync {name!r} raised {type(error).__name__}: {error}",), tuple(notes), info)
    weights_after = fingerprints(rollout.model, trainer.model)
    info.update(weights_before=update.weights_before, weights_after=weights_after)
    diagnosis = _diagnose(update.weights_before, weights_after, rollout, sync_out, info)

    plan2 = make_plan(config.replace(global_step=config.global_step + 1).sides)
    results = [run_batch(backend, batch) for batch in plan2]
    profile = get_profile(config.resolved_profile).unmeasured  # no floor is measured for step 2
    tolerance = unmeasured_tolerance(config.judging, profile)
    try:
        rollout_lp, trainer_lp, timesteps = stacked_tables(results)
        metrics = compute_metrics(rollout_lp, trainer_lp, timesteps=timesteps, **config.judging.metric_settings)
    except MetricsInputError as error:
        metrics, diagnosis = None, [*diagnosis, f"step-2 tables cannot be compared: {error}"]
    verdict = decide(metrics, tolerance)
    if metrics is not None:
        info.update(
            status=verdict.status,
            profile=profile,
            max_abs_dlogp=metrics.overall.max_abs_dlogp,
            ratio_mean=metrics.overall.ratio_mean,
            ppo_kl=metrics.overall.ppo_kl,
        )
    if verdict.passed and not diagnosis:
        notes.append(
            f"step 2 (weight sync {name!r}): PASS after one optimizer update that moved the trainer's log-probs by "
            f"up to {moved:.3g}"
        )
        return Step2Result((), tuple(notes), info)
    message = (
        f"weight sync {name!r} is broken: after one optimizer update (which moved the trainer's log-probs by up to "
        f"{moved:.3g}) and the sync, the rollout does not sample the trainer's new weights"
    )
    if diagnosis:
        message += " — " + "; ".join(diagnosis)
    if not verdict.passed:
        message += f". Step 2 at {profile}: " + "; ".join(verdict.reasons[:2])
    return Step2Result((message,), tuple(notes), info)


def _diagnose(
    before: Mapping[str, Any], after: Mapping[str, Any], rollout: SideHandle, sync_out: Any, info: dict[str, Any]
) -> list[str]:
    found = []
    r0, r1 = before.get("rollout"), after.get("rollout")
    if r0 is not None and r1 is not None and r0["sha256"] == r1["sha256"]:
        found.append(
            f"the sync left the rollout's weights unchanged (sha256 {r1['sha256'][:12]}): it samples the old policy"
        )
    binding = lora_binding(rollout.model)
    if binding is not None:
        info["rollout_lora"] = binding
        if binding["active"] == 0:
            found.append(f"the rollout's LoRA is bound to no module ({binding['layers']} peft layers, none active)")
    if isinstance(sync_out, Mapping):
        info["sync_result"] = {str(k): v for k, v in sync_out.items() if isinstance(v, (int, float, str))}
        if sync_out.get("bound_modules") == 0 and not any("bound to no module" in f for f in found):
            found.append("the sync bound the LoRA to no module of the rollout (0 modules took its tensors)")
    return found
