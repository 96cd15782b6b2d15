# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The family-agnostic denoising core: one request-level rollout loop and one recompute.

A model family (Qwen-Image, SD3, FLUX) is a [`ModelFamily`]: a frozen bundle of plain functions, chiefly
its *velocity function*

    velocity(transformer, latents, timesteps, conditioning, guidance_scale, *, options, injection=None)
        latents    (B, *latent_shape) float32
        timesteps  (B,) float32, exact schedule values (per sample: a batch may mix steps)
        returns    (B, *latent_shape) float32

which casts the latents to the transformer's dtype only for the forward, casts the prediction back to
float32, and applies classifier-free guidance in float32. Everything else here is shared.

Precision policy (DESIGN.md §4): latents, log-probs and timesteps are float32 from the first draw to the
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

Bit-exactness: recompute runs the same forward on the same stored float32 inputs as the rollout, so with
the same model it reproduces the rollout's log-probs bit for bit — provided the forward is batch-invariant
for the batches used. The simplest way to guarantee it is to recompute with the rollout's batch composition
(micro-batches of the same rows). Other compositions may take other kernels on this CPU build — a single
row takes a matrix-vector kernel, and some batches of 3 round differently for SD3 — with differences of
~1e-7, see docs/adapters.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from rollout_consistency.schedulers import SDEWindow

from . import pitfalls
from .pitfalls import Injection
from .schedule import SchedulerSetup
from .trajectory import Trajectory

__all__ = [
    "ModelFamily",
    "VelocityFn",
    "check_float32_inputs",
    "check_pooled_text",
    "common_conditioning_keys",
    "concat_fixed_width_conditioning",
    "get_family",
    "make_generators",
    "model_dtype",
    "recompute_log_probs",
    "recompute_step_log_prob",
    "resolve_windows",
    "rollout",
]


class VelocityFn(Protocol):
    def __call__(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Mapping[str, torch.Tensor],
        guidance_scale: float,
        *,
        options: Mapping[str, Any],
        injection: Injection | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelFamily:
    """The per-family functions the shared loops need. All are plain functions of their arguments.

    Attributes:
        name: the family id stored in trajectories (`"qwen-image"`, `"sd3"`, `"flux"`).
        velocity: see [`VelocityFn`] and the module docstring.
        latent_shape: `(transformer, options) -> tuple` — per-sample latent shape the velocity takes.
        initial_latents: `(transformer, generators, options) -> Tensor (B, *latent_shape) float32` — draws
            each sample's initial noise from its own CPU generator (one generator per sample, in order).
        scheduler_setup: `(scheduler_config, num_inference_steps, transformer, options) -> SchedulerSetup` —
            the schedule the family's diffusers pipeline would use.
        check_conditioning: `(transformer, conditioning, batch_size, guidance_scale, options) -> None` —
            raises ValueError/TypeError naming the fix for missing or malformed conditioning (mask/embedding
            length mismatch, CFG without a negative prompt, wrong embedding width, ...).
        collate_conditioning: `(list of per-request conditionings, width or None) -> conditioning` — batches
            per-request conditionings (each batch-first) for one forward, padding text to `width` (or to
            the widest when `None`). Used by the step-wise path.
        row_inputs: the transformer's keyword inputs that are batch-first tensors or per-sample lists, which
            batch-invariant mode splits by row (`rollout_consistency.adapters.batch_invariance`).
    """

    name: str
    velocity: VelocityFn
    latent_shape: Callable[[nn.Module, Mapping[str, Any]], tuple[int, ...]]
    initial_latents: Callable[[nn.Module, Sequence[torch.Generator], Mapping[str, Any]], torch.Tensor]
    scheduler_setup: Callable[[Mapping[str, Any], int, nn.Module, Mapping[str, Any]], SchedulerSetup]
    check_conditioning: Callable[[nn.Module, Mapping[str, torch.Tensor], int, float, Mapping[str, Any]], None]
    collate_conditioning: Callable[[Sequence[Mapping[str, torch.Tensor]], int | None], dict[str, torch.Tensor]]
    row_inputs: frozenset[str] = frozenset()


# Where each family lives; imported on first use so `import adapters` stays light and a family module that
# is absent (or has a missing optional dependency) does not break the others.
_FAMILY_MODULES = {
    "qwen-image": "rollout_consistency.adapters.qwen_image",
    "sd3": "rollout_consistency.adapters.sd3",
    "flux": "rollout_consistency.adapters.flux",
}


def get_family(name: str) -> ModelFamily:
    """The [`ModelFamily`] of a trajectory's `model_family` string (each family module exports `FAMILY`)."""
    if name not in _FAMILY_MODULES:
        raise ValueError(f"Unknown model family {name!r}; known: {', '.join(sorted(_FAMILY_MODULES))}.")
    module = importlib.import_module(_FAMILY_MODULES[name])
    return module.FAMILY


def make_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU `torch.Generator` per sample, seeded with that sample's seed (see the module docstring)."""
    generators = []
    for seed in seeds:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"Seeds must be ints (one per sample), got {seed!r}.")
        generators.append(torch.Generator(device="cpu").manual_seed(seed))
    return generators


