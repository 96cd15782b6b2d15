# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Plug-in template: your flow_grpo-style rollout and trainer, gated by the step-1 check.

Get a copy with ``rollout-consistency plugin-template my_plugins.py`` (``--family sd3``, ``flux`` or ``wan`` for
another model family: it sets ``FAMILY`` below), then run it as it is (the family's built-in tiny model, CPU, a
few seconds, PASS)::

    rollout-consistency check --rollout-backend my_plugins.py:make_rollout \
        --trainer-backend my_plugins.py:make_trainer --sde-window-size all --model-family qwen-image

and replace the three parts marked ``YOUR CODE`` with yours: the policy you load, your SDE step with log-prob
(flow_grpo's ``sde_step_with_logprob``), and the transformer call (flow_grpo's ``compute_log_prob``). The
sampling loop and the training loop below are flow_grpo's (``pipeline_with_logprob`` and the inner loop of
``train_sd3.py``): keep yours in the same place.

How the checker uses this file (docs/checker.md, "Plug-in backends: your own rollout and trainer"):

* it imports the file once per process, with its folder importable: ``make_rollout`` and ``make_trainer`` share
  this module's state (here, ``_SHARED``: one policy for both), and the file may import its neighbours. One policy
  for both sides also means that step 2 (``--weight-sync``) cannot test a sync between them (it FAILs saying so):
  load a policy per side there, as your engine and trainer do;
* it calls ``make_rollout(config)`` and ``make_trainer(config)`` once per worker (``config`` is the
  `CheckConfig`: noise_level, num_inference_steps, seed, ...);
* per rollout batch of its plan, ``Rollout.rollout(request)``: sample ``len(request.seeds)`` images, one per
  seed, and return the log-prob table with the ``samples`` dict your trainer re-scores;
* ``Trainer.recompute_log_probs(samples, micro_batch_size=...)``: recompute the log-prob of every stored step
  with your training code, before any update, as a ``(samples, steps)`` float32 table;
* for a model with experts by timestep (Wan 2.2's ``transformer`` / ``transformer_2``; ``--boundary-ratio 0.875``
  makes the tiny Wan model two experts), the rollout records which expert took each stored step
  (``PluginRollout.experts``) and ``Trainer.experts(samples)`` says which one the trainer scores it with: the
  ``experts`` guard compares them step by step. Both are ``None`` for a family without experts.

``--sde-window-size all``: flow_grpo samples with the SDE on every step; the checker's plan then gives every
sample a window of every step, and the ``windows`` guard checks what this rollout reports against it.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_consistency.gate import CheckConfig, PluginRollout, RolloutRequest

# The model family this file samples and scores (`rollout-consistency plugin-template --family` sets it); the
# check must run with the same one (`--model-family`): the plan's prompt conditioning is that family's.
FAMILY = "qwen-image"

# Module state shared by the rollout and the trainer built in one process (this module is imported once).
_SHARED: dict[str, Any] = {}


# ------------------------------------------------------------------------------------------------------
# YOUR CODE 1/3: the policy. Both sides must load the same weights (the checker fingerprints `model`).
def load_pipeline(config: CheckConfig) -> tuple[Any, Any, Any, dict[str, Any], float]:
    """(transformer, schedule, family, options, guidance): here the built-in tiny model of `FAMILY`; yours loads
    your checkpoint (and LoRA) and your scheduler config (what ``from_pretrained(path, subfolder="scheduler")``
    reads: `rollout_consistency.adapters.families.load_scheduler_config(path)`)."""
    from rollout_consistency.adapters import get_family
    from rollout_consistency.adapters.tiny import get_tiny
    from rollout_consistency.gate.sides.backends import pipeline_settings

    if config.model_family != FAMILY:
        raise ValueError(f"this file samples the {FAMILY} family: run the check with --model-family {FAMILY}")
    family = get_family(FAMILY)
    settings = pipeline_settings(config)  # height, width, num_frames, guidance, boundary_ratio, ...
    if "transformer" not in _SHARED:
        # Wan 2.2: `boundary_ratio` makes the tiny model two experts by timestep.
        model_kwargs = family.model_kwargs(settings) if family.model_kwargs is not None else {}
        _SHARED["transformer"] = get_tiny(FAMILY).load_transformer(
            dtype=torch.float32, device="cpu", seed=0, **model_kwargs
        )
    transformer = _SHARED["transformer"]
    options = family.options(settings)
    # The tiny model's scheduler config is the family's released one (rollout_consistency.adapters.tiny).
    setup = family.scheduler_setup(family.scheduler_config, config.num_inference_steps, transformer, options)
    return transformer, setup, family, options, float(family.guidance(settings))


