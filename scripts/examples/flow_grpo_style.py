# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A flow_grpo-style trainer, written from scratch in its shape, gated by the checker's plug-in backends.

Shape of flow_grpo's ``train.py`` kept here: the policy is a LoRA (peft, ``init_lora_weights="gaussian"``:
B = 0, so step 1 is the base policy) on the transformer; sampling returns a ``samples`` dict with per-timestep
``latents`` / ``next_latents`` / ``log_probs`` / ``timesteps`` and the prompt embeddings; training shuffles
the samples (``torch.randperm``) and each sample's timesteps (one permutation per sample), and loops over
micro-batches and timestep positions with the clipped loss, accumulating gradients for one optimizer step.
Rollout and trainer hold separate modules (an engine and an FSDP trainer would); the weight sync moves the
LoRA (``weight_sync="peft"``).

Gate it (CPU, tiny model, a few seconds)::

    rollout-consistency check --rollout-backend scripts/examples/flow_grpo_style.py:make_rollout \
        --trainer-backend scripts/examples/flow_grpo_style.py:make_trainer --weight-sync peft

``make_rollout_renamed_lora`` reproduces an engine whose LoRA targets module names the trainer's adapter
does not use: the sync binds it to no module and the step-2 check FAILs naming the weight sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_consistency import CheckConfig
from rollout_consistency.adapters import BatchRequests, SamplingSettings, get_family
from rollout_consistency.adapters import rollout as sample_with_logprob
from rollout_consistency.adapters.tiny import load_qwen_image, load_qwen_image_scheduler_config
from rollout_consistency.gate import PluginRollout, RolloutRequest

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_policy(targets: tuple[str, ...] = LORA_TARGETS, *, seed: int = 0) -> Any:
    """The tiny Qwen-Image transformer with a LoRA policy (the base frozen, only the adapter trains)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # peft draws lora_A from the global generator: seed it explicitly
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=list(targets))
    return get_peft_model(load_qwen_image(seed=0), config)


class FlowGRPORollout:
    """The sampler: returns flow_grpo's ``samples`` dict (as `PluginRollout.batch`) and its log-prob table."""

    def __init__(self, config: CheckConfig, targets: tuple[str, ...] = LORA_TARGETS) -> None:
        self.config = config
        self.model = lora_policy(targets)

    def __call__(self, request: RolloutRequest) -> PluginRollout:
        with torch.no_grad():
            trajectory = sample_with_logprob(
                request.family,
                self.model,
                request.conditioning,
                scheduler_setup=request.scheduler_setup,
                requests=BatchRequests(
                    seeds=request.seeds,
                    windows=request.windows,
                    prompt_groups=request.prompt_groups,
                    global_step=self.config.global_step,
                    denoise_to_end=False,
                ),
                sampling=SamplingSettings(
                    noise_level=self.config.noise_level,
                    sde_type=self.config.sde_type,
                    guidance_scale=request.guidance_scale,
                ),
                options=request.options,
            )
        samples = {
            "prompt_embeds": trajectory.conditioning["prompt_embeds"],
            "prompt_embeds_mask": trajectory.conditioning["prompt_embeds_mask"],
            "latents": trajectory.latents[:, :-1],  # (B, T, seq, C): the sample entering each SDE step
            "next_latents": trajectory.latents[:, 1:],  # (B, T, seq, C): the sample each step drew
            "log_probs": trajectory.log_probs,  # (B, T) float32
            "timesteps": trajectory.timesteps,  # (B, T) float32
        }
        return PluginRollout(
            log_probs=trajectory.log_probs,
            timesteps=trajectory.timesteps,
            seeds=trajectory.seeds,
            window_starts=tuple(w.start for w in trajectory.windows),
            prompt_groups=trajectory.prompt_groups,
            batch=samples,
        )


