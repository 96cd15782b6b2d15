# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The two halves the check compares, as a worker holds them: rollout engine and PyTorch trainer.

[`build_backend`] (a worker's setup) loads the model once per side — identical weights: the same seeded
tiny model, or the same checkpoint — and [`run_batch`] (a worker's work) does one rollout batch:

1. the rollout backend samples the batch (``torch``: the diffusers adapters, request-level or step-wise;
   ``vllm-omni``: `rollout_consistency.adapters.vllm_omni`) into a float32 trajectory;
2. the trainer recomputes every stored window step, micro-batch by micro-batch, with its own attention
   kernel and dtype (the PyTorch training adapter, `rollout_consistency.adapters.recompute_log_probs`);
3. for the ``calibrated`` profile it recomputes once more with the other attention kernel (the floor).

Both are plain functions of picklable arguments, so the in-process path and a Ray actor run the very same
code. Nothing here reads the environment or a global RNG: every draw comes from the per-sample seeds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import plugins
from .config import CheckConfig, ConfigError
from .plan import BatchSpec
from .tolerance_model import measure_floor_tables, recompute_variant

OTHER_KERNEL = {"native": "_native_math", "_native_math": "native"}


class BackendError(RuntimeError):
    """A backend cannot be built as configured (missing package, unknown kernel, model not found)."""


@dataclass(frozen=True)
class BatchResult:
    """What one rollout batch gives back (numpy, small, picklable).

    Attributes:
        batch: the batch index. sample_indices: global sample indices, in order.
        rollout_log_probs, trainer_log_probs (`np.ndarray` `(n, W)` float32): both sides' log-probs.
        floor_log_probs (`np.ndarray` `(n, W)` float32 or None): the trainer with the other kernel.
        timesteps (`np.ndarray` `(n, W)` float32): exact timestep of each stored step.
        window_starts, prompt_groups, seeds: per sample, as the rollout stored them.
        forwards: transformer forwards run, by stage (``rollout``, ``trainer``, ``floor``).
        seconds: wall time by stage.
        precision: the precision-audit diff (rollout vs trainer) of the process that ran the batch, or None.
        problems: why the batch has no log-probs (the rollout engine failed); empty on success.
    """

    batch: int
    sample_indices: tuple[int, ...]
    rollout_log_probs: np.ndarray
    trainer_log_probs: np.ndarray
    floor_log_probs: np.ndarray | None
    timesteps: np.ndarray
    window_starts: tuple[int, ...]
    prompt_groups: tuple[int, ...]
    seeds: tuple[int, ...]
    forwards: Mapping[str, int] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)
    precision: Mapping[str, Any] | None = None
    problems: tuple[str, ...] = ()
    #: ``calibrated``: the trainer's log-probs with each other source of difference changed (batch
    #: composition, implementation; `rollout_consistency.gate.tolerance_model`), by source name.
    floor_tables: Mapping[str, np.ndarray] = field(default_factory=dict)
    weights: Mapping[str, Any] | None = None  # rollout_consistency.gate.plugins.fingerprints of the two sides


def _failed_batch(batch: BatchSpec, config: CheckConfig, problem: str) -> BatchResult:
    """A batch whose rollout could not run: no entries, the reason recorded (the check then FAILs)."""
    empty = np.zeros((0, config.sde_window_size), dtype=np.float32)
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
def pipeline_settings(config: CheckConfig) -> Any:
    """The config's pipeline arguments as the adapters' `PipelineSettings` (what each family maps to its options)."""
    from rollout_consistency.adapters import PipelineSettings

    return PipelineSettings(
        height=config.height,
        width=config.width,
        guidance_scale=config.guidance_scale,
        true_cfg_scale=config.true_cfg_scale,
        mask_text_padding=config.mask_text_padding,
        max_sequence_length=config.max_sequence_length,
        pad_prompts_to_max_length=config.pad_prompts_to_max_length,
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


def _load_transformer(family: Any, path: str | None, dtype: Any, device: str) -> Any:
    if path is not None:
        return family.load_transformer(path, dtype=dtype, device=device)
    from rollout_consistency.adapters import tiny

    try:
        model = tiny.get_tiny(family.name)
    except ValueError as error:
        raise BackendError(str(error)) from error
    return model.load_transformer(dtype=dtype, device=device, seed=0)


def _prompt_encoder(family: Any, path: str | None, transformer: Any, device: str, settings: Any) -> Any:
    if path is not None:
        return family.load_prompt_encoder(path, device, settings)
    from rollout_consistency.adapters import tiny

    return tiny.get_tiny(family.name).prompt_encoder(transformer, settings)


def _scheduler_config(family: Any, path: str | None) -> dict[str, Any]:
    from rollout_consistency.adapters.families import load_scheduler_config

    return dict(family.scheduler_config) if path is None else load_scheduler_config(path)


def encode_prompts(backend: Backend, prompts: Sequence[str]) -> dict[str, Any]:
    """The batch's conditioning: the prompts (and, under CFG, the family's negative prompt) through the encoder."""
    negatives = [backend.family.negative_prompt] * len(prompts) if backend.cfg_passes > 1 else None
    return backend.encoder(list(prompts), negatives)


# ----------------------------------------------------------------------------------------------------
@dataclass
class Backend:
    """A worker's state: both sides' models and what they need. Built once per worker by `build_backend`."""

    config: CheckConfig
    family: Any
    rollout_model: Any
    trainer_model: Any
    encoder: Any
    scheduler_setup: Any
    options: dict[str, Any]
    guidance: float
    cfg_passes: int
    injection: str | None
    floor_kernel: str | None
    rollout_engine: Any = None
    precision: Mapping[str, Any] | None = None
    plugins: Any = None  # rollout_consistency.gate.plugins.PluginSides when a side is a user's plug-in
    weights: Mapping[str, Any] | None = None


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


@contextlib.contextmanager
def attention(name: str) -> Iterator[None]:
    """Run diffusers attention with backend `name` (``native`` = PyTorch SDPA, ``_native_math`` = its math
    kernel, ...) inside the block. An unknown name or a backend that cannot run here is a `ConfigError`."""
    from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend

    valid = [b.value for b in AttentionBackendName]
    if name not in valid:
        from .tolerances import closest_name

        raise ConfigError(
            f"attention backend {name!r} is not one of diffusers' backends ({', '.join(valid)}).{closest_name(name, valid)}"
        )
    manager = attention_backend(name)
    try:
        manager.__enter__()
    except Exception as error:  # requirements not met (flash kernels on a CPU, a missing package)
        raise ConfigError(f"attention backend {name!r} cannot run here: {error}") from error
    try:
        yield
    finally:
        manager.__exit__(None, None, None)  # restores the previous backend


def floor_kernel(config: CheckConfig) -> str | None:
    """The trainer's *other* attention kernel for the calibrated floor (None if no floor is measured)."""
    if config.resolved_profile != "calibrated":
        return None
    if config.calibration_attention is not None:
        return config.calibration_attention
    if config.trainer_attention not in OTHER_KERNEL:
        raise ConfigError(
            f"profile 'calibrated' needs calibration_attention: there is no default second kernel for trainer "
            f"attention {config.trainer_attention!r} (set e.g. calibration_attention='_native_math')."
        )
    return OTHER_KERNEL[config.trainer_attention]


def load_rollout_engine(config: CheckConfig) -> Any:
    """The started vLLM-omni engine for ``rollout_backend='vllm-omni'`` (None for ``torch``).

    Raises:
        BackendError: vLLM-omni, vLLM or CUDA is missing (naming the ``vllm`` extra), or the engine cannot start
            from the config (e.g. no ``model_path``).
    """
    if config.rollout_backend != "vllm-omni":
        return None
    from rollout_consistency.adapters import vllm_omni  # imports no vLLM: only the engine does, when it starts

    try:
        vllm_omni.require_vllm_omni()
    except ImportError as error:
        raise BackendError(str(error)) from error
    arguments = vllm_omni_engine_arguments(config)
    try:
        return vllm_omni.VllmOmniRollout(**arguments)
    except (ValueError, FileNotFoundError) as error:
        raise BackendError(f"the vLLM-omni engine cannot start: {error}") from error


def vllm_omni_engine_arguments(config: CheckConfig) -> dict[str, Any]:
    """The `VllmOmniRollout` keyword arguments `config` asks for (validated here; starts nothing, imports no vLLM).

    Raises:
        BackendError: no ``model_path`` (the engine serves a whole diffusers directory, not the tiny transformer).
    """
    from rollout_consistency.schedulers import SDEWindowSchedule

    if config.model_path is None:
        raise BackendError(
            "rollout_backend 'vllm-omni' loads a model directory: set model_path to a local diffusers Qwen-Image "
            "directory (the built-in tiny model is a transformer only, with no text encoder or VAE to serve)."
        )
    schedule = SDEWindowSchedule(
        kind=config.sde_window_kind,
        num_steps=config.num_inference_steps,
        window_size=config.sde_window_size,
        window_range=None if config.sde_window_range is None else tuple(config.sde_window_range),
    )
    return {
        "model_path": config.model_path,
        "dtype": config.rollout_dtype,
        "step_execution": config.step_execution,
        "max_num_seqs": config.max_num_seqs,
        "launcher_seed": config.seed,
        "window_schedule": schedule,
    }


def build_backend(config: CheckConfig) -> Backend:
    """Load both sides for `config` (a worker's setup). Identical weights on both sides by construction.

    With the ``torch`` rollout both sides load the same seeded tiny model (or the same `model_path`) and, when
    their dtypes agree, share one module. With ``vllm-omni`` the engine holds its own copy of `model_path`.
    """

    engine = load_rollout_engine(config)  # first: a missing package is the first thing to fix
    device = resolve_device(config.device)
    family = checker_family(config.model_family)
    settings = pipeline_settings(config)
    trainer_model = _load_transformer(family, config.model_path, _dtype(config.trainer_dtype), device)
    schedule_model = trainer_model  # the schedule's shapes: a plug-in side may expose no model
    if engine is not None:
        rollout_model = None
    elif config.rollout_dtype == config.trainer_dtype and config.weight_sync is None:
        rollout_model = trainer_model  # the same module: identical weights, nothing to sync
    else:
        rollout_model = _load_transformer(family, config.model_path, _dtype(config.rollout_dtype), device)
    encoder = _prompt_encoder(family, config.model_path, trainer_model, device, settings)
    sides = plugins.build_sides(config)
    if sides is not None:  # a user's side replaces the built-in one (audited and fingerprinted instead)
        rollout_model = plugins.side_model(sides.rollout) if sides.rollout is not None else rollout_model
        trainer_model = plugins.side_model(sides.trainer) if sides.trainer is not None else trainer_model
    # The engine's precision settings live in its own worker process: audited there, not here. The audit and
    # the fingerprints read the plain modules, so they come before the batch-invariant proxies wrap them.
    audit = rollout_model is not None and trainer_model is not None
    precision = _precision_diff(rollout_model, trainer_model, device) if audit else None
    weights = plugins.fingerprints(rollout_model, trainer_model)
    if config.batch_invariant:
        from rollout_consistency.adapters.batch_invariance import batch_invariant

        shared = rollout_model is trainer_model
        trainer_model = None if trainer_model is None else batch_invariant(trainer_model, family)
        if rollout_model is not None:
            rollout_model = trainer_model if shared else batch_invariant(rollout_model, family)
    options = family.options(settings)
    setup = family.scheduler_setup(
        _scheduler_config(family, config.model_path), config.num_inference_steps, schedule_model, options
    )
    return Backend(
        config=config,
        family=family,
        rollout_model=rollout_model,
        trainer_model=trainer_model,
        encoder=encoder,
        scheduler_setup=setup,
        options=options,
        guidance=float(family.guidance(settings)),
        cfg_passes=2 if family.cfg_scale(settings) > 1 else 1,
        injection=config.inject,
        floor_kernel=floor_kernel(config),
        rollout_engine=engine,
        precision=precision,
        plugins=sides,
        weights=weights,
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
        return plugins.run_plugin_batch(backend, batch)
    start = time.perf_counter()
    try:
        trajectory = rollout_trajectory(backend, batch)
    except MixedDtypeBatchError as error:
        # The stock step-wise path's other symptom: the engine cannot batch the requests at all.
        return _failed_batch(batch, backend.config, f"{batch.describe()}: the rollout engine failed: {error}")
    except VllmOmniEngineError as error:
        # A request failed in vLLM-omni (named in the error), or an earlier one closed the engine: this batch
        # has no rollout, and the check FAILs naming it rather than crashing.
        return _failed_batch(batch, backend.config, f"{batch.describe()}: the vLLM-omni engine failed: {error}")
    seconds = {"rollout": time.perf_counter() - start}
    forwards = {"rollout": max(w.stop for w in trajectory.windows) * backend.cfg_passes}
    return score_trajectory(
        backend,
        trajectory,
        batch=batch.index,
        sample_indices=batch.sample_indices,
        seconds=seconds,
        forwards=forwards,
    )


def rollout_trajectory(backend: Backend, batch: BatchSpec) -> Any:
    """The rollout side of `run_batch` alone: the batch's float32 `Trajectory` (the doctor replays it too)."""
    import torch

    config = backend.config
    requests = batch_requests(backend, batch)
    with torch.no_grad():
        conditioning = encode_prompts(backend, [s.prompt for s in batch.samples])
        with attention(config.rollout_attention):
            return _rollout(backend, conditioning, requests, sampling_settings(backend))


def batch_requests(backend: Backend, batch: BatchSpec) -> Any:
    """The planned batch's [`BatchRequests`](rollout_consistency.adapters.BatchRequests): each sample's seed,
    window and prompt group, and the config's training step."""
    from rollout_consistency.adapters import BatchRequests
    from rollout_consistency.schedulers import SDEWindow

    config = backend.config
    return BatchRequests(
        seeds=tuple(s.seed for s in batch.samples),
        windows=tuple(SDEWindow(s.window_start, s.window_size, config.num_inference_steps) for s in batch.samples),
        prompt_groups=tuple(s.prompt_group for s in batch.samples),
        global_step=config.global_step,
    )


def sampling_settings(backend: Backend) -> Any:
    """The run's [`SamplingSettings`](rollout_consistency.adapters.SamplingSettings): the config's SDE settings
    and the family's guidance."""
    from rollout_consistency.adapters import SamplingSettings

    config = backend.config
    return SamplingSettings(noise_level=config.noise_level, sde_type=config.sde_type, guidance_scale=backend.guidance)


def score_trajectory(
    backend: Backend,
    trajectory: Any,
    *,
    batch: int,
    sample_indices: tuple[int, ...],
    seconds: dict[str, float] | None = None,
    forwards: dict[str, int] | None = None,
) -> BatchResult:
    """The trainer side: recompute every stored window step of `trajectory` (and the floor with the other
    kernel, for ``calibrated``), and pack both sides' log-probs as one batch's result.

    `seconds` / `forwards` carry the rollout's own figures when there was a rollout in this process.
    """
    config = backend.config
    seconds, forwards = dict(seconds or {}), dict(forwards or {})
    cfg_passes = backend.cfg_passes
    start = time.perf_counter()
    trainer = trainer_log_probs(backend, trajectory, config.trainer_attention)
    seconds["trainer"] = time.perf_counter() - start
    micro = config.resolved_micro_batch_size
    n_micro = -(-trajectory.batch_size // micro)
    forwards["trainer"] = n_micro * trajectory.window_size * cfg_passes

    floor, floor_tables = None, {}
    if backend.floor_kernel is not None:
        start = time.perf_counter()
        floor = trainer_log_probs(backend, trajectory, backend.floor_kernel)
        floor_tables = measure_floor_tables(backend, trajectory)
        seconds["floor"] = time.perf_counter() - start
        forwards["floor"] = forwards["trainer"] * (1 + len(floor_tables))

    return BatchResult(
        batch=batch,
        sample_indices=sample_indices,
        rollout_log_probs=trajectory.log_probs.detach().cpu().numpy().copy(),
        trainer_log_probs=trainer,
        floor_log_probs=floor,
        timesteps=trajectory.timesteps.detach().cpu().numpy().copy(),
        window_starts=tuple(w.start for w in trajectory.windows),
        prompt_groups=tuple(trajectory.prompt_groups),
        seeds=tuple(trajectory.seeds),
        forwards=forwards,
        seconds=seconds,
        precision=backend.precision,
        floor_tables=floor_tables,
        weights=backend.weights,
    )


def _rollout(backend: Backend, conditioning, requests, sampling):
    import dataclasses

    from rollout_consistency import adapters

    config = backend.config
    if backend.rollout_engine is not None:
        # The engine encodes nothing itself here: it gets the conditioning the trainer will re-score.
        return backend.rollout_engine.rollout(
            backend.family,
            None,
            conditioning,
            scheduler_setup=backend.scheduler_setup,
            requests=requests,
            sampling=sampling,
            options=backend.options,
            max_num_seqs=config.max_num_seqs,
            step_execution=config.step_execution,
        )
    transformer, scheduler, windows = _rollout_side(backend, requests.windows)
    requests = dataclasses.replace(requests, windows=tuple(windows))
    if config.step_execution:
        return _rollout_stepwise(backend, transformer, scheduler, conditioning, requests, sampling)
    return adapters.rollout(
        backend.family,
        transformer,
        conditioning,
        scheduler_setup=backend.scheduler_setup,
        requests=requests,
        sampling=sampling,
        options=backend.options,
        denoise_to_end=False,
        scheduler=scheduler,
    )


def _rollout_side(backend: Backend, windows):
    """The rollout side's transformer, scheduler and windows, with the `--inject` pitfall applied (rollout only:
    the trainer keeps the plain model and scheduler)."""
    transformer, scheduler = backend.rollout_model, backend.scheduler_setup.scheduler()
    if backend.injection is None:
        return transformer, scheduler, windows
    from rollout_consistency.adapters.pitfalls import apply_injection

    injected = apply_injection(
        backend.injection,
        scheduler=scheduler,
        transformer=transformer,
        windows=windows,
        request_ids=[f"sample-{index}" for index in range(len(windows))],
    )
    return injected.transformer, injected.scheduler, list(injected.windows)


def _rollout_stepwise(backend: Backend, transformer, scheduler, conditioning, batch_requests, sampling):
    """The step-wise engine on the batch's requests (`max_num_seqs` running; see `stagger_arrivals`).

    Every request's text is padded to the batch's width and every forward uses that width: the stored
    conditioning then has the width the rollout's forwards had, so the trainer recomputes the same
    computation (a forward padded to another width differs in the last bits).
    """
    from rollout_consistency.adapters import stepwise

    config = backend.config
    seeds, windows, groups = batch_requests.seeds, batch_requests.windows, batch_requests.prompt_groups
    rows = [{k: v[i : i + 1] for k, v in conditioning.items()} for i in range(len(seeds))]
    # Staggered: two requests join per engine step, so forwards mix requests at different steps (pairs keep
    # every forward at >= 2 rows: this CPU build takes another kernel for a single row).
    requests = [
        stepwise.StepwiseRequest(
            request_id=f"sample-{index}",
            seed=seed,
            conditioning=row,
            window=window,
            prompt_group=group,
            arrival=index // 2 if config.stagger_arrivals else 0,
        )
        for index, (seed, row, window, group) in enumerate(zip(seeds, rows, windows, groups, strict=False))
    ]
    return stepwise.run_stepwise(
        backend.family,
        transformer,
        requests,
        scheduler_setup=backend.scheduler_setup,
        sampling=sampling,
        options=backend.options,
        max_num_seqs=config.max_num_seqs,
        text_width=stepwise.shared_text_width(rows),
        global_step=batch_requests.global_step,
        scheduler=scheduler,
    )


def trainer_log_probs(backend: Backend, trajectory: Any, kernel: str) -> np.ndarray:
    """The trainer's log-probs of every stored step, micro-batch by micro-batch: `(B, W)` float32 numpy."""
    import torch

    from rollout_consistency import adapters

    if backend.plugins is not None and backend.plugins.trainer is not None:
        return plugins.plugin_recompute(backend, trajectory, kernel)
    if backend.config.trainer_step_implementation != "reference":
        return recompute_variant(backend, trajectory, kernel=kernel)
    micro = backend.config.resolved_micro_batch_size
    parts = []
    with torch.no_grad(), attention(kernel):
        for start in range(0, trajectory.batch_size, micro):
            part = trajectory.select(range(start, min(start + micro, trajectory.batch_size)))
            parts.append(adapters.recompute_log_probs(backend.trainer_model, part, family=backend.family))
    return torch.cat(parts).detach().cpu().numpy().copy()
