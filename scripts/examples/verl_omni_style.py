# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A verl-omni-style diffusion actor, written from scratch in its shape, gated as the checker's trainer plug-in.

Shape of verl's ``DataParallelPPOActor`` kept here: the actor takes a batch (a dict standing in for
``DataProto.batch``) and ``compute_log_prob(data)`` returns ``log_probs`` ``(B, T)`` — one column per SDE step
— which the driver stores as ``old_log_probs``; ``update_policy(data)`` splits the batch into
``ppo_micro_batch_size_per_gpu`` micro-batches, computes the clipped loss per SDE step with gradient
accumulation, takes one optimizer step and returns verl's metric names (``actor/pg_loss``,
``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/grad_norm``). The rollout is the
built-in engine (the vLLM-omni stand-in on the CPU); the weight sync is a full ``load_state_dict`` (what
verl's FSDP→rollout sharding manager does).

Gate it::

    rollout-consistency check --trainer-backend scripts/examples/verl_omni_style.py:make_trainer \
        --weight-sync load_state_dict
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_consistency import CheckConfig
from rollout_consistency.adapters import Trajectory, recompute_step_log_prob
from rollout_consistency.adapters.tiny import load_qwen_image


class DiffusionActor:
    """verl-omni's actor on the tiny Qwen-Image transformer (full fine-tuning, AdamW)."""

    def __init__(self, module: torch.nn.Module, *, ppo_micro_batch_size_per_gpu: int, lr: float = 1e-3) -> None:
        self.actor_module = module
        self.ppo_micro_batch_size_per_gpu = ppo_micro_batch_size_per_gpu
        self.lr = lr

    def _forward_micro_batch(self, micro: Trajectory, step: int) -> torch.Tensor:
        """``(b,)`` float32 log-prob of SDE step `step` for a micro-batch (the scored sample is stored)."""
        return recompute_step_log_prob(self.actor_module, micro, step)

    def compute_log_prob(self, data: dict[str, Any]) -> torch.Tensor:
        """``log_probs`` ``(B, T)`` float32, micro-batch by micro-batch, one column per SDE step."""
        trajectory: Trajectory = data["trajectory"]
        columns = []
        with torch.no_grad():
            for start in range(0, trajectory.batch_size, self.ppo_micro_batch_size_per_gpu):
                micro = trajectory.select(
                    range(start, min(start + self.ppo_micro_batch_size_per_gpu, trajectory.batch_size))
                )
                columns.append(torch.stack([self._forward_micro_batch(micro, k) for k in range(micro.window_size)], 1))
        return torch.cat(columns)

    def update_policy(self, data: dict[str, Any], *, clip_ratio: float) -> dict[str, float]:
        """One optimizer step; returns verl's ``actor/...`` metrics (means over (micro-batch, SDE step) cells)."""
        trajectory: Trajectory = data["trajectory"]
        old_log_probs, advantages = data["old_log_probs"], data["advantages"]
        optimizer = torch.optim.AdamW(self.actor_module.parameters(), lr=self.lr, weight_decay=0.0)
        mb = self.ppo_micro_batch_size_per_gpu
        cells = -(-trajectory.batch_size // mb) * trajectory.window_size
        logs: dict[str, list[float]] = {k: [] for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")}
        for start in range(0, trajectory.batch_size, mb):
            rows = slice(start, min(start + mb, trajectory.batch_size))
            micro = trajectory.select(range(rows.start, rows.stop))
            for k in range(micro.window_size):
                log_prob = self._forward_micro_batch(micro, k)
                negative_approx_kl = log_prob - old_log_probs[rows, k]
                ratio = torch.exp(negative_approx_kl)
                pg_losses = -advantages[rows] * ratio
                pg_losses2 = -advantages[rows] * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
                pg_loss = torch.maximum(pg_losses, pg_losses2).mean()
                (pg_loss / cells).backward()
                logs["pg_loss"].append(pg_loss.item())
                logs["pg_clipfrac"].append(torch.gt(pg_losses2, pg_losses).float().mean().item())
                logs["pg_clipfrac_lower"].append((ratio < 1 - clip_ratio).float().mean().item())
                logs["ppo_kl"].append((-negative_approx_kl).mean().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_module.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = {f"actor/{k}": float(np.mean(v)) for k, v in logs.items()}
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics


class VerlOmniTrainer:
    """The checker's trainer plug-in around the actor: builds the actor's batch dict from the trajectory."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model = load_qwen_image(seed=0)  # its own copy: the rollout engine holds another
        self.actor = DiffusionActor(
            self.model, ppo_micro_batch_size_per_gpu=config.resolved_micro_batch_size, lr=config.weight_sync_lr
        )
        self.metrics: list[dict[str, float]] = []  # what update_policy logged (actor/ppo_kl is 0 at step 1)

    def __call__(self, trajectory: Trajectory, *, micro_batch_size: int) -> torch.Tensor:
        return self.actor.compute_log_prob({"trajectory": trajectory})

    def train_step(self, batches, *, old_log_probs, advantages, micro_batch_size, learning_rate, clip_ratio) -> None:
        # One rollout batch per update here; verl concatenates the step's batches into one DataProto.
        from rollout_consistency.adapters import get_family, stack_trajectories

        data = {
            "trajectory": stack_trajectories(list(batches), get_family(batches[0].model_family)),
            "old_log_probs": torch.as_tensor(np.concatenate(old_log_probs)),
            "advantages": torch.as_tensor(np.concatenate(advantages)),
        }
        self.metrics.append(self.actor.update_policy(data, clip_ratio=clip_ratio))


def make_trainer(config: CheckConfig) -> VerlOmniTrainer:
    return VerlOmniTrainer(config)


class BiasedTrainer(VerlOmniTrainer):
    """A trainer whose log-probs differ from the rollout's in exactly one entry (by one float32 ULP)."""

    def __call__(self, trajectory: Trajectory, *, micro_batch_size: int) -> torch.Tensor:
        out = super().__call__(trajectory, micro_batch_size=micro_batch_size).clone()
        out[0, -1] = torch.nextafter(out[0, -1], torch.tensor(0.0))
        return out


def make_biased_trainer(config: CheckConfig) -> BiasedTrainer:
    return BiasedTrainer(config)
