# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Settings of a step-1 check, under the names GRPO trainers already use.

[`CheckConfig`] is a frozen dataclass validated on construction. It loads from a YAML, TOML or JSON file with
flat keys (optionally under a top-level ``check`` table) and a ``thresholds`` table::

    # step1.toml
    model_family = "qwen-image"
    noise_level = 0.7
    sde_type = "sde"
    sde_window_size = 2
    sde_window_range = [0, 4]
    clip_ratio = 1e-4
    profile = "kernel"
    [thresholds]
    ppo_kl = 5e-5

Precedence: defaults < file < explicit overrides (CLI flags), see [`load_config`]. A plug-in named by a file
(``rollout_backend = "my_sides.py:make_rollout"``, also ``trainer_backend`` and ``weight_sync``) is found
relative to the config file's folder; on the command line, relative to the working directory. An unknown key is an
error naming the closest valid key (and the name this checker uses for a trainer-specific alias such as
Flow-GRPO's ``clip_range``). This module imports neither torch nor diffusers: it is cheap to import.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES
from rollout_consistency.base.sampling_rules import SDE_TYPES as SDE_TYPES  # the CLI's choices
from rollout_consistency.base.sampling_rules import sampling_problem
from rollout_consistency.safeguards.fence import DEFAULT_TIMEOUT_S
from rollout_consistency.safeguards.object_spec import call_with_supported_kwargs, spec_file
from rollout_consistency.safeguards.paths import InputPathError, check_input_file

from .backend_registry import backend_names, default_profile, is_plugin_spec, settings_problem
from .bounds import check_bounds
from .judging.metrics import METRIC_NAMES
from .judging.settings import JudgingSettings
from .judging.tolerance_model import floor_variants
from .judging.tolerances import (
    DEFAULT_CALIBRATION_MULTIPLE,
    PROFILES,
    ToleranceError,
    closest_name,
    get_profile,
    metric_name_hint,
    narrowest_dtype,
    resolve_tolerance,
)
from .safe_yaml import SafeYamlError, load_yaml, read_limited

if TYPE_CHECKING:  # the sides' package imports its modules: loaded when a check builds the sides' settings
    from .sides.settings import SidesSettings

T = TypeVar("T")

#: The built-in model families (`rollout_consistency.base.builtin_families`, read without importing the adapters).
MODEL_FAMILIES: tuple[str, ...] = BUILTIN_FAMILIES.names()
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
WINDOW_KINDS: tuple[str, ...] = (
    "fixed",
    "random",
    "progressive",
)  # rollout_consistency.schedulers.sde_window.WINDOW_KINDS

DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")
STEP_IMPLEMENTATIONS: tuple[str, ...] = ("reference", "flow-grpo")  # rollout_consistency.schedulers.flow_grpo_step
#: Built-in step-2 weight syncs (`rollout_consistency.gate.sides.weight_sync`); a "package.module:function" spec also works.
WEIGHT_SYNCS: tuple[str, ...] = ("load_state_dict", "peft")

#: Stock behaviours the check can switch on to show a failing run (`rollout_consistency.adapters.pitfalls.INJECTION_NAMES`), each
#: with the settings (by `CheckConfig` field name) its pitfall needs to show (docs/checker.md). A run with these
#: settings and no injection is the pitfall's *fixed* path.
INJECTION_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    # The stock cast rounds prev_sample to the model dtype: a no-op with float32 weights. Its bias (the
    # trainer scores a point ~ulp/sqrt(12) further from the mean) outgrows the zero-mean part of the
    # difference only with many latent dims or a small SDE std; on the tiny model that takes a 256 px image,
    # noise_level 0.1 and a window on the late steps, where the bf16-latent signature (ratio_mean < 1, all
    # clipping on the lower side) shows as it does on full-size latents.
    "bf16-latents": {
        "rollout_dtype": "bfloat16",
        "trainer_dtype": "bfloat16",
        "height": 256,
        "width": 256,
        "noise_level": 0.1,
        "num_inference_steps": 10,
        "sde_window_range": (5, 10),
    },
    # The step-wise path only, with low-precision weights (same visibility settings as above).
    "stepwise-bf16": {
        "rollout_dtype": "bfloat16",
        "trainer_dtype": "bfloat16",
        "step_execution": True,
        "height": 256,
        "width": 256,
        "noise_level": 0.1,
        "num_inference_steps": 10,
        "sde_window_range": (5, 10),
    },
    # mask.sum() differs from the padded width only when embeddings are padded past the longest prompt, and
    # the wrong RoPE only matters when padded text keys reach attention (no key-padding mask).
    "mask-sum-rope": {"pad_prompts_to_max_length": True, "mask_text_padding": False},
    # Structural: the windows differ within a prompt group; no setting needed.
    "per-request-window": {},
    # Wan 2.2's two experts (tiny: boundary 0.875, as Wan2.2-T2V-A14B); at 6 steps the schedule's timesteps are
    # 1000, 953, 883 | 771, 562, 24: step 3 is the first below the boundary, and every window of the range holds it.
    "expert-switch": {
        "model_family": "wan",
        "boundary_ratio": 0.875,
        "num_inference_steps": 6,
        "sde_window_range": (2, 5),
    },
}
INJECTIONS: tuple[str, ...] = tuple(INJECTION_SETTINGS)