def model_dtype(transformer: nn.Module) -> torch.dtype:
    """Dtype of the transformer's floating parameters (what its forward computes in)."""
    for parameter in transformer.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def model_device(transformer: nn.Module) -> torch.device:
    """Device of the transformer's first parameter (where its inputs must live); CPU for a parameterless one."""
    for parameter in transformer.parameters():
        return parameter.device
    return torch.device("cpu")


def resolve_windows(window: SDEWindow | Sequence[SDEWindow], batch_size: int, num_steps: int) -> tuple[SDEWindow, ...]:
    """One window per sample: a single `SDEWindow` is shared; a sequence must hold `batch_size` windows of one
    size. Raises ValueError for a window that does not belong to a `num_steps`-step schedule."""
    windows = (window,) * batch_size if isinstance(window, SDEWindow) else tuple(window)
    if len(windows) != batch_size:
        raise ValueError(f"{len(windows)} windows for {batch_size} samples: pass one window, or one per sample.")
    for w in windows:
        if not isinstance(w, SDEWindow):
            raise TypeError(
                f"Expected SDEWindow, got {w!r}; build one with rollout_consistency.schedulers.draw_sde_window(...)."
            )
        if w.num_steps != num_steps:
            raise ValueError(
                f"SDE window {w} is for a {w.num_steps}-step schedule but the rollout runs {num_steps} steps: the "
                f"window lies outside the schedule. Draw it with num_steps={num_steps}."
            )
    if len({w.size for w in windows}) != 1:
        raise ValueError(f"All samples need the same window size, got {sorted({w.size for w in windows})}.")
    return windows


def check_float32_inputs(latents: torch.Tensor, timesteps: torch.Tensor) -> None:
    """TypeError unless a velocity function's `latents` and `timesteps` are float32 (see the module docstring)."""
    if latents.dtype != torch.float32 or timesteps.dtype != torch.float32:
        raise TypeError(
            f"velocity() takes float32 latents and timesteps (got {latents.dtype}, {timesteps.dtype}); the adapters "
            f"keep them float32 and cast to the transformer's dtype only here, for the forward."
        )


def common_conditioning_keys(conditionings: Sequence[Mapping[str, torch.Tensor]]) -> set[str]:
    """The conditioning keys every request shares; ValueError for no requests or requests with different keys
    (they cannot share a forward)."""
    if not conditionings:
        raise ValueError("collate_conditioning needs at least one request.")
    keys = set(conditionings[0])
    for cond in conditionings[1:]:
        if set(cond) != keys:
            raise ValueError(
                f"Requests with different conditioning keys cannot share a forward: {sorted(keys)} vs {sorted(cond)}."
            )
    return keys


