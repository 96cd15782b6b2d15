# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The request-level rollout: one family-agnostic loop over a [`ModelFamily`](rollout_consistency.adapters.families.ModelFamily)'s functions.

Precision policy (docs/design.md): latents, log-probs and timesteps are float32 from the first draw to the
stored trajectory; the scheduler is called through its strict `sample_previous_step`, which refuses a
non-float32 tensor. Only window steps draw SDE noise and carry a log-prob; the other steps are Euler (ODE).

Seeds and random draws (the contract a step-wise or vLLM-omni pipeline must reproduce):

* sample `b` owns one `torch.Generator("cpu")` seeded with `seeds[b]` ([`make_generators`]);
* it first draws the sample's initial noise (float32, on the CPU, in the family's noise shape — for
  Qwen-Image the unpacked `(1, 1, C, h, w)` that diffusers' pipeline draws, then packed);
* then, at each of its window steps in denoising order, the scheduler draws one standard normal of shape
  `(1, *latent_shape)`, float32, on the CPU, from the same generator. ODE steps draw nothing.

Draws happen on the CPU and are moved to the model's device, so the same seeds give the same noise on any
device, and a sample's noise never depends on its batch-mates or on the batch order.

The trainer's side (`rollout_consistency.adapters.trainer`) re-scores the stored steps with the same forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rollout_consistency.schedulers import SchedulerSetup, SDEWindow

from .families import ModelFamily, merged_options, model_device
from .settings import BatchRequests, SamplingSettings
from .trajectory import Trajectory

__all__ = ["family_rollout", "make_generators", "recorded_experts", "resolve_windows", "rollout"]


def make_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU `torch.Generator` per sample, seeded with that sample's seed (see the module docstring)."""
    generators = []
    for seed in seeds:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"Seeds must be ints (one per sample), got {seed!r}.")
        generators.append(torch.Generator(device="cpu").manual_seed(seed))
    return generators


def resolve_windows(requests: BatchRequests, num_steps: int) -> tuple[SDEWindow, ...]:
    """One window per sample of `requests` (a single `SDEWindow` is shared). Raises ValueError for `None`, a
    window that does not belong to a `num_steps`-step schedule, or windows of different sizes."""
    window = requests.windows
    if window is None:
        raise ValueError(
            "BatchRequests.windows is None: this rollout needs explicit windows (one SDEWindow, or one per sample; "
            "draw them with rollout_consistency.schedulers.draw_sde_window)."
        )
    windows = (window,) * len(requests.seeds) if isinstance(window, SDEWindow) else window
    for w in windows:
        if w.num_steps != num_steps:
            raise ValueError(
                f"SDE window {w} is for a {w.num_steps}-step schedule but the rollout runs {num_steps} steps: the "
                f"window lies outside the schedule. Draw it with num_steps={num_steps}."
            )
    if len({w.size for w in windows}) != 1:
        raise ValueError(f"All samples need the same window size, got {sorted({w.size for w in windows})}.")
    return windows


