# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step 2: after one optimizer update and the user's weight sync, the rollout must sample the new policy.

Step 1 (before any update) cannot see a broken weight sync: both sides still hold the initial weights. With
``weight_sync`` set, the check also runs, in this process:

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
5. the check again on the plan of ``global_step + 1``, with the same profile.

Both sides holding one module (or parameters sharing storage) is a ``weight_sync`` FAIL before any update: the
update would reach the rollout with no sync, so a sync that copies nothing would pass (step 2 cannot test it).
A rollout that still samples the old weights, or whose LoRA is bound to no module, FAILs with a
``weight_sync`` reason that says so (the rollout's weight fingerprint unchanged by the sync, the peft layers
it has active, the step-2 figures).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_consistency.gate.config import CheckConfig, ConfigError

__all__ = [
    "SideHandle",
    "Step2Result",
    "grpo_advantages",
    "lora_binding",
    "run_weight_sync_check",
    "shared_parameters",
    "torch_train_step",
]


@dataclass(frozen=True)
class Step2Result:
    """What step 2 adds to the report: failures (``weight_sync`` reasons), notes, and ``report.run["step2"]``."""

    problems: tuple[str, ...]
    notes: tuple[str, ...]
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SideHandle:
    """One side as a weight-sync function receives it: its ``nn.Module`` and the user's plug-in (or None)."""

    model: Any
    plugin: Any = None


# ----------------------------------------------------------------------------------------------------
def load_state_dict_sync(trainer: SideHandle, rollout: SideHandle) -> None:
    """Built-in sync: copy every trainer tensor into the rollout module (strict: names must match)."""
    rollout.model.load_state_dict(trainer.model.state_dict())