def check_pooled_text(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    embeds_key: str,
    pooled_key: str,
    batch: int,
    *,
    family_label: str,
) -> None:
    """Check one text of a CLIP + T5 family (SD3, FLUX): `embeds_key` `(B, L, joint_attention_dim)` and
    `pooled_key` `(B, pooled_projection_dim)`, both float32 with `batch` rows.

    Raises:
        ValueError: a missing tensor, or a wrong rank, row count or width. TypeError: not float32.
    """
    config = transformer.config
    for key, expected, layout in (
        (embeds_key, int(config.joint_attention_dim), "(B, L, joint_attention_dim)"),
        (pooled_key, int(config.pooled_projection_dim), "(B, pooled_projection_dim)"),
    ):
        tensor = conditioning.get(key)
        if tensor is None:
            raise ValueError(
                f"{family_label} conditioning has no {key!r} {layout}; pass both outputs of encode_prompt for this "
                f"text ({embeds_key!r} and {pooled_key!r})."
            )
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != layout.count(",") + 1:
            raise ValueError(
                f"{family_label} {key} must be a {layout} tensor, got {getattr(tensor, 'shape', tensor)!r}."
            )
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"{family_label} {key} is {tensor.dtype}; pass float32 embeddings (they are stored as given)."
            )
        if tensor.shape[0] != batch:
            raise ValueError(
                f"{family_label} {key} has {tensor.shape[0]} rows for {batch} samples (seeds); pass one row per sample."
            )
        if tensor.shape[-1] != expected:
            raise ValueError(
                f"{family_label} {key} has width {tensor.shape[-1]} but this transformer takes {expected} {layout}."
            )


def concat_fixed_width_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]],
    width: int | None,
    *,
    text_keys: Sequence[str],
    pipeline: str,
) -> dict[str, torch.Tensor]:
    """Batch per-request conditionings of a family whose transformer attends to text padding (SD3, FLUX).

    No key-padding mask means zero-padding an embedding to a wider shared width would change the
    prediction, so requests must share one text width (the encoder's fixed `max_sequence_length`) and are
    concatenated as they are; a `width` other than theirs is refused.

    Raises:
        ValueError: no requests, different keys, different text widths, or a `width` that needs padding.
    """
    keys = common_conditioning_keys(conditionings)
    for embeds_key in text_keys:
        if embeds_key not in keys:
            continue
        widths = {int(c[embeds_key].shape[1]) for c in conditionings}
        if len(widths) > 1 or (width is not None and widths != {width}):
            raise ValueError(
                f"{pipeline} requests with {embeds_key} widths {sorted(widths)} cannot share a forward"
                f"{'' if width is None else f' at width {width}'}: the transformer attends to padding tokens (no "
                f"text mask), so re-padding changes the prediction. Encode every prompt to the same fixed length, "
                f"as {pipeline} does (max_sequence_length)."
            )
    return {key: torch.cat([c[key] for c in conditionings]) for key in sorted(keys)}


def _check_rollout_args(seeds, prompt_groups, noise_level, global_step) -> tuple[tuple[int, ...], tuple[int, ...]]:
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("A rollout needs at least one sample (one seed per sample).")
    prompt_groups = tuple(range(len(seeds))) if prompt_groups is None else tuple(prompt_groups)
    if len(prompt_groups) != len(seeds):
        raise ValueError(f"{len(prompt_groups)} prompt groups for {len(seeds)} seeds: pass one per sample.")
    if not (isinstance(noise_level, (int, float)) and noise_level > 0):
        raise ValueError(f"noise_level must be > 0 for a rollout with log-probs, got {noise_level!r}.")
    if not isinstance(global_step, int) or global_step < 0:
        raise ValueError(f"global_step must be an int >= 0, got {global_step!r}.")
    return seeds, prompt_groups


