# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step 2's sides (the check itself: `rollout_consistency.gate.weight_sync_check`): the two sides as a weight sync
receives them (`SideHandle`), the built-in syncs and the user's, one optimizer update on the trainer, the sync
called inside the fence, and what the check reads off the models (shared storage, peft LoRA layers).

The update is Adam (``weight_sync_lr``) on Flow-GRPO's clipped policy loss
``mean(max(-A·ratio, -A·clip(ratio, 1±clip_ratio)))`` over every window step, micro-batch by micro-batch
(gradients accumulated, one ``step()``), with GRPO advantages from rewards drawn by a generator seeded with
(``seed``, ``global_step``) and normalised per prompt group; a trainer plug-in runs its own real loss instead (its
``train_step``, `rollout_consistency.gate.sides.plugins`). The built-in syncs: ``"load_state_dict"``
(``rollout.model.load_state_dict(trainer.model.state_dict())``) and ``"peft"`` (the trainer's LoRA tensors into
the rollout's peft model, ``set_peft_model_state_dict(rollout, get_peft_model_state_dict(trainer))``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_consistency.gate.config import ConfigError
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.object_spec import SpecError, load_object

from .backends import build_backend
from .plugins import fingerprints
from .settings import SidesSettings

__all__ = [
    "SideHandle",
    "TrainerUpdate",
    "call_sync",
    "grpo_advantages",
    "lora_binding",
    "open_sides",
    "resolve_sync",
    "shared_parameters",
    "torch_train_step",
    "update_trainer",
]


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
def open_sides(settings: SidesSettings) -> tuple[Any, SideHandle, SideHandle]:
    """Step 2's backend, built in this process (one trainer updates, one rollout is synced), and its trainer and
    rollout sides."""
    backend = build_backend(settings)
    sides = backend.plugins
    rollout = SideHandle(backend.rollout_model, sides.rollout if sides is not None else None)
    trainer = SideHandle(backend.trainer_model, sides.trainer if sides is not None else None)
    return backend, trainer, rollout


@dataclass(frozen=True)
class TrainerUpdate:
    """One optimizer update on the trainer: its ``(n, W)`` float32 log-probs of the plan's first batch before and
    after the update, and both sides' weight fingerprints before it (`rollout_consistency.gate.sides.plugins`)."""

    before: np.ndarray
    after: np.ndarray
    weights_before: Mapping[str, Any]


def update_trainer(backend: Any, trainer: SideHandle, rollout: SideHandle, plan: Sequence[Any]) -> TrainerUpdate:
    """The plan's rollouts, the trainer's log-probs of them, and one optimizer update of the trainer on them (GRPO
    advantages seeded by the backend's ``seed`` and ``global_step``)."""
    sampling = backend.settings.sampling
    step1 = [_sample(backend, batch) for batch in plan]
    micro = backend.settings.execution.micro_batch_size
    before = _score(backend, step1[0][0])
    weights_before = fingerprints(rollout.model, trainer.model)
    groups = [s.prompt_group for b in plan for s in b.samples]
    adv = grpo_advantages(sampling.seed, sampling.global_step, groups)
    offsets = np.cumsum([0] + [len(b.samples) for b in plan])
    advantages = [adv[offsets[i] : offsets[i + 1]] for i in range(len(plan))]
    _train_step(backend, trainer, step1, advantages, micro)
    return TrainerUpdate(before, _score(backend, step1[0][0]), weights_before)


def call_sync(
    sync: Callable[[SideHandle, SideHandle], Any], name: str, trainer: SideHandle, rollout: SideHandle, timeout_s: float
) -> Any:
    """``sync(trainer, rollout)`` inside the fence (`UserCodeError` when it ends the process or hangs); what it
    returns, or what it raises."""
    with fenced(f"weight_sync {name!r}", "sync(trainer, rollout)", timeout_s=timeout_s):
        return sync(trainer, rollout)


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

    # step 1 FAILs an aliased table
    return recompute_checked(backend, batch, backend.settings.model.trainer_attention)[0]


def _train_step(
    backend: Any,
    trainer: SideHandle,
    step1: Sequence[tuple[Any, np.ndarray]],
    advantages: Sequence[np.ndarray],
    micro: int,
) -> None:
    execution = backend.settings.execution
    batches = [b for b, _ in step1]
    old = [lp for _, lp in step1]
    settings = dict(
        old_log_probs=old,
        advantages=advantages,
        micro_batch_size=micro,
        learning_rate=execution.weight_sync_lr,
        clip_ratio=execution.clip_ratio,
    )
    if trainer.plugin is not None:
        train_step = getattr(trainer.plugin, "train_step", None)
        if train_step is None:
            raise ConfigError(
                f"weight_sync needs one optimizer update, but trainer_backend {execution.trainer_backend!r} has no "
                f"train_step(batches, *, old_log_probs, advantages, micro_batch_size, learning_rate, clip_ratio)."
            )
        with fenced(
            f"trainer_backend {execution.trainer_backend!r}", "train_step(...)", timeout_s=execution.user_code_timeout_s
        ):
            train_step(batches, **settings)
        return
    torch_train_step(trainer.model, batches, **settings)