# YOUR CODE 2/3: the SDE step with its log-prob (flow_grpo's sde_step_with_logprob). Keep everything float32.
def sde_step_with_logprob(
    scheduler: Any,
    model_output: torch.Tensor,
    timestep: torch.Tensor,
    sample: torch.Tensor,
    *,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = scheduler.sample_previous_step(
        model_output, timestep, sample, noise_level=noise_level, prev_sample=prev_sample, generator=generator
    )
    return out.prev_sample, out.log_prob


# YOUR CODE 3/3: the transformer's velocity (noise_pred) for a batch of latents at timesteps `t`.
def predict_noise(pipeline: Any, latents: torch.Tensor, t: torch.Tensor, conditioning: dict) -> torch.Tensor:
    family, options = pipeline.family, pipeline.options
    return family.velocity(pipeline.model, latents, t, conditioning, pipeline.guidance, options=options).float()


# Models with experts by timestep (Wan 2.2): which expert takes the step at timesteps `t`; None without experts.
def expert_names(pipeline: Any, t: torch.Tensor) -> tuple[str, ...] | None:
    experts = pipeline.family.experts
    return None if experts is None else experts(pipeline.model, t, pipeline.options)


# ------------------------------------------------------------------------------------------------------
# The rollout: flow_grpo's pipeline_with_logprob, SDE on every step.
class Rollout:
    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model, setup, self.family, self.options, self.guidance = load_pipeline(config)
        self.scheduler, self.timesteps = setup.scheduler(), setup.timesteps()

    def rollout(self, request: RolloutRequest) -> PluginRollout:
        num_steps = len(self.timesteps)
        if any(w.start != 0 or w.size != num_steps for w in request.windows):
            raise ValueError(
                "this rollout samples with the SDE on every step: run the check with --sde-window-size all"
            )
        n = len(request.seeds)
        # The prompts' text conditioning, batch-first (here the checker's encoder; yours: encode request.prompts).
        conditioning = {name: value for name, value in request.conditioning.items()}
        # One generator per sample, seeded with the plan's seed: the initial noise and every SDE draw.
        generators = [torch.Generator().manual_seed(seed) for seed in request.seeds]
        latents = self.family.initial_latents(self.model, generators, self.options).float()
        all_latents, all_log_probs, all_experts = [latents], [], []
        with torch.no_grad():
            for t in self.timesteps:
                all_experts.append(expert_names(self, t.expand(n)))
                noise_pred = predict_noise(self, latents, t.expand(n), conditioning)
                latents, log_prob = sde_step_with_logprob(
                    self.scheduler,
                    noise_pred,
                    t,
                    latents,
                    noise_level=self.config.noise_level,
                    generator=generators,
                )
                all_latents.append(latents)
                all_log_probs.append(log_prob)
        latents = torch.stack(all_latents, dim=1)  # (n, num_steps + 1, ...)
        samples = {
            **conditioning,
            "timesteps": self.timesteps.float().repeat(n, 1),  # (n, num_steps)
            "latents": latents[:, :-1],  # each entry is the latent before timestep t
            "next_latents": latents[:, 1:],  # each entry is the latent after timestep t
            "log_probs": torch.stack(all_log_probs, dim=1),  # (n, num_steps) float32
        }
        return PluginRollout(
            log_probs=samples["log_probs"],
            timesteps=samples["timesteps"],
            seeds=tuple(request.seeds),
            window_starts=tuple(w.start for w in request.windows),
            prompt_groups=tuple(request.prompt_groups),
            batch=samples,
            # Per sample, the expert of each stored step (None for a family without experts).
            experts=None if all_experts[0] is None else tuple(zip(*all_experts, strict=True)),
        )


# The trainer: flow_grpo's compute_log_prob, in its training loop's order (micro-batches, then timesteps).
class Trainer:
    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.model, setup, self.family, self.options, self.guidance = load_pipeline(config)
        self.scheduler = setup.scheduler()

    def compute_log_prob(self, sample: dict[str, torch.Tensor], j: int, conditioning: dict) -> torch.Tensor:
        noise_pred = predict_noise(self, sample["latents"][:, j], sample["timesteps"][:, j], conditioning)
        _, log_prob = sde_step_with_logprob(
            self.scheduler,
            noise_pred,
            sample["timesteps"][:, j],
            sample["latents"][:, j],
            noise_level=self.config.noise_level,
            prev_sample=sample["next_latents"][:, j],
        )
        return log_prob

    def recompute_log_probs(self, samples: dict[str, torch.Tensor], *, micro_batch_size: int) -> torch.Tensor:
        n, num_steps = samples["log_probs"].shape
        conditioning_keys = [k for k in samples if k not in ("timesteps", "latents", "next_latents", "log_probs")]
        out = torch.full((n, num_steps), float("nan"))  # a cell never computed stays NaN: the check FAILs it
        with torch.no_grad():
            for start in range(0, n, micro_batch_size):
                rows = slice(start, start + micro_batch_size)
                sample = {k: v[rows] for k, v in samples.items()}
                conditioning = {k: sample[k] for k in conditioning_keys}
                for j in range(num_steps):
                    out[rows, j] = self.compute_log_prob(sample, j, conditioning)
        return out

    def experts(self, samples: dict[str, torch.Tensor]) -> tuple[tuple[str, ...], ...] | None:
        """Per sample, the expert this trainer scores each stored step with (Wan 2.2); None without experts."""
        steps = [expert_names(self, samples["timesteps"][:, j]) for j in range(samples["timesteps"].shape[1])]
        return None if steps[0] is None else tuple(zip(*steps, strict=True))


def make_rollout(config: CheckConfig) -> Rollout:
    return Rollout(config)


def make_trainer(config: CheckConfig) -> Trainer:
    return Trainer(config)