DEFAULT_PROMPTS: tuple[str, ...] = (
    "a red cube on a table",
    "a photograph of an astronaut riding a horse on the moon at dusk, high detail",
    "cat",
    "two wooden chairs in an empty sunlit room with a large window",
)

#: Names other trainers use for a setting, pointing at this checker's name.
ALIASES: dict[str, str] = {
    "clip_range": "clip_ratio",
    "num_steps": "num_inference_steps",
    "eta": "noise_level",
    "num_image_per_prompt": "num_images_per_prompt",
    "rollout_n": "num_images_per_prompt",
    "n": "num_images_per_prompt",
    "cfg_scale": "guidance_scale",
    "batch_size": "rollout_batch_size",
    "train_batch_size": "micro_batch_size",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size",
    "window_size": "sde_window_size",
    "window_range": "sde_window_range",
    "attn_backend": "trainer_attention",
    "rollout_attn_backend": "rollout_attention",
}


class ConfigError(ValueError):
    """A bad setting: unknown key, wrong type or out-of-range value. The message names the fix."""


#: What a setting's value may be (`Setting.kind`), each with its one coercion (`_coerce`) and command-line type.
KINDS: tuple[str, ...] = ("int", "float", "bool", "str", "window_size", "window_range", "prompts", "thresholds")

_I64 = 2**63 - 1


@dataclass(frozen=True)
class Setting:
    """The facts of one `CheckConfig` field, in one place: the field's coercion, its checks, `BOUNDS`, the
    command line's flag, type, choices and help are generated from them (`SETTINGS`).

    Attributes:
        kind: one of `KINDS` (``"int"`` refuses a bool or a float; ``"float"`` also takes YAML's ``1e-4`` string).
        help: the command line's one-line help (its default is appended there).
        optional: ``None`` is a value (the default, mostly: "derive it").
        choices: the accepted names, also the command line's choices (unless `spec`: then any
            ``"package.module:function"`` too, and the command line lists none).
        choices_checked: False where another rule checks the choices (``sde_type``: the sampling rules).
        more_choices: names registered in this process that are accepted beside `choices` (model families).
        registry: ``"rollout"`` / ``"trainer"``: the names are the backend registry's for that side.
        spec: the user's code may be named (``"package.module:function"`` or ``"file.py:function"``).
        minimum: the value must be ``>= minimum`` (``sde_window_size``: the resolved number of steps).
        positive: the value must be ``> 0``.
        bounds: inclusive ``(lowest, highest)``: far above any real run, far below what overflows or exhausts
            memory; docs/checker.md lists them.
        flag, metavar: the command line's flag (default ``--name-with-dashes``) and metavar.
    """

    kind: str
    help: str
    optional: bool = False
    choices: Collection[str] = ()
    choices_checked: bool = True
    more_choices: Callable[[str], tuple[str, ...]] | None = None
    registry: str | None = None
    spec: bool = False
    minimum: float | None = None
    positive: bool = False
    bounds: tuple[float, float] | None = None
    flag: str | None = None
    metavar: str | tuple[str, ...] | None = None


def _setting(default: Any, kind: str, help: str, **facts: Any) -> Any:
    """A `CheckConfig` field with its `Setting` (a callable `default`, such as ``dict``, is a default factory)."""
    metadata = {"setting": Setting(kind, help, **facts)}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _registered_families(name: str) -> tuple[str, ...]:
    """The families registered in this process (only this lookup imports the adapters, and torch)."""
    from rollout_consistency.adapters.families import family_names

    return family_names()


