# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A DanceGRPO-style Wan 2.2 trainer, written from scratch in its shape, gated by the checker's plug-in backends.

Shape of DanceGRPO's Wan training script kept here: ``sample_reference_model`` samples one video at a time
(``batch_size = 1``) and ``run_sample_step`` denoises it, stepping with the ``dance_sde`` SDE (``eta`` =
``noise_level``) and collecting ``all_latents`` / ``all_log_probs``; CFG (``cfg_infer``) is one forward of 2B
on ``cat([z, z])`` with ``cat([encoder_hidden_states, negative_prompt_embeds])``, chunked into the conditional
and unconditional predictions and combined in float32, under ``torch.autocast(bfloat16)``. The trainer builds
the ``samples`` dict (``timesteps``, ``latents``, ``next_latents``, ``log_probs``, ``encoder_hidden_states``,
``negative_prompt_embeds``), gives every sample its own timestep permutation (``perms``), and ``grpo_one_step``
recomputes one (sample, timestep) at a time, as ``train_one_step``'s loop does. The checker supplies the plan:
the seeds (one seeded generator per video, where DanceGRPO draws from the global RNG), the SDE windows, the
prompt embeddings and the schedule.

The model is Wan 2.2's two experts (``transformer`` for high noise, ``transformer_2`` below
``boundary_ratio · 1000``), each side choosing per timestep as vLLM-omni's Wan 2.2 rollout pipeline does. Two
trainers:

* ``make_trainer``: switches at the rollout's test: PASS, bit for bit.
* ``make_trainer_one_expert``: one module throughout (``transformer``), as a training adapter that takes a
  single transformer module does: the steps the rollout took with ``transformer_2`` are scored by the other
  network, and the ``experts`` guard FAILs naming them.

Gate it (CPU, tiny model, a few seconds)::

    rollout-consistency check --model-family wan --boundary-ratio 0.875 --sde-type dance_sde \
        --rollout-backend scripts/examples/dance_grpo_style.py:make_rollout \
        --trainer-backend scripts/examples/dance_grpo_style.py:make_trainer
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_consistency import CheckConfig
from rollout_consistency.adapters.tiny import load_wan
from rollout_consistency.adapters.wan import WAN_SCHEDULER_CONFIG
from rollout_consistency.gate import PluginRollout, RolloutRequest
from rollout_consistency.schedulers import SchedulerSetup

BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B's, when the config names none


def wan22_model(config: CheckConfig) -> torch.nn.Module:
    """The tiny Wan 2.2 A14B stand-in: two seeded experts (each side loads its own copy)."""
    return load_wan(seed=0, boundary_ratio=config.boundary_ratio or BOUNDARY_RATIO)


def current_model(model: Any, t: torch.Tensor) -> tuple[str, torch.nn.Module]:
    """High noise (t >= boundary_timestep): ``transformer``; low noise: ``transformer_2``."""
    boundary_timestep = model.boundary_ratio * 1000
    if t < boundary_timestep:
        return "transformer_2", model.transformer_2
    return "transformer", model.transformer


def predict(transformer, z, timesteps, encoder_hidden_states, negative_prompt_embeds, cfg_infer: float):
    """Wan's velocity for a batch ``z`` (float32 out): CFG as one forward of 2B, combined in float32."""
    with torch.autocast("cpu", torch.bfloat16):
        if cfg_infer > 1:
            pred = transformer(
                hidden_states=torch.cat([z, z], dim=0),
                timestep=torch.cat([timesteps, timesteps], dim=0),
                encoder_hidden_states=torch.cat([encoder_hidden_states, negative_prompt_embeds], dim=0),
                return_dict=False,
            )[0]
            model_pred, uncond_pred = pred.chunk(2)
            return uncond_pred.float() + cfg_infer * (model_pred.float() - uncond_pred.float())
        pred = transformer(
            hidden_states=z, timestep=timesteps, encoder_hidden_states=encoder_hidden_states, return_dict=False
        )[0]
        return pred.float()