def rollout(
    family: ModelFamily,
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    *,
    scheduler_setup: SchedulerSetup,
    seeds: Sequence[int],
    window: SDEWindow | Sequence[SDEWindow],
    noise_level: float,
    sde_type: str = "sde",
    guidance_scale: float = 1.0,
    options: Mapping[str, Any] | None = None,
    prompt_groups: Sequence[int] | None = None,
    global_step: int = 0,
    include_normalizer: bool = True,
    denoise_to_end: bool = True,
    injection: Injection | None = None,
) -> Trajectory:
    """Request-level rollout of a batch: denoise with SDE steps inside each sample's window, ODE outside.

    Args:
        family: the model family (e.g. `rollout_consistency.adapters.qwen_image.FAMILY`).
        transformer: the family's transformer, any dtype; inputs are cast to it for the forward only.
        conditioning: batch-first tensors the velocity function consumes (one row per sample, `B = len(seeds)`).
        scheduler_setup: the schedule (see [`SchedulerSetup`]).
        seeds: per-sample seeds (initial and SDE noise; see the module docstring).
        window: one `SDEWindow` for all samples or one per sample (samples of a prompt group must share it).
        noise_level, sde_type, include_normalizer: SDE settings, passed to the scheduler.
        guidance_scale: true-CFG scale; CFG runs when > 1 and then needs negative conditioning.
        options: the family's forward settings (stored as `Trajectory.family_options`).
        prompt_groups: per-sample prompt-group ids (default: each sample its own group).
        global_step: training step (stored).
        denoise_to_end: also run the steps after the last window and store `final_latents` (for the reward);
            `False` stops after the last window step.
        injection: stock behaviours to reproduce (tests and `--inject` only); see `rollout_consistency.adapters.pitfalls`.

    Returns:
        A validated float32 [`Trajectory`].
    """
    options = dict(options or {})
    seeds, prompt_groups = _check_rollout_args(seeds, prompt_groups, noise_level, global_step)
    batch = len(seeds)
    num_steps = scheduler_setup.num_inference_steps
    windows = resolve_windows(window, batch, num_steps)
    injection = injection or None
    if injection is not None and injection.per_request_window:
        # Reproduction: every request draws its own window from an unseeded RNG (DESIGN.md §1).
        windows = tuple(
            pitfalls.stock_per_request_window(f"request-{b}", num_steps=num_steps, window_size=windows[0].size)
            for b in range(batch)
        )
    family.check_conditioning(transformer, conditioning, batch, guidance_scale, options)

    device = model_device(transformer)
    dtype = model_dtype(transformer)
    scheduler = scheduler_setup.scheduler()
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
    last_step = num_steps if denoise_to_end else max(w.stop for w in windows)
    round_latents = injection is not None and injection.bf16_latents

    with torch.no_grad():
        for step in range(last_step):
            t = schedule[step]
            velocity = family.velocity(
                transformer,
                latents,
                t.expand(batch).to(device),
                conditioning,
                guidance_scale,
                options=options,
                injection=injection,
            )
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
                if round_latents:
                    prev = pitfalls.stock_round_to_model_dtype(prev, dtype)
                if in_window:
                    positions = [step - windows[b].start for b in rows]
                    stored[rows, positions] = sample
                    log_probs[rows, positions] = out.log_prob
                    timesteps[rows, positions] = t
                    last = [i for i, k in enumerate(positions) if k == window_size - 1]
                    if last:
                        stored[[rows[i] for i in last], window_size] = prev[last]
                if whole:
                    new_latents = prev
                else:
                    new_latents[picked] = prev
            latents = new_latents

    provenance = {"path": "request-level"}
    if injection is not None:
        provenance["injection"] = ",".join(injection.names)
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
    ).validate()


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_trajectory_for_model(family: ModelFamily, transformer: nn.Module, trajectory: Trajectory) -> None:
    """ValueError when a trajectory does not fit the model (family, latent shape, conditioning)."""
    if trajectory.model_family != family.name:
        raise ValueError(
            f"The trajectory is from a {trajectory.model_family!r} rollout but the {family.name!r} adapter was asked "
            f"to re-score it; use the {trajectory.model_family!r} family."
        )
    expected = tuple(family.latent_shape(transformer, trajectory.family_options))
    if trajectory.latent_shape != expected:
        raise ValueError(
            f"Stored latents have per-sample shape {trajectory.latent_shape} but this {family.name} transformer with "
            f"family_options {dict(trajectory.family_options)} takes {expected}: wrong latent shape for the model "
            f"(another model config or image size)."
        )
    family.check_conditioning(
        transformer,
        trajectory.conditioning,
        trajectory.batch_size,
        trajectory.guidance_scale,
        trajectory.family_options,
    )