@dataclass(frozen=True)
class CheckConfig:
    """Everything a step-1 check needs. Field names follow Flow-GRPO / verl / vLLM-omni.

    Model and engines:
        model_family: ``"qwen-image"``, ``"sd3"``, ``"flux"``, ``"wan"``, or a family registered in this process with
            `rollout_consistency.adapters.register_family`.
        model_path: a diffusers pipeline directory; ``None`` builds the family's tiny offline model.
        rollout_backend: a registered backend (`rollout_consistency.gate.backend_registry`: ``"torch"``, the
            diffusers adapters; ``"vllm-omni"``) or a plug-in ``"package.module:factory"``
            (`rollout_consistency.gate.sides.plugins`).
        trainer_backend: a registered backend (``"torch"``, the PyTorch training adapter) or a plug-in
            ``"package.module:factory"``.
        step_execution: rollout in step-wise (continuous batching) mode instead of request-level.
        max_num_seqs: requests the step-wise engine runs together.
        stagger_arrivals: step-wise: admit the batch's requests two per engine step (true continuous batching:
            one forward holds requests at different steps) instead of all at the first step.
        rollout_attention / trainer_attention: diffusers attention backend of each side (``"native"`` is
            PyTorch SDPA; ``"_native_math"`` its math kernel).
        calibration_attention: the *other* kernel the trainer runs against itself for ``calibrated``
            (default: ``_native_math`` for a ``native`` trainer and vice versa).
        rollout_dtype / trainer_dtype: the transformer's compute dtype on each side (latents stay float32).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        batch_invariant: both sides (rollout, step-wise, trainer) run every transformer forward at a shape that
            depends on nothing but the sample (`rollout_consistency.adapters.batch_invariance`): forwards padded
            to ``rollout_batch_size`` rows where run-time probes find this machine's kernels position-invariant,
            one sample per forward otherwise. A sample's log-probs are then bit identical whatever its
            batch-mates, batch or micro-batch size, position or arrival pattern (same machine), so ``exact``
            holds across batch compositions.

    Sampling (one training step's rollouts):
        prompts: prompt texts; ``num_prompts`` of them are used (cycled). Empty: built-in prompts.
        num_prompts, num_images_per_prompt: prompt groups and rollouts per group (GRPO's ``n``).
        height, width, num_inference_steps: image size and schedule length.
        num_frames: video frames (Wan; ``num_frames - 1`` a multiple of 4).
        max_sequence_length, pad_prompts_to_max_length: text length; pad every prompt to it (as engines
            with a shared text width do) instead of to the batch's longest prompt.
        mask_text_padding: pass the text mask to attention (Qwen-Image; ``False`` = padded text keys are
            attended, as in a kernel without a key-padding mask).
        noise_level, sde_type: the SDE step (docs/scheduler.md).
        sde_window_size, sde_window_range, sde_window_kind: which steps are stochastic; the window of a
            prompt group is drawn from (seed, global_step, prompt group) only. ``sde_window_size="all"``: every
            step is an SDE step (Flow-GRPO samples that way); `resolved_window_size` is then num_inference_steps.
        guidance_scale, true_cfg_scale: FLUX/SD3/Wan guidance and Qwen-Image's true CFG (1 = off).
        guidance_scale_2: Wan 2.2's CFG scale for the low-noise expert (``None``: ``guidance_scale``).
        boundary_ratio: Wan 2.2's expert switch (``transformer`` for timesteps >= boundary_ratio · 1000,
            ``transformer_2`` below); ``None``: the model directory's own, and one expert for the tiny model.
        seed: the launcher's seed; global_step: the training step whose rollout is checked.

    Batching and gate:
        rollout_batch_size: requests per rollout batch; micro_batch_size: the trainer's micro-batch (must
            divide rollout_batch_size unless batch_invariant; ``None`` = rollout_batch_size).
        clip_ratio (+ optional clip_ratio_low / clip_ratio_high): the PPO clip range.
        profile: ``"exact"``, ``"kernel"`` or ``"calibrated"``; ``None`` picks ``exact`` for the torch
            rollout and ``kernel`` for vLLM-omni.
        thresholds: per-metric overrides (``None`` value: report, don't gate).
        calibration_multiple: the ``calibrated`` gate, in multiples of the measured floor.
        trainer_step_implementation: the trainer's SDE-step code: ``"reference"`` (the rollout's) or
            ``"flow-grpo"`` (the same maths in Flow-GRPO's operation order; docs/checker.md).

    Run:
        inject: a stock pitfall to reproduce (see `INJECTIONS`). trajectory: check this saved trajectory
        file instead of sampling. workers / ray_address: Ray distribution; ray_timeout_s: seconds to reach
        the cluster at ray_address before failing (exit 2). user_code_timeout_s: bound on each call into
        user code — a plug-in's or a registered backend's import and factory, its calls, a weight-sync function
        (`rollout_consistency.safeguards.fence`).
        progress: show a progress bar.
        weight_sync: also run the step-2 check (`rollout_consistency.gate.weight_sync_check`): one optimizer update on
        the trainer, this sync to the rollout (``"load_state_dict"``, ``"peft"`` or ``"package.module:function"``),
        then the check again; ``None`` = step 1 only. weight_sync_lr: the update's Adam learning rate.

    Each field's facts (kind, choices, minimum, bound, the command line's help and flag) are written once, in its
    `Setting` (`SETTINGS`): the coercion, the checks, `BOUNDS` (every numeric setting has a documented bound) and
    the flags of ``rollout-consistency check`` are generated from them.
    """

    model_family: str = _setting(
        "qwen-image", "str", "model family", choices=MODEL_FAMILIES, more_choices=_registered_families
    )
    model_path: str | None = _setting(
        None, "str", "diffusers model directory (default: the built-in tiny model, offline)", optional=True
    )
    rollout_backend: str = _setting("torch", "str", "rollout engine", registry="rollout", spec=True)
    trainer_backend: str = _setting("torch", "str", "trainer engine", registry="trainer", spec=True)
    step_execution: bool = _setting(False, "bool", "step-wise (continuous batching) rollout instead of request-level")
    max_num_seqs: int = _setting(4, "int", "requests the step-wise engine runs together", minimum=1, bounds=(1, 4096))
    stagger_arrivals: bool = _setting(
        False, "bool", "step-wise: admit requests two per engine step (forwards mix requests at different steps)"
    )
    rollout_attention: str = _setting(
        "native",
        "str",
        "diffusers attention backend of the rollout (native = PyTorch SDPA, _native_math = math kernel)",
    )
    trainer_attention: str = _setting("native", "str", "diffusers attention backend of the trainer")
    calibration_attention: str | None = _setting(
        None,
        "str",
        "the trainer's other kernel for --profile calibrated (default: the other of native/_native_math)",
        optional=True,
    )
    rollout_dtype: str = _setting(
        "float32", "str", "transformer dtype of the rollout (latents stay float32)", choices=DTYPES
    )
    trainer_dtype: str = _setting("float32", "str", "transformer dtype of the trainer", choices=DTYPES)
    device: str = _setting("cpu", "str", "cpu, cuda or auto", choices=DEVICES)
    batch_invariant: bool = _setting(
        False,
        "bool",
        "run every forward at a shape that depends on nothing but the sample, on both sides (padded to "
        "rollout_batch_size rows where this machine's kernels allow, else one sample per forward): bit-identical per "
        "sample whatever its batch-mates or micro-batch (exact across batch compositions)",
    )

    prompts: tuple[str, ...] = _setting(
        (), "prompts", "prompt text (repeatable; default: built-in prompts)", flag="--prompt", metavar="TEXT"
    )
    num_prompts: int = _setting(4, "int", "prompt groups to sample", minimum=1, bounds=(1, 65536))
    num_images_per_prompt: int = _setting(2, "int", "rollouts per prompt group (GRPO's n)", minimum=1, bounds=(1, 1024))
    height: int = _setting(32, "int", "image height in pixels", minimum=1, bounds=(1, 8192))
    width: int = _setting(32, "int", "image width in pixels", minimum=1, bounds=(1, 8192))
    num_frames: int = _setting(
        13, "int", "video frames (Wan; num_frames - 1 a multiple of 4)", minimum=1, bounds=(1, 1024)
    )
    num_inference_steps: int = _setting(6, "int", "denoising steps", minimum=1, bounds=(1, 10000))
    max_sequence_length: int = _setting(32, "int", "text length (tokens)", minimum=1, bounds=(1, 65536))
    pad_prompts_to_max_length: bool = _setting(
        False, "bool", "pad every prompt to max_sequence_length instead of the batch's longest"
    )
    mask_text_padding: bool = _setting(True, "bool", "pass the text mask to attention (Qwen-Image)")
    # noise_level > 0 and the SDE types are the sampling rules' (rollout_consistency.base.sampling_rules)
    noise_level: float = _setting(0.7, "float", "SDE noise level", bounds=(0.0, 100.0))
    sde_type: str = _setting("sde", "str", "SDE step", choices=SDE_TYPES, choices_checked=False)
    sde_window_size: int | str = _setting(
        2,
        "window_size",
        "stochastic (log-prob carrying) steps per rollout, or 'all': every step (Flow-GRPO samples with the SDE on "
        "every step)",
        minimum=1,
        bounds=(1, 10000),
    )
    sde_window_range: tuple[int, int] | None = _setting(
        None,
        "window_range",
        "half-open step range [LOW, HIGH) the window lies in",
        optional=True,
        metavar=("LOW", "HIGH"),
    )
    sde_window_kind: str = _setting("random", "str", "how the window is drawn per prompt group", choices=WINDOW_KINDS)
    guidance_scale: float = _setting(
        1.0, "float", "guidance (FLUX embedded guidance / SD3 and Wan CFG)", bounds=(0.0, 1000.0)
    )
    guidance_scale_2: float | None = _setting(
        None,
        "float",
        "Wan 2.2: CFG scale of the low-noise expert (default: --guidance-scale)",
        optional=True,
        bounds=(0.0, 1000.0),
    )
    true_cfg_scale: float = _setting(1.0, "float", "Qwen-Image true CFG scale (1 = off)", bounds=(0.0, 1000.0))
    boundary_ratio: float | None = _setting(
        None,
        "float",
        "Wan 2.2: the expert switch (transformer for timesteps >= ratio * 1000, transformer_2 below); default: the "
        "model directory's, one expert for the tiny model",
        optional=True,
        bounds=(0.0, 1.0),
    )
    # Packed as a signed 64-bit integer when sample seeds are derived.
    seed: int = _setting(42, "int", "launcher seed (every draw derives from it)", bounds=(-(2**63), _I64))
    global_step: int = _setting(0, "int", "training step whose rollout is checked", minimum=0, bounds=(0, _I64))

    rollout_batch_size: int = _setting(
        4, "int", "requests per rollout batch (the unit of work of a worker)", minimum=1, bounds=(1, 65536)
    )
    micro_batch_size: int | None = _setting(
        None,
        "int",
        "trainer micro-batch (must divide --rollout-batch-size; default: the rollout batch)",
        optional=True,
        minimum=1,
        bounds=(1, 65536),
    )
    clip_ratio: float = _setting(1e-4, "float", "PPO clip range epsilon", positive=True, bounds=(0.0, 100.0))
    clip_ratio_low: float | None = _setting(
        None, "float", "lower clip range (default: --clip-ratio)", optional=True, positive=True, bounds=(0.0, 100.0)
    )
    clip_ratio_high: float | None = _setting(
        None, "float", "upper clip range (default: --clip-ratio)", optional=True, positive=True, bounds=(0.0, 100.0)
    )
    profile: str | None = _setting(
        None,
        "str",
        "tolerance profile (default: exact for the torch rollout, kernel for vllm-omni)",
        optional=True,
        choices=PROFILES,
    )
    thresholds: Mapping[str, float | None] = _setting(
        dict,
        "thresholds",
        "override one metric's limit (repeatable; VALUE 'off' reports without gating)",
        flag="--threshold",
        metavar="METRIC=VALUE",
    )
    calibration_multiple: float = _setting(
        DEFAULT_CALIBRATION_MULTIPLE,
        "float",
        "calibrated gate, in multiples of the measured floor",
        minimum=1,
        bounds=(1.0, 1e9),
    )
    trainer_step_implementation: str = _setting(
        "reference",
        "str",
        "the trainer's SDE-step code (flow-grpo: same maths, other operation order)",
        choices=STEP_IMPLEMENTATIONS,
    )

    inject: str | None = _setting(
        None,
        "str",
        "reproduce a stock pitfall to see what a failing run looks like",
        optional=True,
        choices=INJECTIONS,
    )
    trajectory: str | None = _setting(
        None, "str", "check this saved trajectory file against the trainer instead of sampling", optional=True
    )
    weight_sync: str | None = _setting(
        None,
        "str",
        "also check step 2: one optimizer update, this sync to the rollout (load_state_dict, peft or "
        "'package.module:function'), check again",
        optional=True,
        choices=WEIGHT_SYNCS,
        spec=True,
    )
    weight_sync_lr: float = _setting(
        1e-3, "float", "Adam learning rate of the step-2 update", positive=True, bounds=(0.0, 1000.0)
    )
    workers: int = _setting(
        1,
        "int",
        "Ray workers (more than 1 starts a local Ray cluster unless --ray-address is given)",
        minimum=1,
        bounds=(1, 1024),
    )
    ray_address: str | None = _setting(None, "str", "join this Ray cluster ('auto', 'ray://host:10001')", optional=True)
    ray_timeout_s: float = _setting(
        30.0, "float", "seconds to reach --ray-address before giving up (exit 2)", bounds=(0.1, 3600.0)
    )
    user_code_timeout_s: float = _setting(
        DEFAULT_TIMEOUT_S,
        "float",
        "seconds each call into your code (plug-in import, factory, rollout, recompute_log_probs, weight sync) may "
        "take before the check stops with exit 2",
        bounds=(0.1, 86400.0),
    )
    progress: bool = _setting(True, "bool", "progress bar on stderr")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        _validate(self)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def judging(self) -> JudgingSettings:
        """What the judgement reads (`rollout_consistency.gate.judging.settings`): how the sides differ, how the
        figures are gated."""
        return JudgingSettings(
            rollout_backend=self.rollout_backend,
            trainer_backend=self.trainer_backend,
            rollout_attention=self.rollout_attention,
            trainer_attention=self.trainer_attention,
            rollout_dtype=self.rollout_dtype,
            trainer_dtype=self.trainer_dtype,
            rollout_from_file=self.trajectory is not None,
            batch_invariant=self.batch_invariant,
            step_execution=self.step_execution,
            max_num_seqs=self.max_num_seqs,
            rollout_batch_size=self.rollout_batch_size,
            micro_batch_size=self.resolved_micro_batch_size,
            trainer_step_implementation=self.trainer_step_implementation,
            profile=self.resolved_profile,
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            calibration_multiple=self.calibration_multiple,
            compute_dtype=self.compute_dtype,
            thresholds=dict(self.thresholds),
        )

    @property
    def sides(self) -> SidesSettings:
        """What the sides read (`rollout_consistency.gate.sides.settings`): the model and how each side computes,
        what is sampled, how it runs, every value resolved here; user code still receives this `CheckConfig`
        (`ConfigArguments`)."""
        from .sides.settings import ExecutionSettings, ModelSettings, SampleSettings, SidesSettings

        judging = self.judging
        measures_floor = get_profile(judging.profile).needs_floor
        model = ModelSettings(
            model_family=self.model_family,
            model_path=self.model_path,
            device=self.device,
            rollout_dtype=self.rollout_dtype,
            trainer_dtype=self.trainer_dtype,
            rollout_attention=self.rollout_attention,
            trainer_attention=self.trainer_attention,
            batch_invariant=self.batch_invariant,
            trainer_step_implementation=self.trainer_step_implementation,
            measures_floor=measures_floor,
            calibration_attention=self.calibration_attention,
            floor_variants=floor_variants(judging, None) if measures_floor else {},
        )
        sampling = SampleSettings(
            prompts=self.resolved_prompts,
            num_images_per_prompt=self.num_images_per_prompt,
            num_samples=self.num_samples,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            num_inference_steps=self.num_inference_steps,
            max_sequence_length=self.max_sequence_length,
            pad_prompts_to_max_length=self.pad_prompts_to_max_length,
            mask_text_padding=self.mask_text_padding,
            noise_level=self.noise_level,
            sde_type=self.sde_type,
            sde_window_size=self.resolved_window_size,
            sde_window_range=self.sde_window_range,
            sde_window_kind=self.sde_window_kind,
            guidance_scale=self.guidance_scale,
            guidance_scale_2=self.guidance_scale_2,
            true_cfg_scale=self.true_cfg_scale,
            boundary_ratio=self.boundary_ratio,
            seed=self.seed,
            global_step=self.global_step,
        )
        execution = ExecutionSettings(
            rollout_backend=self.rollout_backend,
            trainer_backend=self.trainer_backend,
            step_execution=self.step_execution,
            max_num_seqs=self.max_num_seqs,
            stagger_arrivals=self.stagger_arrivals,
            rollout_batch_size=self.rollout_batch_size,
            micro_batch_size=judging.micro_batch_size,
            inject=self.inject,
            weight_sync=self.weight_sync,
            weight_sync_lr=self.weight_sync_lr,
            clip_ratio=self.clip_ratio,
            user_code_timeout_s=self.user_code_timeout_s,
        )
        return SidesSettings(model, sampling, execution, ConfigArguments(self))

    @property
    def resolved_profile(self) -> str:
        if self.profile is not None:
            return self.profile
        return default_profile(self.rollout_backend)

    @property
    def compute_dtype(self) -> str:
        """The narrowest dtype either side computes in (the ``kernel`` profile's limits scale with it)."""
        return narrowest_dtype(self.rollout_dtype, self.trainer_dtype)

    @property
    def resolved_window_size(self) -> int:
        """SDE steps per rollout: `sde_window_size`, or every step for ``"all"``."""
        return self.num_inference_steps if self.sde_window_size == "all" else int(self.sde_window_size)

    @property
    def resolved_micro_batch_size(self) -> int:
        return self.rollout_batch_size if self.micro_batch_size is None else self.micro_batch_size

    @property
    def resolved_prompts(self) -> tuple[str, ...]:
        """`num_prompts` prompt texts: `prompts` (or the built-in ones) cycled."""
        source = self.prompts or DEFAULT_PROMPTS
        return tuple(source[i % len(source)] for i in range(self.num_prompts))

    @property
    def num_samples(self) -> int:
        return self.num_prompts * self.num_images_per_prompt

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples become lists)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    def replace(self, **overrides: Any) -> CheckConfig:
        """A copy with `overrides` applied (validated; unknown names raise [`ConfigError`])."""
        _reject_unknown(overrides, "override")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config") -> CheckConfig:
        """Build from a flat mapping (or one with a top-level ``check`` table), as read from YAML/TOML/JSON."""
        return cls(**_flatten(data, source))