class FlowGRPOTrainer:
    """The trainer: flow_grpo's ``compute_log_prob`` over shuffled samples and per-sample timestep orders."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model = lora_policy()
        self.family = get_family("qwen-image")
        self.options = {"height": config.height, "width": config.width, "mask_text_padding": config.mask_text_padding}
        setup = self.family.scheduler_setup(
            load_qwen_image_scheduler_config(None), config.num_inference_steps, self.model, self.options
        )
        self.scheduler = setup.scheduler()
        # flow_grpo permutes with the global RNG; here a generator seeded by explicit arguments.
        self.generator = torch.Generator().manual_seed(config.seed + 7919 * config.global_step)

    def compute_log_prob(
        self, samples: dict[str, torch.Tensor], rows: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """Log-prob of step ``steps[i]`` of sample ``rows[i]`` (a micro-batch at one timestep position)."""
        sample = samples["latents"][rows, steps].contiguous()
        timestep = samples["timesteps"][rows, steps]
        conditioning = {
            "prompt_embeds": samples["prompt_embeds"][rows],
            "prompt_embeds_mask": samples["prompt_embeds_mask"][rows],
        }
        velocity = self.family.velocity(self.model, sample, timestep, conditioning, 1.0, options=self.options)
        return self.scheduler.sample_previous_step(
            velocity.float(),
            timestep,
            sample,
            noise_level=self.config.noise_level,
            sde_type=self.config.sde_type,
            prev_sample=samples["next_latents"][rows, steps].contiguous(),
        ).log_prob

    def _cells(self, samples: dict[str, torch.Tensor], micro_batch_size: int):
        """flow_grpo's iteration order: shuffled samples in micro-batches, then timestep positions, each sample
        visiting its timesteps in its own permuted order."""
        n, t = samples["log_probs"].shape
        perm = torch.randperm(n, generator=self.generator)
        perms = torch.stack([torch.randperm(t, generator=self.generator) for _ in range(n)])
        for start in range(0, n, micro_batch_size):
            rows = perm[start : start + micro_batch_size]
            for j in range(t):
                yield rows, perms[rows, j]

    def __call__(self, samples: dict[str, torch.Tensor], *, micro_batch_size: int) -> torch.Tensor:
        out = torch.full(samples["log_probs"].shape, float("nan"), dtype=torch.float32)
        with torch.no_grad():
            for rows, steps in self._cells(samples, micro_batch_size):
                out[rows, steps] = self.compute_log_prob(samples, rows, steps)
        return out  # (B, T) back in sample/timestep order; a cell never computed stays NaN (fails closed)

    def train_step(
        self,
        batches: list[dict[str, torch.Tensor]],
        *,
        old_log_probs: list[np.ndarray],
        advantages: list[np.ndarray],
        micro_batch_size: int,
        learning_rate: float,
        clip_ratio: float,
    ) -> None:
        """One optimizer step of flow_grpo's clipped loss (gradient accumulation over every cell)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=1e-4)
        cells = sum(-(-len(b["log_probs"]) // micro_batch_size) * b["log_probs"].shape[1] for b in batches)
        for samples, old, adv in zip(batches, old_log_probs, advantages, strict=True):
            old, adv = torch.as_tensor(old), torch.as_tensor(adv)
            for rows, steps in self._cells(samples, micro_batch_size):
                ratio = torch.exp(self.compute_log_prob(samples, rows, steps) - old[rows, steps])
                unclipped = -adv[rows] * ratio
                clipped = -adv[rows] * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
                (torch.maximum(unclipped, clipped).mean() / cells).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def make_rollout(config: CheckConfig) -> FlowGRPORollout:
    return FlowGRPORollout(config)


def make_rollout_renamed_lora(config: CheckConfig) -> FlowGRPORollout:
    """An engine whose LoRA sits on other modules than the trainer's adapter names: a sync binds it to nothing."""
    return FlowGRPORollout(config, targets=("add_q_proj", "add_k_proj"))


def make_trainer(config: CheckConfig) -> FlowGRPOTrainer:
    return FlowGRPOTrainer(config)