def rollout(
    family: ModelFamily,
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    *,
    scheduler_setup: SchedulerSetup,
    requests: BatchRequests,
    sampling: SamplingSettings,
    options: Mapping[str, Any] | None = None,
    scheduler: Any = None,
) -> Trajectory:
    """Request-level rollout of a batch: denoise with SDE steps inside each sample's window, ODE outside.

    Args:
        family: the model family (e.g. `rollout_consistency.adapters.qwen_image.FAMILY`).
        transformer: the family's transformer, any dtype; inputs are cast to it for the forward only.
        conditioning: batch-first tensors the velocity function consumes (one row per sample,
            `B = len(requests.seeds)`).
        scheduler_setup: the schedule (see [`SchedulerSetup`]).
        requests ([`BatchRequests`]): the samples: per-sample seeds (initial and SDE noise; see the module
            docstring), one `SDEWindow` for all samples or one per sample (samples of a prompt group must share
            it), prompt-group ids (default: each sample its own group), the training step (stored), and
            `denoise_to_end` (also run the steps after the last window and store `final_latents`, for the
            reward; `False` stops after the last window step).
        sampling ([`SamplingSettings`]): noise level, SDE type and normaliser (passed to the scheduler) and the
            guidance scale (CFG runs when > 1 and then needs negative conditioning).
        options: the family's forward settings (stored as `Trajectory.family_options`).
        scheduler: the scheduler to step with (default: `scheduler_setup.scheduler()`, cached on the setup) — a
            subclass of your own, or a stock-pitfall wrapper from `rollout_consistency.adapters.pitfalls`. Only its
            stateless `sample_previous_step` is called.

    Returns:
        A validated float32 [`Trajectory`] (its `.requests` / `.sampling` give back what was asked, per sample).
    """
    options = dict(options or {})
    noise_level, sde_type = sampling.noise_level, sampling.sde_type
    guidance_scale, include_normalizer = sampling.guidance_scale, sampling.include_normalizer
    global_step, denoise_to_end = requests.global_step, requests.denoise_to_end
    seeds, prompt_groups = requests.seeds, requests.groups
    batch = len(seeds)
    num_steps = scheduler_setup.num_inference_steps
    windows = resolve_windows(requests, num_steps)
    family.check_conditioning(transformer, conditioning, batch, guidance_scale, options)

    device = model_device(transformer)
    scheduler = scheduler_setup.scheduler() if scheduler is None else scheduler
    schedule = scheduler_setup.timesteps()
    conditioning = {k: v.to(device) for k, v in conditioning.items()}
    generators = make_generators(seeds)
    latents = family.initial_latents(transformer, generators, options).to(device=device, dtype=torch.float32)
    expected_shape = (batch, *family.latent_shape(transformer, options))
    if tuple(latents.shape) != expected_shape:
        raise ValueError(f"{family.name}: initial latents {tuple(latents.shape)} != expected {expected_shape}.")

    window_size = windows[0].size
    stored = torch.empty((batch, window_size + 1, *expected_shape[1:]), dtype=torch.float32, device=device)
    log_probs = torch.empty((batch, window_size), dtype=torch.float32, device=device)
    timesteps = torch.empty((batch, window_size), dtype=torch.float32)
    # Which expert took each window step (models with experts by timestep only; None entries otherwise).
    experts: list[list[str | None]] = [[None] * window_size for _ in range(batch)]
    last_step = num_steps if denoise_to_end else max(w.stop for w in windows)

    with torch.no_grad():
        for step in range(last_step):
            t = schedule[step]
            step_timesteps = t.expand(batch).to(device)
            velocity = family.velocity(
                transformer, latents, step_timesteps, conditioning, guidance_scale, options=options
            )
            names = None if family.experts is None else family.experts(transformer, step_timesteps, options)
            sde_rows = [b for b in range(batch) if step in windows[b]]
            ode_rows = [b for b in range(batch) if step not in windows[b]]
            # Rows are stepped in (at most) two groups, SDE and ODE; the step's maths is per element and its
            # log-prob per row, so a row's result does not depend on how rows are grouped.
            new_latents = latents if len(sde_rows) in (0, batch) else torch.empty_like(latents)
            for rows, in_window in ((sde_rows, True), (ode_rows, False)):
                if not rows:
                    continue
                whole = len(rows) == batch
                picked = None if whole else torch.tensor(rows, device=device)
                sample = latents if whole else latents[picked]
                out = scheduler.sample_previous_step(
                    velocity if whole else velocity[picked],
                    t,
                    sample,
                    noise_level=noise_level if in_window else 0.0,
                    sde_type=sde_type,
                    generator=[generators[b] for b in rows] if in_window else None,
                    include_normalizer=include_normalizer,
                )
                prev = out.prev_sample
                if in_window:
                    positions = [step - windows[b].start for b in rows]
                    stored[rows, positions] = sample
                    log_probs[rows, positions] = out.log_prob
                    timesteps[rows, positions] = t
                    if names is not None:
                        for b, k in zip(rows, positions, strict=True):
                            experts[b][k] = names[b]
                    last = [i for i, k in enumerate(positions) if k == window_size - 1]
                    if last:
                        stored[[rows[i] for i in last], window_size] = prev[last]
                if whole:
                    new_latents = prev
                else:
                    new_latents[picked] = prev
            latents = new_latents

    provenance = {"path": "request-level"}
    injected = [getattr(x, "injection_name", None) for x in (scheduler, transformer)]
    if any(injected):
        provenance["injection"] = ",".join(n for n in injected if n)
    return Trajectory(
        latents=stored,
        log_probs=log_probs,
        timesteps=timesteps.to(device),
        windows=windows,
        noise_level=float(noise_level),
        sde_type=sde_type,
        guidance_scale=float(guidance_scale),
        seeds=seeds,
        prompt_groups=prompt_groups,
        global_step=global_step,
        conditioning=conditioning,
        model_family=family.name,
        scheduler=scheduler_setup,
        family_options=options,
        include_normalizer=include_normalizer,
        final_latents=latents if denoise_to_end else None,
        provenance=provenance,
        experts=recorded_experts(experts),
    ).validate()


def recorded_experts(table: Sequence[Sequence[str | None]]) -> tuple[tuple[str, ...], ...] | None:
    """A rollout's per-sample, per-window-step expert names as `Trajectory.experts` stores them: None when no
    step recorded one (a single-expert model); ValueError when only some did (a model that changed mid-run)."""
    recorded = [name is not None for row in table for name in row]
    if not any(recorded):
        return None
    if not all(recorded):
        raise ValueError("Some window steps recorded an expert and others none: the model changed during the rollout.")
    return tuple(tuple(row) for row in table)


def family_rollout(
    family: ModelFamily,
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    *,
    num_inference_steps: int,
    requests: BatchRequests,
    sampling: SamplingSettings,
    scheduler_config: Mapping[str, Any] | None = None,
    scheduler: Any = None,
    **options: Any,
) -> Trajectory:
    """[`rollout`] as a family's diffusers pipeline is called: image size and family options as keywords, the
    schedule the pipeline would use. Each family's `rollout` (`qwen_image.rollout`, `sd3.rollout`,
    `flux.rollout`, `wan.rollout`) is this function for its family (`rollout_consistency.adapters.entry_points`).

    Args:
        num_inference_steps: denoising steps.
        requests, sampling, scheduler: as for [`rollout`].
        scheduler_config: the scheduler config (default: the family's released one, `family.scheduler_config`);
            the schedule is `family.scheduler_setup` of it, as the family's pipeline builds it.
        **options: the family options: `height`, `width` (pixels) and the family's `default_options` (e.g.
            `vae_scale_factor=8`), all stored as `Trajectory.family_options`; another name is a ValueError.
    """
    options = merged_options(family, options, strict=True)
    config = family.scheduler_config if scheduler_config is None else scheduler_config
    if config is None:
        raise ValueError(f"{family.name} registers no released scheduler_config; pass scheduler_config=.")
    setup = family.scheduler_setup(config, num_inference_steps, transformer, options)
    return rollout(
        family,
        transformer,
        conditioning,
        scheduler_setup=setup,
        requests=requests,
        sampling=sampling,
        options=options,
        scheduler=scheduler,
    )
