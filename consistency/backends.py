# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The two halves the check compares, as a worker holds them: rollout engine and PyTorch trainer.

[`build_backend`] (a worker's setup) loads the model once per side — identical weights: the same seeded
tiny model, or the same checkpoint — and [`run_batch`] (a worker's work) does one rollout batch:

1. the rollout backend samples the batch (``torch``: the diffusers adapters, request-level or step-wise;
   ``vllm-omni``: `rollout_consistency.adapters.vllm_omni`) into a float32 trajectory;
2. the trainer recomputes every stored window step, micro-batch by micro-batch, with its own attention
   kernel and dtype (the PyTorch training adapter, `rollout_consistency.adapters.denoise.recompute_log_probs`);
3. for the ``calibrated`` profile it recomputes once more with the other attention kernel (the floor).

Both are plain functions of picklable arguments, so the in-process path and a Ray actor run the very same
code. Nothing here reads the environment or a global RNG: every draw comes from the per-sample seeds.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    #: composition, implementation; `rollout_consistency.tolerance_model`), by source name.
    floor_tables: Mapping[str, np.ndarray] = field(default_factory=dict)


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
# Model families: how the check builds a family's model, schedule and conditioning.
@dataclass(frozen=True)
class FamilyKit:
    """Per-family construction the checker needs on top of `rollout_consistency.adapters.denoise.ModelFamily`.

    Attributes:
        name: the family id.
        load_transformer: `(path | None, dtype, device) -> nn.Module` (tiny seeded model for `None`).
        scheduler_config: `(path | None) -> dict`.
        make_encoder: `(path | None, transformer, device) -> encoder`; encoder used by `conditioning`.
        conditioning: `(encoder, prompts, config) -> dict[str, Tensor]` batch-first float32/int64.
        options: `(config) -> dict` family options (image size, ...).
        guidance: `(config) -> float` the guidance value the family's velocity takes.
        cfg_passes: `(config) -> int` transformer forwards per denoising step (2 with CFG).
    """

    name: str
    load_transformer: Callable[..., Any]
    scheduler_config: Callable[[str | None], dict[str, Any]]
    make_encoder: Callable[..., Any]
    conditioning: Callable[[Any, Sequence[str], CheckConfig], dict[str, Any]]
    options: Callable[[CheckConfig], dict[str, Any]]
    guidance: Callable[[CheckConfig], float]
    cfg_passes: Callable[[CheckConfig], int]


def _qwen_image_kit() -> FamilyKit:
    from rollout_consistency import adapters

    def load(path, dtype, device):
        return adapters.load_qwen_image(path, dtype=dtype, device=device, seed=0)

    def encoder(path, transformer, device):
        if path is None:
            return adapters.TinyPromptEncoder(int(transformer.config.joint_attention_dim), seed=0)
        # A real checkpoint: its own text encoder through diffusers' pipeline (transformer/VAE not loaded).
        from diffusers import QwenImagePipeline

        return QwenImagePipeline.from_pretrained(path, transformer=None, vae=None).to(device)

    def conditioning(enc, prompts, config):
        import torch

        negatives = [" "] * len(prompts) if config.true_cfg_scale > 1 else None
        pad_to = config.max_sequence_length if config.pad_prompts_to_max_length else None
        if isinstance(enc, adapters.TinyPromptEncoder):
            return enc.conditioning(list(prompts), negatives, pad_to=pad_to)
        out = {}
        for prefix, texts in (("", prompts), ("negative_", negatives)):
            if texts is None:
                continue
            embeds, mask = enc.encode_prompt(list(texts), max_sequence_length=config.max_sequence_length)
            out[f"{prefix}prompt_embeds"] = embeds.float().cpu()
            if mask is None:  # diffusers drops an all-valid mask
                mask = torch.ones(embeds.shape[:2], dtype=torch.int64)
            out[f"{prefix}prompt_embeds_mask"] = mask.long().cpu()
        if pad_to is not None:
            out = adapters.qwen_image.pad_text_conditioning(out, pad_to)
        return out

    return FamilyKit(
        name="qwen-image",
        load_transformer=load,
        scheduler_config=adapters.load_qwen_image_scheduler_config,
        make_encoder=encoder,
        conditioning=conditioning,
        options=lambda c: {"height": c.height, "width": c.width, "mask_text_padding": c.mask_text_padding},
        guidance=lambda c: c.true_cfg_scale,
        cfg_passes=lambda c: 2 if c.true_cfg_scale > 1 else 1,
    )


def _clip_t5_kit(name: str) -> FamilyKit:
    """SD3 and FLUX: fixed-length T5 sequence + pooled CLIP vector, no text mask."""
    from rollout_consistency import adapters
    from rollout_consistency.adapters import tiny_sd3_flux

    module = adapters.sd3 if name == "sd3" else adapters.flux
    loader = tiny_sd3_flux.load_sd3 if name == "sd3" else tiny_sd3_flux.load_flux
    tiny_encoder = tiny_sd3_flux.tiny_sd3_prompt_encoder if name == "sd3" else tiny_sd3_flux.tiny_flux_prompt_encoder
    default_scheduler = module.SD3_SCHEDULER_CONFIG if name == "sd3" else module.FLUX_SCHEDULER_CONFIG

    def cfg_scale(config: CheckConfig) -> float:
        # SD3's guidance_scale is CFG; FLUX's guidance_scale is the embedded guidance, its CFG is true_cfg_scale.
        return config.guidance_scale if name == "sd3" else config.true_cfg_scale

    @functools.cache
    def tiny_encoder_of_length(max_length: int) -> Any:
        # Seeded weights, fixed length: built once per worker (not per batch) for the config's max_sequence_length.
        return tiny_encoder(seed=0, max_length=max_length)

    def encoder(path, transformer, device):
        if path is None:
            return None  # `conditioning` takes the tiny encoder of the config's max_sequence_length
        from diffusers import FluxPipeline, StableDiffusion3Pipeline

        pipeline = StableDiffusion3Pipeline if name == "sd3" else FluxPipeline
        return pipeline.from_pretrained(path, transformer=None, vae=None).to(device)

    def conditioning(enc, prompts, config):
        negatives = [""] * len(prompts) if cfg_scale(config) > 1 else None
        if enc is None:
            return tiny_encoder_of_length(config.max_sequence_length).conditioning(list(prompts), negatives)
        out = {}
        for prefix, texts in (("", prompts), ("negative_", negatives)):
            if texts is None:
                continue
            if name == "sd3":
                embeds, _, pooled, _ = enc.encode_prompt(
                    list(texts),
                    None,
                    None,
                    do_classifier_free_guidance=False,
                    max_sequence_length=config.max_sequence_length,
                )
            else:
                embeds, pooled, _ = enc.encode_prompt(list(texts), None, max_sequence_length=config.max_sequence_length)
            out[f"{prefix}prompt_embeds"] = embeds.float().cpu()
            out[f"{prefix}pooled_prompt_embeds"] = pooled.float().cpu()
        return out

    def options(config: CheckConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"height": config.height, "width": config.width}
        if name == "flux":
            out["true_cfg_scale"] = config.true_cfg_scale
        return out

    return FamilyKit(
        name=name,
        load_transformer=lambda path, dtype, device: loader(path, dtype=dtype, device=device, seed=0),
        scheduler_config=lambda path: (
            dict(default_scheduler) if path is None else adapters.load_qwen_image_scheduler_config(path)
        ),
        make_encoder=encoder,
        conditioning=conditioning,
        options=options,
        guidance=lambda c: c.guidance_scale,
        cfg_passes=lambda c: 2 if cfg_scale(c) > 1 else 1,
    )


_KITS: dict[str, Callable[[], FamilyKit]] = {
    "qwen-image": _qwen_image_kit,
    "sd3": lambda: _clip_t5_kit("sd3"),
    "flux": lambda: _clip_t5_kit("flux"),
}


def family_kit(name: str) -> FamilyKit:
    if name not in _KITS:
        raise BackendError(
            f"model family {name!r} is not available to the checker yet (have: {', '.join(sorted(_KITS))})."
        )
    return _KITS[name]()


# ----------------------------------------------------------------------------------------------------
@dataclass
class Backend:
    """A worker's state: both sides' models and what they need. Built once per worker by `build_backend`."""

    config: CheckConfig
    kit: FamilyKit
    family: Any
    rollout_model: Any
    trainer_model: Any
    encoder: Any
    scheduler_setup: Any
    options: dict[str, Any]
    injection: Any
    floor_kernel: str | None
    rollout_engine: Any = None
    precision: Mapping[str, Any] | None = None


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
    try:
        return vllm_omni.VllmOmniRollout.from_check_config(config)
    except (ValueError, FileNotFoundError) as error:
        raise BackendError(f"the vLLM-omni engine cannot start: {error}") from error


def build_backend(config: CheckConfig) -> Backend:
    """Load both sides for `config` (a worker's setup). Identical weights on both sides by construction.

    With the ``torch`` rollout both sides load the same seeded tiny model (or the same `model_path`) and, when
    their dtypes agree, share one module. With ``vllm-omni`` the engine holds its own copy of `model_path`.
    """
    from rollout_consistency import adapters
    from rollout_consistency.adapters.pitfalls import Injection

    engine = load_rollout_engine(config)  # first: a missing package is the first thing to fix
    device = resolve_device(config.device)
    kit = family_kit(config.model_family)
    family = adapters.get_family(config.model_family)
    trainer_model = kit.load_transformer(config.model_path, _dtype(config.trainer_dtype), device)
    if engine is not None:
        rollout_model = None
    elif config.rollout_dtype == config.trainer_dtype:
        rollout_model = trainer_model  # the same module: identical weights, nothing to sync
    else:
        rollout_model = kit.load_transformer(config.model_path, _dtype(config.rollout_dtype), device)
    encoder = kit.make_encoder(config.model_path, trainer_model, device)
    options = kit.options(config)
    setup = family.scheduler_setup(
        kit.scheduler_config(config.model_path), config.num_inference_steps, trainer_model, options
    )
    injection = Injection.from_names([config.inject]) if config.inject else None
    # The engine's precision settings live in its own worker process: audited there, not here.
    precision = None if rollout_model is None else _precision_diff(rollout_model, trainer_model, device)
    return Backend(
        config=config,
        kit=kit,
        family=family,
        rollout_model=rollout_model,
        trainer_model=trainer_model,
        encoder=encoder,
        scheduler_setup=setup,
        options=options,
        injection=injection,
        floor_kernel=floor_kernel(config),
        rollout_engine=engine,
        precision=precision,
    )


def _precision_diff(rollout_model: Any, trainer_model: Any, device: str) -> Mapping[str, Any] | None:
    """The training tools' precision-audit diff of the two sides (None if that module is absent)."""
    try:
        from .precision import audit_precision, diff_precision_reports
    except ImportError:  # pragma: no cover - shipped together; tolerate a partial install
        return None
    rollout = audit_precision(model=rollout_model, autocast_dtype=None, device=device, label="rollout")
    trainer = audit_precision(model=trainer_model, autocast_dtype=None, device=device, label="trainer")
    return diff_precision_reports(rollout, trainer).to_dict()


# ----------------------------------------------------------------------------------------------------
def run_batch(backend: Backend, batch: BatchSpec) -> BatchResult:
    """Roll out one batch and recompute it on the trainer side (a worker's work; see the module docstring)."""
    import torch

    from rollout_consistency.adapters.pitfalls import MixedDtypeBatchError
    from rollout_consistency.schedulers import SDEWindow

    config = backend.config
    samples = batch.samples
    prompts = [s.prompt for s in samples]
    seeds = [s.seed for s in samples]
    groups = [s.prompt_group for s in samples]
    windows = [SDEWindow(s.window_start, s.window_size, config.num_inference_steps) for s in samples]
    guidance = backend.kit.guidance(config)
    cfg_passes = backend.kit.cfg_passes(config)
    seconds, forwards = {}, {}

    start = time.perf_counter()
    with torch.no_grad():
        conditioning = backend.kit.conditioning(backend.encoder, prompts, config)
        with attention(config.rollout_attention):
            try:
                trajectory = _rollout(backend, conditioning, seeds, groups, windows, guidance)
            except MixedDtypeBatchError as error:
                # The stock step-wise path's other symptom: the engine cannot batch the requests at all.
                return _failed_batch(batch, config, f"{batch.describe()}: the rollout engine failed: {error}")
    seconds["rollout"] = time.perf_counter() - start
    last = max(w.stop for w in trajectory.windows)
    forwards["rollout"] = last * cfg_passes

    return score_trajectory(
        backend,
        trajectory,
        batch=batch.index,
        sample_indices=batch.sample_indices,
        seconds=seconds,
        forwards=forwards,
    )


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
    cfg_passes = backend.kit.cfg_passes(config)
    start = time.perf_counter()
    trainer = recompute(backend, trajectory, config.trainer_attention)
    seconds["trainer"] = time.perf_counter() - start
    micro = config.resolved_micro_batch_size
    n_micro = -(-trajectory.batch_size // micro)
    forwards["trainer"] = n_micro * trajectory.window_size * cfg_passes

    floor, floor_tables = None, {}
    if backend.floor_kernel is not None:
        start = time.perf_counter()
        floor = recompute(backend, trajectory, backend.floor_kernel)
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
    )


def _rollout(backend: Backend, conditioning, seeds, groups, windows, guidance):
    from rollout_consistency import adapters

    config = backend.config
    common = dict(
        scheduler_setup=backend.scheduler_setup,
        seeds=seeds,
        window=windows,
        noise_level=config.noise_level,
        sde_type=config.sde_type,
        guidance_scale=guidance,
        options=backend.options,
        prompt_groups=groups,
        global_step=config.global_step,
        injection=backend.injection,
    )
    if backend.rollout_engine is not None:
        # The engine encodes nothing itself here: it gets the conditioning the trainer will re-score.
        return backend.rollout_engine.rollout(
            backend.family,
            None,
            conditioning,
            max_num_seqs=config.max_num_seqs,
            step_execution=config.step_execution,
            **common,
        )
    if config.step_execution:
        return _rollout_stepwise(backend, conditioning, seeds, groups, windows, guidance)
    return adapters.rollout(backend.family, backend.rollout_model, conditioning, denoise_to_end=False, **common)


def _rollout_stepwise(backend: Backend, conditioning, seeds, groups, windows, guidance):
    """The step-wise engine on the batch's requests (`max_num_seqs` running; see `stagger_arrivals`).

    Every request's text is padded to the batch's width and every forward uses that width: the stored
    conditioning then has the width the rollout's forwards had, so the trainer recomputes the same
    computation (a forward padded to another width differs in the last bits).
    """
    from rollout_consistency.adapters import stepwise

    config = backend.config
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
        backend.rollout_model,
        requests,
        scheduler_setup=backend.scheduler_setup,
        noise_level=config.noise_level,
        sde_type=config.sde_type,
        guidance_scale=guidance,
        options=backend.options,
        max_num_seqs=config.max_num_seqs,
        text_width=stepwise.shared_text_width(rows),
        global_step=config.global_step,
        injection=backend.injection,
    )


def recompute(backend: Backend, trajectory: Any, kernel: str) -> np.ndarray:
    """The trainer's log-probs of every stored step, micro-batch by micro-batch: `(B, W)` float32 numpy."""
    import torch

    from rollout_consistency import adapters

    if backend.config.trainer_step_implementation != "reference":
        return recompute_variant(backend, trajectory, kernel=kernel)
    micro = backend.config.resolved_micro_batch_size
    parts = []
    with torch.no_grad(), attention(kernel):
        for start in range(0, trajectory.batch_size, micro):
            part = trajectory.select(range(start, min(start + micro, trajectory.batch_size)))
            parts.append(adapters.recompute_log_probs(backend.trainer_model, part, family=backend.family))
    return torch.cat(parts).detach().cpu().numpy().copy()