def recompute_step_log_prob(
    transformer: nn.Module,
    trajectory: Trajectory,
    k: int,
    *,
    family: ModelFamily | None = None,
    autocast_dtype: torch.dtype | None = None,
    scheduler: Any = None,
    check: bool = True,
) -> torch.Tensor:
    """Log-prob of stored window step `k` for every sample, `(B,)` float32, differentiable when grad is on.

    Scores `trajectory.latents[:, k+1]` given `trajectory.latents[:, k]` at `trajectory.timesteps[:, k]` with
    the trajectory's conditioning, guidance and noise settings. Gradients reach the transformer through the
    transition mean only (the scored sample is detached). Call under `torch.no_grad()` for a check, or with
    grad enabled and back-propagate step by step to bound memory.

    Args:
        autocast_dtype: run the forward under `torch.autocast(dtype=...)` (a bf16 mixed-precision trainer with
            float32 master weights). `None` runs in the transformer's own dtype (load it in bf16 or fp32).
        scheduler: a built scheduler to use (default: `trajectory.scheduler.scheduler()`, cached on the setup).
        check: validate that the trajectory fits the model first (skip when looping over steps).
    """
    family = family or get_family(trajectory.model_family)
    if check:
        check_trajectory_for_model(family, transformer, trajectory)
    if not 0 <= k < trajectory.window_size:
        raise IndexError(f"Window step {k} out of range for a window of {trajectory.window_size} steps.")
    device = model_device(transformer)
    scheduler = scheduler or trajectory.scheduler.scheduler()
    # Contiguous copies: a (B, W+1, ...) slice is strided, and strided inputs slow every op after it.
    sample = trajectory.latents[:, k].to(device).contiguous()
    prev_sample = trajectory.latents[:, k + 1].to(device).contiguous()
    timestep = trajectory.timesteps[:, k].to(device)
    conditioning = {name: t.to(device) for name, t in trajectory.conditioning.items()}
    with _autocast(device, autocast_dtype):
        velocity = family.velocity(
            transformer,
            sample,
            timestep,
            conditioning,
            trajectory.guidance_scale,
            options=trajectory.family_options,
        )
    velocity = velocity.float()
    out = scheduler.sample_previous_step(
        velocity,
        timestep,
        sample,
        noise_level=trajectory.noise_level,
        sde_type=trajectory.sde_type,
        prev_sample=prev_sample,
        include_normalizer=trajectory.include_normalizer,
    )
    return out.log_prob


def recompute_log_probs(
    transformer: nn.Module,
    trajectory: Trajectory,
    *,
    family: ModelFamily | None = None,
    steps: Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The trainer's log-probs of the stored window steps, `(B, len(steps))` float32 (all steps by default).

    Same forward, same float32 inputs, same scheduler maths as the rollout: with the same model and batch
    composition the result equals `trajectory.log_probs` bit for bit. Differentiable when grad is enabled
    (the whole graph of all requested steps is kept — for training, loop over
    [`recompute_step_log_prob`] instead).
    """
    family = family or get_family(trajectory.model_family)
    check_trajectory_for_model(family, transformer, trajectory)
    steps = range(trajectory.window_size) if steps is None else list(steps)
    scheduler = trajectory.scheduler.scheduler()
    columns = [
        recompute_step_log_prob(
            transformer, trajectory, k, family=family, autocast_dtype=autocast_dtype, scheduler=scheduler, check=False
        )
        for k in steps
    ]
    return torch.stack(columns, dim=1)