@dataclass(frozen=True)
class ConfigArguments:
    """The `CheckConfig` as user code receives it, bound by the check: the sides' `UserArguments`
    (`rollout_consistency.gate.sides.settings`), so that the sides call user code with it and never read it.
    Picklable: a Ray actor receives it with the rest of the sides' settings."""

    config: CheckConfig

    def registered_factory(self, factory: Callable[..., T]) -> T:
        """A registered backend's ``factory(config)`` (`rollout_consistency.gate.backend_registry`)."""
        return factory(self.config)

    def plugin_factory(self, factory: Callable[..., T]) -> T:
        """A plug-in's ``factory(config=config)``, ``config`` only where its signature takes it
        (`rollout_consistency.safeguards.object_spec.call_with_supported_kwargs`)."""
        return call_with_supported_kwargs(factory, optional={"config": self.config})

    def rollout_request(self, make: Callable[..., T], /, **fields: Any) -> T:
        """``make(**fields, config=config)``: a rollout plug-in's `rollout_consistency.gate.plugin_request.RolloutRequest`."""
        return make(**fields, config=self.config)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CheckConfig))


def settings_of(cls: type) -> dict[str, Setting]:
    """Field name -> `Setting` of a dataclass of settings; a field without one is a TypeError (on import, for
    `CheckConfig`: no setting without its facts)."""
    found = {}
    for f in dataclasses.fields(cls):
        setting = f.metadata.get("setting")
        if not isinstance(setting, Setting) or setting.kind not in KINDS:
            raise TypeError(f"{cls.__name__}.{f.name} has no Setting: declare it with _setting(default, kind, help).")
        found[f.name] = setting
    return found