class DanceGRPORollout:
    """The sampler: DanceGRPO's ``samples`` dict (``PluginRollout.batch``), its log-prob table and the experts used."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model = wan22_model(config)
        self.eta = config.noise_level
        self.cfg_infer = config.guidance_scale

    def run_sample_step(self, z, generator, window, timesteps, scheduler, encoder_hidden_states, negative):
        """One video: every step of the schedule, ``dance_sde`` with ``eta`` inside its window, ODE outside."""
        all_latents, all_log_probs, all_timesteps, experts = [], [], [], []
        for i, t in enumerate(timesteps):
            name, transformer = current_model(self.model, t)
            pred = predict(transformer, z, t.expand(1), encoder_hidden_states, negative, self.cfg_infer)
            in_window = i in window
            if i == window.start:
                all_latents.append(z)
            out = scheduler.sample_previous_step(
                pred,
                t,
                z,
                noise_level=self.eta if in_window else 0.0,
                sde_type="dance_sde",
                generator=[generator] if in_window else None,
            )
            z = out.prev_sample
            if in_window:
                all_latents.append(z)
                all_log_probs.append(out.log_prob)
                all_timesteps.append(t)
                experts.append(name)
        return all_latents, all_log_probs, all_timesteps, experts

    def sample_reference_model(self, request: RolloutRequest) -> dict[str, Any]:
        scheduler = request.scheduler_setup.scheduler()
        timesteps = request.scheduler_setup.timesteps()
        shape = request.family.latent_shape(self.model, request.options)
        encoder_hidden_states = request.conditioning["prompt_embeds"]
        negative_prompt_embeds = request.conditioning.get("negative_prompt_embeds", encoder_hidden_states)
        rows = []
        with torch.no_grad():
            for index, (seed, window) in enumerate(zip(request.seeds, request.windows, strict=True)):
                generator = torch.Generator().manual_seed(seed)
                input_latents = torch.randn((1, *shape), generator=generator)  # the initial noise, float32
                rows.append(
                    self.run_sample_step(
                        input_latents,
                        generator,
                        window,
                        timesteps,
                        scheduler,
                        encoder_hidden_states[index : index + 1],
                        negative_prompt_embeds[index : index + 1],
                    )
                )
        all_latents = torch.cat([torch.stack(r[0], dim=1) for r in rows])  # (B, T+1, C, F, h, w)
        return {
            "timesteps": torch.stack([torch.stack(r[2]) for r in rows]),  # (B, T)
            "latents": all_latents[:, :-1],  # each entry is the latent before timestep t
            "next_latents": all_latents[:, 1:],  # each entry is the latent after timestep t
            "log_probs": torch.cat([torch.stack(r[1], dim=1) for r in rows]),  # (B, T)
            "encoder_hidden_states": encoder_hidden_states,
            "negative_prompt_embeds": negative_prompt_embeds,
            "experts": tuple(tuple(r[3]) for r in rows),
        }

    def __call__(self, request: RolloutRequest) -> PluginRollout:
        samples = self.sample_reference_model(request)
        return PluginRollout(
            log_probs=samples["log_probs"],
            timesteps=samples["timesteps"],
            seeds=request.seeds,
            window_starts=tuple(w.start for w in request.windows),
            prompt_groups=request.prompt_groups,
            batch=samples,
            experts=samples["experts"],
        )


class DanceGRPOTrainer:
    """The trainer: ``grpo_one_step`` per (sample, timestep), each sample visiting its timesteps in its own order."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model = wan22_model(config)
        self.eta = config.noise_level
        self.cfg_infer = config.guidance_scale
        # The trainer's own schedule (DanceGRPO builds its shifted sigmas itself): Wan's flow shift, the same steps.
        self.scheduler = SchedulerSetup(config=WAN_SCHEDULER_CONFIG, num_inference_steps=config.num_inference_steps)
        # DanceGRPO permutes with the global RNG; here a generator seeded by explicit arguments.
        self.generator = torch.Generator().manual_seed(config.seed + 7919 * config.global_step)

    def transformer_for(self, t: torch.Tensor) -> tuple[str, torch.nn.Module]:
        return current_model(self.model, t)

    def grpo_one_step(self, samples, i: int, step: int) -> torch.Tensor:
        latents = samples["latents"][i : i + 1, step]
        t = samples["timesteps"][i, step]
        _, transformer = self.transformer_for(t)
        pred = predict(
            transformer,
            latents,
            t.expand(1),
            samples["encoder_hidden_states"][i : i + 1],
            samples["negative_prompt_embeds"][i : i + 1],
            self.cfg_infer,
        )
        return (
            self.scheduler.scheduler()
            .sample_previous_step(
                pred,
                t,
                latents,
                noise_level=self.eta,
                sde_type="dance_sde",
                prev_sample=samples["next_latents"][i : i + 1, step],
            )
            .log_prob
        )

    def experts(self, samples: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
        """Which expert ``grpo_one_step`` scores each stored step with."""
        return tuple(tuple(self.transformer_for(t)[0] for t in row) for row in samples["timesteps"])

    def __call__(self, samples: dict[str, Any], *, micro_batch_size: int) -> torch.Tensor:
        batch_size, steps = samples["log_probs"].shape
        perms = torch.stack([torch.randperm(steps, generator=self.generator) for _ in range(batch_size)])
        new_log_probs = torch.full((batch_size, steps), float("nan"))
        with torch.no_grad():
            for i in range(batch_size):  # one sample at a time (samples_batched_list)
                for step in perms[i].tolist():
                    new_log_probs[i, step] = self.grpo_one_step(samples, i, step)
        return new_log_probs  # a cell never computed stays NaN (the check fails closed)


class OneExpertTrainer(DanceGRPOTrainer):
    """The trainer holding one module (``transformer``) for every timestep."""

    def transformer_for(self, t: torch.Tensor) -> tuple[str, torch.nn.Module]:
        return "transformer", self.model.transformer


def make_rollout(config: CheckConfig) -> DanceGRPORollout:
    return DanceGRPORollout(config)


def make_trainer(config: CheckConfig) -> DanceGRPOTrainer:
    return DanceGRPOTrainer(config)


def make_trainer_one_expert(config: CheckConfig) -> OneExpertTrainer:
    return OneExpertTrainer(config)