def peft_sync(trainer: SideHandle, rollout: SideHandle) -> dict[str, int]:
    """Built-in LoRA sync through peft: the trainer's adapter tensors into the rollout's peft model.

    Returns ``{"lora_tensors", "bound_tensors", "bound_modules"}``: tensors sent, tensors a rollout module
    took, rollout LoRA layers active afterwards.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    state = get_peft_model_state_dict(trainer.model)
    result = set_peft_model_state_dict(rollout.model, state)
    unexpected = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
    binding = lora_binding(rollout.model) or {"active": 0}
    bound = len(state) - len(unexpected)
    return {"lora_tensors": len(state), "bound_tensors": bound, "bound_modules": binding["active"] if bound else 0}


BUILTIN_SYNCS: dict[str, Callable[[SideHandle, SideHandle], Any]] = {
    "load_state_dict": load_state_dict_sync,
    "peft": peft_sync,
}


def resolve_sync(name: str, timeout_s: float | None = None) -> Callable[[SideHandle, SideHandle], Any]:
    if name in BUILTIN_SYNCS:
        return BUILTIN_SYNCS[name]
    from rollout_consistency.object_spec import SpecError, load_object

    try:
        sync = load_object(name, owner=f"weight_sync {name!r}", timeout_s=timeout_s)
    except SpecError as error:
        raise ConfigError(f"weight_sync {name!r}: {error}") from error
    if not callable(sync):
        raise ConfigError(f"weight_sync {name!r} names a {type(sync).__name__}, not a function sync(trainer, rollout).")
    return sync


def lora_binding(model: Any) -> dict[str, int] | None:
    """``{"layers", "active"}``: peft LoRA layers in `model` and those with an adapter switched on (None when
    `model` holds no peft layer or peft is not installed)."""
    if model is None:
        return None
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers and not hasattr(model, "peft_config"):
        return None
    active = [
        m
        for m in layers
        if not getattr(m, "disable_adapters", False)
        and any(name in getattr(m, "lora_A", {}) for name in getattr(m, "active_adapters", ()))
    ]
    return {"layers": len(layers), "active": len(active)}


def shared_parameters(rollout_model: Any, trainer_model: Any) -> int:
    """How many of the rollout model's parameter tensors share storage with the trainer's (one module, tied
    weights, a wrapper around the trainer's module); 0 when either side exposes no module."""
    if rollout_model is None or trainer_model is None or not hasattr(rollout_model, "parameters"):
        return 0
    storage = {(p.device, p.untyped_storage().data_ptr()) for p in trainer_model.parameters()}
    return sum((p.device, p.untyped_storage().data_ptr()) in storage for p in rollout_model.parameters())


# ----------------------------------------------------------------------------------------------------
def grpo_advantages(seed: int, global_step: int, prompt_groups: Sequence[int]) -> np.ndarray:
    """GRPO advantages ``(N,)`` float32: rewards drawn from a generator seeded with (seed, global_step),
    normalised within each prompt group (mean 0, std 1; a group of one gets 0)."""
    import torch

    generator = torch.Generator().manual_seed((seed * 1_000_003 + global_step) % (2**63))
    rewards = torch.randn(len(prompt_groups), generator=generator, dtype=torch.float64).numpy()
    groups = np.asarray(prompt_groups)
    advantages = np.zeros_like(rewards)
    for group in np.unique(groups):
        rows = groups == group
        spread = rewards[rows].std()
        advantages[rows] = (rewards[rows] - rewards[rows].mean()) / (spread + 1e-4) if rows.sum() > 1 else 0.0
    return advantages.astype(np.float32)


def torch_train_step(
    model: Any,
    trajectories: Sequence[Any],
    *,
    old_log_probs: Sequence[np.ndarray],
    advantages: Sequence[np.ndarray],
    micro_batch_size: int,
    learning_rate: float,
    clip_ratio: float,
) -> None:
    """One Adam update of `model` on Flow-GRPO's clipped loss over every window step of `trajectories`.

    Per (micro-batch, window step) the loss ``mean(max(-A·r, -A·clip(r, 1-ε, 1+ε)))`` with
    ``r = exp(logp - old)`` is back-propagated at once (scaled by the number of such cells), so memory holds
    one step's graph; one ``optimizer.step()`` at the end.
    """
    import torch

    from rollout_consistency import adapters

    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ConfigError("weight_sync: the trainer's model has no trainable parameter to update.")
    optimizer = torch.optim.Adam(parameters, lr=learning_rate)
    optimizer.zero_grad(set_to_none=True)
    cells = sum(-(-t.batch_size // micro_batch_size) * t.window_size for t in trajectories)
    with torch.enable_grad():
        for trajectory, old, adv in zip(trajectories, old_log_probs, advantages, strict=True):
            for start in range(0, trajectory.batch_size, micro_batch_size):
                rows = range(start, min(start + micro_batch_size, trajectory.batch_size))
                part = trajectory.select(rows)
                a = torch.as_tensor(adv[start : rows.stop])
                for k in range(trajectory.window_size):
                    logp = adapters.recompute_step_log_prob(model, part, k)
                    ratio = torch.exp(logp - torch.as_tensor(old[start : rows.stop, k]))
                    clipped = torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
                    loss = torch.maximum(-a * ratio, -a * clipped).mean() / cells
                    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------
def run_weight_sync_check(config: CheckConfig) -> Step2Result:
    """Step 2 for `config` (``config.weight_sync`` set): see the module docstring."""
    from .backends import build_backend, run_batch
    from .plan import make_plan
    from .plugins import fingerprints

    name = config.weight_sync
    if name is None:
        raise ConfigError("run_weight_sync_check needs config.weight_sync.")
    sync = resolve_sync(name, config.user_code_timeout_s)
    notes: list[str] = []
    if config.workers > 1 or config.ray_address is not None:
        notes.append("step 2 (weight sync) ran in this process: one trainer updates, one rollout is synced")
    backend = build_backend(config.replace(workers=1, ray_address=None))
    sides = backend.plugins
    rollout = SideHandle(backend.rollout_model, sides.rollout if sides is not None else None)
    trainer = SideHandle(backend.trainer_model, sides.trainer if sides is not None else None)
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

    plan = make_plan(config)
    step1 = [_sample(backend, batch) for batch in plan]
    micro = config.resolved_micro_batch_size
    before = _score(backend, step1[0][0])
    weights_before = fingerprints(rollout.model, trainer.model)
    groups = [s.prompt_group for b in plan for s in b.samples]
    adv = grpo_advantages(config.seed, config.global_step, groups)
    offsets = np.cumsum([0] + [len(b.samples) for b in plan])
    advantages = [adv[offsets[i] : offsets[i + 1]] for i in range(len(plan))]
    _train_step(backend, trainer, step1, advantages, micro)
    after = _score(backend, step1[0][0])
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

    from rollout_consistency.fence import UserCodeError, fenced

    try:
        with fenced(f"weight_sync {name!r}", "sync(trainer, rollout)", timeout_s=config.user_code_timeout_s):
            sync_out = sync(trainer, rollout)
    except UserCodeError:
        raise  # it ended the process or hung: a usage error, not a finding about the sync
    except Exception as error:  # the user's sync failing is this check's finding, not a crash
        return Step2Result((f"the weight sync {name!r} raised {type(error).__name__}: {error}",), tuple(notes), info)
    weights_after = fingerprints(rollout.model, trainer.model)
    info.update(weights_before=weights_before, weights_after=weights_after)
    diagnosis = _diagnose(weights_before, weights_after, rollout, sync_out, info)

    from rollout_consistency.gate.judging.metrics import MetricsInputError, compute_metrics
    from rollout_consistency.gate.judging.tolerances import get_profile, resolve_tolerance
    from rollout_consistency.gate.judging.verdict import decide

    plan2 = make_plan(config.replace(global_step=config.global_step + 1))
    results = [run_batch(backend, batch) for batch in plan2]
    profile = get_profile(config.resolved_profile).unmeasured  # no floor is measured for step 2
    tolerance = resolve_tolerance(profile, config.thresholds, compute_dtype=config.compute_dtype)
    try:
        metrics = compute_metrics(
            np.concatenate([r.rollout_log_probs for r in results]),
            np.concatenate([r.trainer_log_probs for r in results]),
            timesteps=np.concatenate([r.timesteps for r in results]),
            clip_ratio=config.clip_ratio,
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            micro_batch_size=micro,
        )
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


def _sample(backend: Any, batch: Any) -> tuple[Any, np.ndarray]:
    """(what the trainer scores, the rollout's (n, W) float32 log-probs) for one batch of the plan."""
    from .plugins import PluginRollout, as_float32_table, plugin_rollout

    if backend.plugins is not None and backend.plugins.rollout is not None:
        out = plugin_rollout(backend, batch)
        if isinstance(out, PluginRollout):
            return out.batch, as_float32_table(out.log_probs, "rollout log_probs")
        return out, out.log_probs.detach().cpu().numpy().copy()
    import torch

    from rollout_consistency import adapters

    from .backends import batch_requests, sampling_settings
    from .shared import encode_prompts

    with torch.no_grad():
        conditioning = encode_prompts(backend, [s.prompt for s in batch.samples])
        trajectory = adapters.rollout(
            backend.family,
            backend.rollout_model,
            conditioning,
            scheduler_setup=backend.scheduler_setup,
            requests=batch_requests(backend, batch),
            sampling=sampling_settings(backend),
            options=backend.options,
        )
    return trajectory, trajectory.log_probs.detach().cpu().numpy().copy()


def _score(backend: Any, batch: Any) -> np.ndarray:
    from .rollout_seal import recompute_checked  # a plug-in trainer's own recompute when there is one

    return recompute_checked(backend, batch, backend.config.trainer_attention)[0]  # step 1 FAILs an aliased table


def _train_step(
    backend: Any,
    trainer: SideHandle,
    step1: Sequence[tuple[Any, np.ndarray]],
    advantages: Sequence[np.ndarray],
    micro: int,
) -> None:
    config = backend.config
    batches = [b for b, _ in step1]
    old = [lp for _, lp in step1]
    settings = dict(
        old_log_probs=old,
        advantages=advantages,
        micro_batch_size=micro,
        learning_rate=config.weight_sync_lr,
        clip_ratio=config.clip_ratio,
    )
    if trainer.plugin is not None:
        train_step = getattr(trainer.plugin, "train_step", None)
        if train_step is None:
            raise ConfigError(
                f"weight_sync needs one optimizer update, but trainer_backend {config.trainer_backend!r} has no "
                f"train_step(batches, *, old_log_probs, advantages, micro_batch_size, learning_rate, clip_ratio)."
            )
        from rollout_consistency.fence import fenced

        with fenced(
            f"trainer_backend {config.trainer_backend!r}", "train_step(...)", timeout_s=config.user_code_timeout_s
        ):
            train_step(batches, **settings)
        return
    torch_train_step(trainer.model, batches, **settings)
