# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`SidesSettings`]: what the sides know of a step-1 check's settings, as one frozen object in four parts.

The check builds it once, from its `CheckConfig` (`CheckConfig.sides`), every value resolved there (the window
size of ``sde_window_size="all"``, the cycled prompts, the trainer's micro-batch, the floor's variants); the sides
never see the `CheckConfig`, which sits a layer above them, and each of their functions takes the narrowest part
it reads:

    model       `ModelSettings`: what the model is and how each side computes with it (family, path, device,
                dtypes, attention kernels, batch invariance, the trainer's step code, the calibrated floor)
    sampling    `SampleSettings`: what is sampled (prompts, sizes, steps, the SDE step and window, guidance,
                seeds, the training step)
    execution   `ExecutionSettings`: how it runs (the backends, step-wise execution, batch sizes, the injected
                pitfall, step 2's update, the bound on user code)
    user_code   `UserArguments`: what user code receives, bound by the check (a factory's ``config``, a rollout
                plug-in request's ``config``: the `CheckConfig`, as the plug-in and registry contracts promise)

Each fact is defined once, in its `CheckConfig` field's `Setting` (default, bounds, help): these objects only carry
the values. Plain data, picklable (a Ray actor receives it whole); importing it imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = ["ExecutionSettings", "ModelSettings", "SampleSettings", "SidesSettings", "UserArguments"]

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSettings:
    """What the model is and how each side computes with it.

    Attributes:
        model_family: the registered `ModelFamily`'s name. model_path: a diffusers directory, or None: the
            family's seeded tiny model.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (resolved when a worker starts: it asks torch).
        rollout_dtype, trainer_dtype: each side's transformer dtype. rollout_attention, trainer_attention: each
            side's diffusers attention backend.
        batch_invariant: every forward at a shape that depends on nothing but the sample, on both sides.
        trainer_step_implementation: the trainer's SDE-step code (``"reference"``: the rollout's).
        measures_floor: the profile gates against a floor measured on the trainer (``calibrated``).
        calibration_attention: the trainer's other kernel for the floor (None: the default other one).
        floor_variants: per source of difference the configuration has (besides the kernel), the trainer's
            recompute settings with that source changed (`rollout_consistency.gate.judging.tolerance_model.floor_variants`);
            empty without a floor.
    """

    model_family: str
    model_path: str | None
    device: str
    rollout_dtype: str
    trainer_dtype: str
    rollout_attention: str
    trainer_attention: str
    batch_invariant: bool
    trainer_step_implementation: str
    measures_floor: bool
    calibration_attention: str | None
    floor_variants: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class SampleSettings:
    """What is sampled: the plan's prompts, groups, seeds and windows, and the pipeline's arguments.

    The pipeline's fields carry `CheckConfig`'s names, so `rollout_consistency.gate.sides.backends.pipeline_settings`
    reads either object.

    Attributes:
        prompts: ``num_prompts`` prompt texts (the settings' or the built-in ones, cycled), one per prompt group.
        num_images_per_prompt: rollouts per prompt group. num_samples: ``len(prompts) * num_images_per_prompt``.
        height, width, num_frames, num_inference_steps, max_sequence_length, pad_prompts_to_max_length,
            mask_text_padding: the pipeline's sizes and text handling.
        noise_level, sde_type: the SDE step. sde_window_size: SDE steps per rollout (resolved: ``"all"`` is
            ``num_inference_steps``); sde_window_range, sde_window_kind: where the window lies, how it is drawn.
        guidance_scale, guidance_scale_2, true_cfg_scale, boundary_ratio: guidance and Wan 2.2's experts.
        seed: the launcher's seed. global_step: the training step whose rollout is checked.
    """

    prompts: tuple[str, ...]
    num_images_per_prompt: int
    num_samples: int
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    max_sequence_length: int
    pad_prompts_to_max_length: bool
    mask_text_padding: bool
    noise_level: float
    sde_type: str
    sde_window_size: int
    sde_window_range: tuple[int, int] | None
    sde_window_kind: str
    guidance_scale: float
    guidance_scale_2: float | None
    true_cfg_scale: float
    boundary_ratio: float | None
    seed: int
    global_step: int


@dataclass(frozen=True)
class ExecutionSettings:
    """How the sides run.

    Attributes:
        rollout_backend, trainer_backend: registered backend names or plug-in specs (``"package.module:factory"``).
        step_execution, max_num_seqs, stagger_arrivals: the step-wise rollout and its engine.
        rollout_batch_size: requests per rollout batch. micro_batch_size: the trainer's micro-batch (resolved).
        inject: the stock pitfall reproduced on the rollout side, or None.
        weight_sync: step 2's sync (None: step 1 only); weight_sync_lr, clip_ratio: its update's learning rate and
            PPO clip range.
        user_code_timeout_s: the bound on each call into user code.
    """

    rollout_backend: str
    trainer_backend: str
    step_execution: bool
    max_num_seqs: int
    stagger_arrivals: bool
    rollout_batch_size: int
    micro_batch_size: int
    inject: str | None
    weight_sync: str | None
    weight_sync_lr: float
    clip_ratio: float
    user_code_timeout_s: float


class UserArguments(Protocol):
    """What user code receives from the check, bound by it (`rollout_consistency.gate.config`): the sides hand it
    on without holding it.

    ``registered_factory(factory)``: a registered backend's ``factory(config)``. ``plugin_factory(factory)``: a
    plug-in's ``factory(config=config)``, ``config`` only where its signature takes it. ``rollout_request(make,
    **fields)``: ``make(**fields, config=config)``, a rollout plug-in's `RolloutRequest`.
    """

    def registered_factory(self, factory: Callable[..., T]) -> T: ...

    def plugin_factory(self, factory: Callable[..., T]) -> T: ...

    def rollout_request(self, make: Callable[..., T], /, **fields: Any) -> T: ...


@dataclass(frozen=True)
class SidesSettings:
    """The sides' settings (see the module docstring): `model`, `sampling`, `execution`, `user_code`."""

    model: ModelSettings
    sampling: SampleSettings
    execution: ExecutionSettings
    user_code: UserArguments