#: Every setting's facts, by field name (the one place they are written: the field's `Setting`).
SETTINGS: Mapping[str, Setting] = settings_of(CheckConfig)
#: setting -> (lowest, highest), inclusive: every numeric setting's documented bound (docs/checker.md).
BOUNDS: Mapping[str, tuple[float, float]] = {name: s.bounds for name, s in SETTINGS.items() if s.bounds is not None}
#: The integer settings (``micro_batch_size`` included: it may be None).
INT_FIELDS: tuple[str, ...] = tuple(name for name, s in SETTINGS.items() if s.kind == "int")
#: Settings that may name the user's code as ``path/to/file.py:function`` (`rollout_consistency.safeguards.object_spec`).
SPEC_FIELDS: tuple[str, ...] = tuple(name for name, s in SETTINGS.items() if s.spec)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file, validated for unknown keys.

    Raises:
        ConfigError: missing file, unsupported extension, a syntax error (with the parser's message) or an
            unknown key.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory; name the .yaml, .toml or .json file inside it.")
    try:
        check_input_file(path, "config file")  # a FIFO or a device would block or never end
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path!r} does not exist.") from error
    except InputPathError as error:
        raise ConfigError(str(error)) from error
    extension = os.path.splitext(path)[1].lower()
    try:
        if extension in (".yaml", ".yml"):
            data = load_yaml(read_limited(path), path)
        elif extension == ".toml":
            data = _load_toml(path)
        elif extension == ".json":
            data = json.loads(read_limited(path).decode("utf-8"), object_pairs_hook=_unique_keys(path))
        else:
            raise ConfigError(
                f"config file {path!r}: use a .yaml, .yml, .toml or .json file (got {extension or 'no extension'!r})."
            )
    except ConfigError:
        raise
    except SafeYamlError as error:
        raise ConfigError(str(error)) from error
    except OSError as error:
        raise ConfigError(
            f"config file {path!r} cannot be read ({error.strerror or error}); check its permissions."
        ) from error
    except Exception as error:  # yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError
        raise ConfigError(f"config file {path!r} could not be parsed: {error}") from error
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path!r} must hold a mapping of settings, got {type(data).__name__}.")
    return _resolve_spec_files(_flatten(data, path), path)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> CheckConfig:
    """Defaults, then the file at `path` (if any), then `overrides` (e.g. the CLI flags that were given)."""
    settings = read_config_file(path) if path is not None else {}
    _reject_unknown(overrides, "override")
    if "thresholds" in overrides and "thresholds" in settings:
        # Per-metric merge: a flag `--threshold ppo_kl=...` does not drop the file's other thresholds.
        overrides = {**overrides, "thresholds": {**dict(settings["thresholds"]), **dict(overrides["thresholds"])}}
    settings.update(overrides)
    try:
        return CheckConfig(**settings)
    except TypeError as error:  # pragma: no cover - _flatten rejects unknown keys first
        raise ConfigError(str(error)) from error


