# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The two halves the check compares, as a worker holds them: rollout engine and PyTorch trainer.

[`build_backend`] (a worker's setup) loads the model once per side — identical weights: the same seeded
tiny model, or the same checkpoint — and [`run_batch`] (a worker's work) does one rollout batch:

1. the rollout backend samples the batch (``torch``: the diffusers adapters, request-level or step-wise,
   `torch_rollout`; ``vllm-omni``: `rollout_consistency.adapters.vllm_omni`, `vllm_omni_rollout`) into a
   float32 trajectory;
2. the trainer recomputes every stored window step, micro-batch by micro-batch, with its own attention
   kernel and dtype (the PyTorch training adapter, `rollout_consistency.adapters.recompute_log_probs`;
   `trainer.score_trajectory`);
3. for the ``calibrated`` profile it recomputes once more with the other attention kernel (the floor).

Each side is the backend its setting names: a registered one (`rollout_consistency.gate.backend_registry`:
`build_backend` calls its factory once per worker, nothing here names a backend), or a user's plug-in
(`plugins`), which `build_backend` loads and `run_batch` hands the batch to.

Both are plain functions of picklable arguments, so the in-process path and a Ray actor run the very same
code. Nothing here reads the environment or a global RNG: every draw comes from the per-sample seeds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_consistency.gate.backend_registry import get_backend, is_plugin_spec
from rollout_consistency.gate.config import ConfigError
from rollout_consistency.gate.judging.verdict import plan_window_problems
from rollout_consistency.safeguards.fence import fenced
from rollout_consistency.safeguards.object_spec import SpecError, load_object

from . import plugins
from .plan import BatchSpec
from .settings import ModelSettings, SampleSettings, SidesSettings
from .shared import Backend, BackendError, BatchResult, attention, encode_prompts
from .trainer import score_trajectory

if TYPE_CHECKING:  # the adapters import torch: only named here, imported where used
    from rollout_consistency.adapters import PipelineSettings

OTHER_KERNEL = {"native": "_native_math", "_native_math": "native"}


def _failed_batch(batch: BatchSpec, window_size: int, problem: str) -> BatchResult:
    """A batch whose rollout could not run: no entries, the reason recorded (the check then FAILs)."""
    empty = np.zeros((0, window_size), dtype=np.float32)
    return BatchResult(
        batch=batch.index,
        sample_indices=(),
        rollout_log_probs=empty,
        trainer_log_probs=empty,
        floor_log_probs=None,
        timesteps=empty,
        window_starts=(),
        prompt_groups=(),
        seeds=(),
        problems=(problem,),
    )


# ----------------------------------------------------------------------------------------------------
# Model families: the checker reads everything per family from its `ModelFamily` (no family-name branches).
def pipeline_settings(sampling: SampleSettings) -> PipelineSettings:
    """The pipeline arguments of `sampling` as the adapters' `PipelineSettings` (what each family maps to its
    options). A plug-in may pass the `CheckConfig` its factory received: the fields carry its names."""
    from rollout_consistency.adapters import PipelineSettings

    return PipelineSettings(
        height=sampling.height,
        width=sampling.width,
        guidance_scale=sampling.guidance_scale,
        true_cfg_scale=sampling.true_cfg_scale,
        mask_text_padding=sampling.mask_text_padding,
        max_sequence_length=sampling.max_sequence_length,
        pad_prompts_to_max_length=sampling.pad_prompts_to_max_length,
        num_frames=sampling.num_frames,
        guidance_scale_2=sampling.guidance_scale_2,
        boundary_ratio=sampling.boundary_ratio,
    )


_CHECKER_FIELDS = ("scheduler_config", "options", "guidance", "cfg_scale", "load_transformer", "load_prompt_encoder")


def checker_family(name: str) -> Any:
    """The registered `ModelFamily` `name`, with the fields the checker needs (BackendError naming the missing)."""
    from rollout_consistency import adapters

    try:
        family = adapters.get_family(name)
    except ValueError as error:
        raise BackendError(str(error)) from error
    missing = [field for field in _CHECKER_FIELDS if getattr(family, field) is None]
    if missing:
        raise BackendError(
            f"model family {name!r} cannot be checked: its ModelFamily has no {', '.join(missing)} (set them where "
            f"the family is registered)."
        )
    return family


def _load_transformer(family: Any, path: str | None, dtype: Any, device: str, settings: PipelineSettings) -> Any:
    # The family's loader settings (Wan 2.2: boundary_ratio, which makes the model two experts).
    kwargs = family.model_kwargs(settings) if family.model_kwargs is not None else {}
    if path is not None:
        return family.load_transformer(path, dtype=dtype, device=device, **kwargs)
    from rollout_consistency.adapters import tiny

    try:
        model = tiny.get_tiny(family.name)
    except ValueError as error:
        raise BackendError(str(error)) from error
    return model.load_transformer(dtype=dtype, device=device, seed=0, **kwargs)


def _prompt_encoder(family: Any, path: str | None, transformer: Any, device: str, settings: PipelineSettings) -> Any:
    if path is not None:
        return family.load_prompt_encoder(path, device, settings)
    from rollout_consistency.adapters import tiny

    return tiny.get_tiny(family.name).prompt_encoder(transformer, settings)


def _scheduler_config(family: Any, path: str | None) -> dict[str, Any]:
    from rollout_consistency.adapters.families import load_scheduler_config

    return dict(family.scheduler_config) if path is None else load_scheduler_config(path)


# ----------------------------------------------------------------------------------------------------
def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device; use device 'cpu' or 'auto'.")
    return name


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def floor_kernel(model: ModelSettings) -> str | None:
    """The trainer's *other* attention kernel for the calibrated floor (None if no floor is measured)."""
    if not model.measures_floor:
        return None
    if model.calibration_attention is not None:
        return model.calibration_attention
    if model.trainer_attention not in OTHER_KERNEL:
        raise ConfigError(
            f"profile 'calibrated' needs calibration_attention: there is no default second kernel for trainer "
            f"attention {model.trainer_attention!r} (set e.g. calibration_attention='_native_math')."
        )
    return OTHER_KERNEL[model.trainer_attention]


def start_backend(settings: SidesSettings, side: str) -> Any:
    """The `side` (``"rollout"`` / ``"trainer"``) the settings name, built by its registered factory (once per
    worker); None for a plug-in side (`plugins.build_sides` loads those).

    Raises:
        BackendError: the factory cannot be imported, or cannot start the backend (naming what to install or set).
    """
    import importlib

    name = getattr(settings.execution, f"{side}_backend")
    if is_plugin_spec(name):
        return None
    entry = get_backend(side, name)
    module, _, function = entry.factory.rpartition(":")
    # A backend registered from the user's own code is user code: fenced like a plug-in's (rollout_consistency.safeguards.fence).
    owner, timeout_s = f"{side}_backend {name!r}", settings.execution.user_code_timeout_s
    try:
        if module.endswith(".py"):  # a file: loaded as a module of its own
            factory = load_object(entry.factory, owner=owner, timeout_s=timeout_s)
        else:  # importable as it is: unlike a plug-in spec, the current directory is not put on sys.path
            with fenced(owner, f"import of {module}", timeout_s=timeout_s):
                factory = getattr(importlib.import_module(module), function)
    except (SpecError, ImportError, AttributeError) as error:
        raise BackendError(
            f"{side}_backend {name!r}: its factory {entry.factory!r} cannot be loaded: {error}"
        ) from error
    with fenced(owner, "the factory", timeout_s=timeout_s):
        if entry.receives == "sides":  # a built-in backend: the sides' own settings
            return factory(settings)
        return settings.user_code.registered_factory(factory)  # the CheckConfig, as the registry's contract says


def build_backend(settings: SidesSettings) -> Backend:
    """Load both sides for `settings` (a worker's setup). Identical weights on both sides by construction.

    With an in-process rollout (``torch``) both sides load the same seeded tiny model (or the same `model_path`)
    and, when their dtypes agree, share one module. An engine such as ``vllm-omni`` holds its own copy of
    `model_path`.
    """

    engine = start_backend(settings, "rollout")  # first: a missing package is the first thing to fix
    recompute = start_backend(settings, "trainer")
    sides = plugins.build_sides(settings)  # before the checker's own model: a broken plug-in fails in seconds
    model, sampling = settings.model, settings.sampling
    device = resolve_device(model.device)
    family = checker_family(model.model_family)
    pipeline = pipeline_settings(sampling)
    trainer_model = _load_transformer(family, model.model_path, _dtype(model.trainer_dtype), device, pipeline)
    schedule_model = trainer_model  # the schedule's shapes: a plug-in side may expose no model
    if engine is not None and not engine.in_process:
        rollout_model = None  # the engine holds its own copy of the weights
    elif model.rollout_dtype == model.trainer_dtype and settings.execution.weight_sync is None:
        rollout_model = trainer_model  # the same module: identical weights, nothing to sync
    else:
        rollout_model = _load_transformer(family, model.model_path, _dtype(model.rollout_dtype), device, pipeline)
    encoder = _prompt_encoder(family, model.model_path, trainer_model, device, pipeline)
    if sides is not None:  # a user's side replaces the built-in one (audited and fingerprinted instead)
        rollout_model = plugins.side_model(sides.rollout) if sides.rollout is not None else rollout_model
        trainer_model = plugins.side_model(sides.trainer) if sides.trainer is not None else trainer_model
    # The engine's precision settings live in its own worker process: audited there, not here. The audit and
    # the fingerprints read the plain modules, so they come before the batch-invariant proxies wrap them.
    audit = rollout_model is not None and trainer_model is not None
    precision = _precision_diff(rollout_model, trainer_model, device) if audit else None
    weights = plugins.fingerprints(rollout_model, trainer_model)
    if model.batch_invariant:
        from rollout_consistency.adapters.batch_invariance import batch_invariant

        # Forwards of rollout_batch_size rows on both sides where the proxy's probes find this machine's kernels
        # position-invariant (a rollout batch then runs unpadded), one row per forward otherwise.
        rows = settings.execution.rollout_batch_size
        shared = rollout_model is trainer_model
        trainer_model = None if trainer_model is None else batch_invariant(trainer_model, family, rows_per_forward=rows)
        if rollout_model is not None:
            rollout_model = trainer_model if shared else batch_invariant(rollout_model, family, rows_per_forward=rows)
    options = family.options(pipeline)
    setup = family.scheduler_setup(
        _scheduler_config(family, model.model_path), sampling.num_inference_steps, schedule_model, options
    )
    return Backend(
        settings=settings,
        family=family,
        rollout_model=rollout_model,
        trainer_model=trainer_model,
        encoder=encoder,
        scheduler_setup=setup,
        options=options,
        guidance=float(family.guidance(pipeline)),
        cfg_passes=2 if family.cfg_scale(pipeline) > 1 else 1,
        cfg_scale=float(family.cfg_scale(pipeline)),
        injection=settings.execution.inject,
        floor_kernel=floor_kernel(model),
        rollout_engine=engine,
        precision=precision,
        plugins=sides,
        weights=weights,
        trainer_recompute=plugins.plugin_recompute if recompute is None else recompute,
        trainer_experts=plugins.plugin_trainer_experts if sides is not None and sides.trainer is not None else None,
    )


def _precision_diff(rollout_model: Any, trainer_model: Any, device: str) -> Mapping[str, Any] | None:
    """The training tools' precision-audit diff of the two sides (None if that module is absent)."""
    try:
        from rollout_consistency.training.precision import audit_precision, diff_precision_reports
    except ImportError:  # pragma: no cover - shipped together; tolerate a partial install
        return None
    rollout = audit_precision(model=rollout_model, autocast_dtype=None, device=device, label="rollout")
    trainer = audit_precision(model=trainer_model, autocast_dtype=None, device=device, label="trainer")
    return diff_precision_reports(rollout, trainer).to_dict()


# ----------------------------------------------------------------------------------------------------
def run_batch(backend: Backend, batch: BatchSpec) -> BatchResult:
    """Roll out one batch and recompute it on the trainer side (a worker's work; see the module docstring)."""
    from rollout_consistency.adapters.pitfalls import MixedDtypeBatchError
    from rollout_consistency.adapters.vllm_omni import VllmOmniEngineError  # imports no vLLM

    if backend.plugins is not None and backend.plugins.rollout is not None:
        return with_plan_findings(backend, batch, plugins.run_plugin_batch(backend, batch))
    start = time.perf_counter()
    window = backend.settings.sampling.sde_window_size
    try:
        trajectory = rollout_trajectory(backend, batch)
    except MixedDtypeBatchError as error:
        # The stock step-wise path's other symptom: the engine cannot batch the requests at all.
        return _failed_batch(batch, window, f"{batch.describe()}: the rollout engine failed: {error}")
    except VllmOmniEngineError as error:
        # A request failed in vLLM-omni (named in the error), or an earlier one closed the engine: this batch
        # has no rollout, and the check FAILs naming it rather than crashing.
        return _failed_batch(batch, window, f"{batch.describe()}: the vLLM-omni engine failed: {error}")
    seconds = {"rollout": time.perf_counter() - start}
    forwards = {"rollout": max(w.stop for w in trajectory.windows) * backend.cfg_passes}
    result = score_trajectory(
        backend,
        trajectory,
        batch=batch.index,
        sample_indices=batch.sample_indices,
        seconds=seconds,
        forwards=forwards,
    )
    return with_plan_findings(backend, batch, result)


def with_plan_findings(backend: Backend, batch: BatchSpec, result: BatchResult) -> BatchResult:
    """`result` with the ``windows`` guard's reasons when a side's tables are not the plan's window: as many steps
    wide as the plan's window, at the plan's timesteps (`rollout_consistency.gate.judging.verdict.plan_window_problems`).
    A plug-in rollout reports its own tables, so a 2-step plan must not pass on a rollout that sampled 6."""
    import dataclasses

    if result.problems:
        return result
    size = batch.samples[0].window_size
    schedule = backend.scheduler_setup.timesteps().detach().cpu().numpy()
    expected = np.stack([schedule[s.window_start : s.window_start + s.window_size] for s in batch.samples])
    found = plan_window_problems(
        "rollout", result.rollout_log_probs, size, batch.sample_indices, timesteps=result.timesteps, expected=expected
    )
    found += plan_window_problems("trainer", result.trainer_log_probs, size, batch.sample_indices)
    if not found:
        return result
    return dataclasses.replace(result, findings=(*result.findings, *(("windows", m) for m in found)))


def rollout_trajectory(backend: Backend, batch: BatchSpec) -> Any:
    """The rollout side of `run_batch` alone: the batch's float32 `Trajectory` (the doctor replays it too)."""
    import torch

    settings = backend.settings
    if backend.rollout_engine is None:
        raise BackendError(
            f"rollout_backend {settings.execution.rollout_backend!r} is a plug-in: run_batch hands it the batch."
        )
    requests = batch_requests(backend, batch)
    with torch.no_grad():
        conditioning = encode_prompts(backend, [s.prompt for s in batch.samples])
        with attention(settings.model.rollout_attention):
            return backend.rollout_engine.rollout(backend, conditioning, requests, sampling_settings(backend))


def batch_requests(backend: Backend, batch: BatchSpec) -> Any:
    """The planned batch's [`BatchRequests`](rollout_consistency.adapters.BatchRequests): each sample's seed,
    window and prompt group, and the settings' training step (windows only: the check needs no final latents)."""
    from rollout_consistency.adapters import BatchRequests
    from rollout_consistency.schedulers import SDEWindow

    sampling = backend.settings.sampling
    return BatchRequests(
        seeds=tuple(s.seed for s in batch.samples),
        windows=tuple(SDEWindow(s.window_start, s.window_size, sampling.num_inference_steps) for s in batch.samples),
        prompt_groups=tuple(s.prompt_group for s in batch.samples),
        global_step=sampling.global_step,
        denoise_to_end=False,
    )


def sampling_settings(backend: Backend) -> Any:
    """The run's [`SamplingSettings`](rollout_consistency.adapters.SamplingSettings): the settings' SDE step and
    the family's guidance."""
    from rollout_consistency.adapters import SamplingSettings

    sampling = backend.settings.sampling
    return SamplingSettings(
        noise_level=sampling.noise_level, sde_type=sampling.sde_type, guidance_scale=backend.guidance
    )