# ----------------------------------------------------------------------------------------------------
def _load_toml(path: str) -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError as error:
            raise ConfigError(
                "reading TOML on Python 3.10 needs the `tomli` package (`pip install tomli`), or use a YAML file."
            ) from error
    # tomllib refuses duplicate keys itself; the size limit is ours.
    return tomllib.loads(read_limited(path).decode("utf-8"))


def _unique_keys(path: str) -> Any:
    """A `json.loads` hook refusing a key given twice (JSON keeps the last silently; TOML and our YAML refuse)."""

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"config file {path!r}: {key!r} is given twice; keep one.")
            seen[key] = value
        return seen

    return build


def _flatten(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    data = dict(data)
    if "check" in data and isinstance(data["check"], Mapping):
        nested = dict(data.pop("check"))
        clash = sorted(set(nested) & set(data))
        if clash:
            raise ConfigError(f"{source}: {', '.join(clash)} set both at the top level and under `check`.")
        data.update(nested)
    _reject_unknown(data, source)
    return data


def _resolve_spec_files(data: dict[str, Any], path: str) -> dict[str, Any]:
    """A relative ``file.py:function`` in a config file names a file beside the config file, wherever the command
    runs from (a CI job's working directory is rarely the config's folder): rewritten to the absolute path, and
    a file that is not there is an error naming the path tried and the folder it was relative to."""
    folder = os.path.dirname(os.path.abspath(path))
    for key in SPEC_FIELDS:
        value = data.get(key)
        file = spec_file(value) if isinstance(value, str) else None
        if file is None or os.path.isabs(file):
            continue
        resolved = os.path.normpath(os.path.join(folder, file))
        if not os.path.isfile(resolved):
            in_cwd = os.path.isfile(file) and os.path.abspath(file) != resolved
            hint = f"; {file} is in the working directory: write its path relative to {folder}" if in_cwd else ""
            raise ConfigError(
                f"config file {path!r}: {key} {value!r}: {resolved} does not exist (a relative path in a config "
                f"file is relative to the config file's folder, {folder}){hint}."
            )
        data[key] = resolved + value[len(file) :]
    return data


def _reject_unknown(data: Mapping[str, Any], source: str) -> None:
    for key in data:
        if key in FIELD_NAMES:
            continue
        normalised = str(key).replace("-", "_").lower()
        if normalised in FIELD_NAMES:
            hint = f" Did you mean {normalised!r}? (settings use underscores)"
        elif normalised in ALIASES:
            hint = f" This checker calls that setting {ALIASES[normalised]!r}."
        else:
            hint = closest_name(normalised, FIELD_NAMES) or " Valid keys are listed in docs/checker.md."
        raise ConfigError(f"{source}: unknown setting {key!r}.{hint}")


def _coerce(name: str, value: Any) -> Any:
    """Normalise what YAML/TOML/argparse give (lists, ints for floats) and reject wrong types, by the setting's
    `Setting.kind`."""
    setting = SETTINGS[name]
    if value is None:
        if setting.optional:
            return None
        raise ConfigError(f"setting {name!r} cannot be empty.")
    kind = setting.kind
    if kind == "window_size":
        if value == "all":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"setting {name!r} must be an integer or 'all' (every step), got {value!r}.")
        return int(value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"setting {name!r} must be an integer, got {value!r}.")
        return int(value)
    if kind == "float":
        value = _yaml_float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"setting {name!r} must be a finite number, got {value!r}.")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"setting {name!r} must be true or false, got {value!r}.")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"setting {name!r} must be a non-empty string, got {value!r}.")
        return value
    if kind == "prompts":
        if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
            raise ConfigError(f"setting {name!r} must be a list of non-empty strings, got {value!r}.")
        return tuple(value)
    if kind == "window_range":
        if (
            isinstance(value, str)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise ConfigError(f"setting {name!r} must be two integers [low, high), got {value!r}.")
        return (int(value[0]), int(value[1]))
    if kind == "thresholds":
        if not isinstance(value, Mapping):
            raise ConfigError(f"setting {name!r} must map metric names to limits, got {value!r}.")
        # `off`/`none`/null disable a gate (YAML 1.1 reads a bare `off` as false).
        return {
            str(k): None if (v is None or v is False or str(v).lower() in ("none", "off")) else _yaml_float(v)
            for k, v in value.items()
        }
    raise AssertionError(f"setting {name}: unknown kind {kind!r}")  # pragma: no cover - test_config checks kinds


def _yaml_float(value: Any) -> Any:
    """PyYAML reads `1e-4` (no dot) as a string; accept any string that is a plain float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"setting {name!r} is {value!r}; expected one of {', '.join(choices)}.{closest_name(value, choices)}"
        )


def _check_choices(config: CheckConfig) -> None:
    """Each setting with choices holds one of them (a registered name, or the user's code where allowed)."""
    for name, setting in SETTINGS.items():
        value = getattr(config, name)
        if value is None or not setting.choices_checked or (setting.spec and is_plugin_spec(value)):
            continue
        if setting.registry is not None:
            _choice(name, value, backend_names(setting.registry))
        elif setting.choices:
            more = setting.more_choices is not None and value not in setting.choices
            _choice(name, value, setting.more_choices(value) if more else setting.choices)


def _check_limits(config: CheckConfig) -> None:
    """Each setting's `Setting.minimum`, `Setting.positive` and `Setting.bounds` (then the totals)."""
    for name, setting in SETTINGS.items():
        value = config.resolved_window_size if setting.kind == "window_size" else getattr(config, name)
        if value is None:
            continue
        if setting.minimum is not None and value < setting.minimum:
            raise ConfigError(f"setting {name!r} must be >= {setting.minimum:g}, got {value}.")
        if setting.positive and not value > 0:
            raise ConfigError(f"setting {name!r} must be > 0, got {value}.")


def _validate(config: CheckConfig) -> None:
    _check_choices(config)
    problem = sampling_problem(config.noise_level, config.sde_type, config.guidance_scale)  # the adapters' rules
    if problem:
        raise ConfigError(f"setting {problem}")
    _check_limits(config)
    if config.resolved_window_size > config.num_inference_steps:
        raise ConfigError(
            f"sde_window_size {config.sde_window_size} exceeds num_inference_steps {config.num_inference_steps}; "
            f"sde_window_size 'all' makes every step an SDE step."
        )
    if config.sde_window_range is not None:
        low, high = config.sde_window_range
        if not (0 <= low < high <= config.num_inference_steps) or config.resolved_window_size > high - low:
            raise ConfigError(
                f"sde_window_range {list(config.sde_window_range)} must satisfy 0 <= low < high <= "
                f"num_inference_steps ({config.num_inference_steps}) and hold sde_window_size "
                f"({config.sde_window_size}) steps."
            )
    if config.weight_sync is not None and (config.trajectory is not None or config.step_execution):
        raise ConfigError(
            "weight_sync runs a request-level rollout before and after an update: it cannot be combined with "
            "trajectory or step_execution."
        )
    mbs = config.micro_batch_size
    # In batch-invariant mode a row's bits do not depend on its micro-batch, so any size is fine; otherwise
    # equal micro-batches keep the per-cell figures comparable from one batch to the next.
    if mbs is not None and not config.batch_invariant and config.rollout_batch_size % mbs:
        raise ConfigError(
            f"micro_batch_size {mbs} must divide rollout_batch_size {config.rollout_batch_size} (or use "
            f"--batch-invariant, where any micro-batch gives the same bits)."
        )
    try:
        resolve_tolerance("exact", config.thresholds)
    except ToleranceError as error:
        raise ConfigError(str(error)) from error
    problem = settings_problem(config)  # the backends' own rules
    if problem:
        raise ConfigError(problem)
    if config.trajectory is not None and (config.inject is not None or config.step_execution):
        raise ConfigError(
            "trajectory mode checks a saved trajectory: --inject and step_execution apply to sampling and "
            "cannot be combined with it."
        )
    if config.ray_address is not None:
        ray_host_port(config.ray_address)  # malformed: refused here, whether or not Ray is installed
    check_bounds({name: getattr(config, name) for name in FIELD_NAMES}, BOUNDS, ConfigError)


#: Ray's default ports: the client server (``ray://host``) and the GCS (``host``).
RAY_CLIENT_PORT, RAY_GCS_PORT = 10001, 6379


def ray_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address (``ray://host[:port]``, ``host[:port]``), None for ``auto``/``local``.

    Raises:
        ConfigError: an address that is neither, naming the accepted forms.
    """
    if address in ("auto", "local"):
        return None
    rest = address
    default_port = RAY_GCS_PORT
    if "://" in address:
        scheme, rest = address.split("://", 1)
        if scheme != "ray":
            raise ConfigError(f"--ray-address {address!r}: use 'auto', 'host:port' or 'ray://host:port'.")
        default_port = RAY_CLIENT_PORT
    host, sep, port_text = rest.rpartition(":")
    if not sep:
        host, port_text = rest, str(default_port)
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--ray-address {address!r}: use 'auto', 'host:port' or 'ray://host:port'.")
    return host, int(port_text)


def parse_thresholds(pairs: list[str]) -> dict[str, float | None]:
    """``["ppo_kl=5e-5", "ratio_std=off"]`` (the CLI's ``--threshold`` values) -> per-metric limits (None: off).

    Raises:
        ConfigError: a pair without ``=``, an unknown metric (with the closest name), or a value that is not a
            number or ``off``.
    """
    out: dict[str, float | None] = {}
    for pair in pairs:
        metric, sep, text = pair.partition("=")
        if not sep:
            raise ConfigError(f"--threshold expects METRIC=VALUE, got {pair!r} (e.g. --threshold ppo_kl=5e-5).")
        if metric not in METRIC_NAMES:
            raise ConfigError(
                f"--threshold: unknown metric {metric!r}; expected one of {', '.join(METRIC_NAMES)}."
                f"{metric_name_hint(metric)}"
            )
        if text.strip().lower() in ("off", "none"):
            out[metric] = None
            continue
        try:
            out[metric] = float(text)
        except ValueError as error:
            raise ConfigError(f"--threshold {pair!r}: {text!r} is not a number (or 'off').") from error
    return out
