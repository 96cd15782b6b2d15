# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Replay one rollout batch through each side's own code, recording every call of that side's model.

The doctor localises a disagreement by watching the two computations, not by re-implementing them: the side
the user gave the checker — a plug-in's ``rollout(request)`` / ``trainer(batch, micro_batch_size=...)``, or
a built-in backend — runs once more on the batch that holds the worst sample, exactly as the check ran it
(same plan, same seeds, same attention kernel, under ``torch.no_grad()``), while hooks on its transformer
record every forward:

* the inputs (a forward pre-hook): ``hidden_states`` (latents), ``timestep``, ``encoder_hidden_states``
  (text conditioning), ``encoder_hidden_states_mask``, ``txt_seq_lens``, ``guidance``,
  ``pooled_projections`` and any other argument, each with its dtype;
* each transformer block's output (forward hooks; a strided sample of at most `BLOCK_SAMPLE` values per row,
  so a large model's replay stays small) and the model's output (whole: the step outside the model is
  re-derived from it, `rollout_consistency.gate.diagnosis.step_fit`);
* the autocast state the forward ran under and the parameters' dtype.

Nothing of the user's is changed: hooks only, removed in ``finally``; every module's training flag, every
parameter's ``requires_grad`` and the Python, NumPy, torch CPU and CUDA RNG states are restored afterwards
([`preserved_state`]). The sides are built afresh, as the check built them (``build_backend``), so the objects the check
ran are not touched either; a side that exposes no ``model`` cannot be watched, and [`replay_batch`] says so.

Shapes: recorded tensors are float64 on the CPU, row-first ``(rows, -1)``.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .settings import DiagnosisSettings

#: Block outputs keep at most this many values per row (strided): enough to see any difference a kernel,
#: an input or a weight makes, small enough for a large model's replay.
BLOCK_SAMPLE = 1 << 14

#: The transformer keyword arguments the doctor knows by meaning (diffusers' and vLLM-omni's names).
INPUT_NAMES: Mapping[str, str] = {
    "hidden_states": "latents",
    "timestep": "timestep",
    "encoder_hidden_states": "conditioning",
    "encoder_hidden_states_mask": "text_mask",
    "txt_seq_lens": "text_lengths",
    "guidance": "guidance",
    "pooled_projections": "pooled",
}


@dataclass
class ModelCall:
    """One forward of a side's transformer.

    Attributes:
        index: order of the call on its side. rows: the batch size of the forward.
        inputs: ``inputs.<name>`` → ``(rows, -1)`` float64 for per-row tensors, or the whole value (a tensor
            shared by the rows, or a string for non-tensor arguments such as ``img_shapes``).
        input_dtypes: ``inputs.<name>`` → dtype name of the tensor as the model received it.
        blocks: per block, a ``(rows, k)`` float64 sample of its output. output: ``(rows, -1)`` float64, and
            its shape as the model returned it (``output_shape``).
        autocast: the autocast dtype the forward ran under (``None``: no autocast). dtype: the parameters' dtype.
    """

    index: int
    rows: int
    inputs: dict[str, Any] = field(default_factory=dict)
    input_dtypes: dict[str, str] = field(default_factory=dict)
    blocks: list[Any] = field(default_factory=list)
    output: Any = None
    output_shape: tuple[int, ...] = ()
    autocast: str | None = None
    dtype: str = ""


@dataclass
class SideTrace:
    """A side's replay: its label, its model calls in order, and the log-prob table it returned."""

    label: str
    calls: list[ModelCall]
    log_probs: np.ndarray
    seconds: float = 0.0


@dataclass(frozen=True)
class ReplayContext:
    """What the comparison needs to know about the batch and the schedule (from the checker's plan and config).

    Attributes:
        samples: the global sample indices of the batch's rows. window_starts: each row's first SDE step.
        window_size: SDE steps per sample. sigmas: the schedule's ``N + 1`` sigmas (float64, trailing 0).
        noise_level, sde_type: the config's step settings. cfg_scale: the classifier-free guidance scale
        (1: off).
        attention: ``(rollout, trainer)`` attention kernels. rollout_table, trainer_table: the check's own
        tables for these rows (the replay must reproduce them).
    """

    samples: tuple[int, ...]
    window_starts: tuple[int, ...]
    window_size: int
    sigmas: tuple[float, ...]
    noise_level: float
    sde_type: str
    cfg_scale: float
    attention: tuple[str, str]
    rollout_table: np.ndarray | None = None
    trainer_table: np.ndarray | None = None


@dataclass
class Replay:
    """Both sides' replays of one batch and its context (see [`replay_batch`])."""

    rollout: SideTrace
    trainer: SideTrace
    context: ReplayContext
    rollout_model: Any
    trainer_model: Any
    seconds: float = 0.0
    rollout_output: Any = None  # what the rollout returned (the trainer's input), for a second look at one forward
    rng: Mapping[str, Any] = field(default_factory=dict)  # each side's RNG states when its run began (`rng_state`)
    batch: Any = None  # what the rollout handed the trainer (a plug-in's batch dict, or the Trajectory)


# ----------------------------------------------------------------------------------------------------
def core_module(model: Any) -> Any:
    """The module that holds the transformer blocks (a wrapper's inner model: peft, DDP, an injection)."""
    return next((m for m in model.modules() if any(n.endswith("blocks") for n, _ in m.named_children())), model)


def core_names(model: Any) -> list[str]:
    """The names of `model`'s outermost modules that hold transformer blocks: one for a transformer (however
    wrapped), two for Wan 2.2's experts (``transformer``, ``transformer_2``)."""
    cores = [name for name, m in model.named_modules() if any(n.endswith("blocks") for n, _ in m.named_children())]
    return [name for name in cores if not any(name.startswith(f"{other}.") for other in cores if other != name)]


def _blocks(core: Any) -> list[Any]:
    return [block for name, child in core.named_children() if name.endswith("blocks") for block in child]


@contextlib.contextmanager
def preserved_state(models: Sequence[Any]) -> Iterator[None]:
    """Restore, on the way out, every module's training flag, every parameter's ``requires_grad`` and the
    Python, NumPy, torch CPU and CUDA RNG states (a user's code may call ``.train()`` or draw from them)."""

    modules = [m for model in models if model is not None for m in model.modules()]
    training = [(m, m.training) for m in modules]
    grads = [(p, p.requires_grad) for model in models if model is not None for p in model.parameters()]
    rng = rng_state()
    try:
        yield
    finally:
        for module, flag in training:
            module.training = flag
        for parameter, flag in grads:
            parameter.requires_grad_(flag)
        set_rng_state(rng)


def rng_state() -> dict[str, Any]:
    """The Python, NumPy, torch CPU and CUDA RNG states (what a user's code may draw from)."""
    import torch

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back RNG states taken by [`rng_state`]."""
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _watch_point(model: Any) -> tuple[Any, bool]:
    """The module whose forwards are the side's model calls, and whether its blocks can be watched.

    Normally the transformer itself (`core_module`). A batch-invariant proxy
    (`rollout_consistency.adapters.batch_invariance`) is watched as a whole instead: it runs the transformer on
    chunks padded with copies of a row and on probe batches (rows repeated, negated), which are not forwards the
    side asked for; its blocks' outputs come chunk by chunk, so they are not recorded.
    """
    from rollout_consistency.adapters.batch_invariance import is_batch_invariant

    proxy = next((m for m in model.modules() if is_batch_invariant(m)), None)
    return (proxy, False) if proxy is not None else (core_module(model), True)


@contextlib.contextmanager
def record_calls(model: Any, *, block_sample: int = BLOCK_SAMPLE) -> Iterator[list[ModelCall]]:
    """Record every forward of `model`'s transformer while inside (hooks removed on the way out)."""
    import torch

    core, with_blocks = _watch_point(model)
    calls: list[ModelCall] = []
    current: list[ModelCall] = []
    dtype = next((str(p.dtype).replace("torch.", "") for p in core.parameters() if p.is_floating_point()), "")

    def before(_module, args, kwargs):
        values = dict(kwargs)
        if args and "hidden_states" not in values:
            values["hidden_states"] = args[0]
        latents = values.get("hidden_states")
        rows = int(latents.shape[0]) if isinstance(latents, torch.Tensor) and latents.dim() else 1
        call = ModelCall(index=len(calls), rows=rows, dtype=dtype, autocast=_autocast_dtype(latents))
        for name, value in values.items():
            if value is None or name == "return_dict":
                continue
            stage = "inputs." + INPUT_NAMES.get(name, name)
            call.inputs[stage] = _input_value(value, rows)
            if isinstance(value, torch.Tensor):
                call.input_dtypes[stage] = str(value.dtype).replace("torch.", "")
        current[:] = [call]

    def after(_module, _args, _kwargs, output):
        call = current[0]
        value = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        call.output = _rows(value)
        call.output_shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        calls.append(call)

    def block_done(_module, _args, output):
        if current:
            current[0].blocks.append(_row_sample(output, current[0].rows, block_sample))

    handles = [
        core.register_forward_pre_hook(before, with_kwargs=True),
        core.register_forward_hook(after, with_kwargs=True),
    ]
    if with_blocks:
        handles += [block.register_forward_hook(block_done) for block in _blocks(core)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _autocast_dtype(tensor: Any) -> str | None:
    import torch

    device = tensor.device.type if isinstance(tensor, torch.Tensor) else "cpu"
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return None
    return str(torch.get_autocast_dtype(device)).replace("torch.", "")


def _rows(value: Any) -> Any:
    """`(rows, -1)` float64 CPU copy of a tensor (complex as real pairs); None for anything else."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    value = value.detach()
    if value.is_complex():
        value = torch.view_as_real(value)
    value = value.to("cpu", torch.float64)
    return value.reshape(1, 1) if value.dim() == 0 else value.reshape(value.shape[0], -1)


def _input_value(value: Any, rows: int) -> Any:
    """A per-row tensor as `(rows, -1)`, a shared tensor whole (float64), a list of ints as a column, another
    list of one entry per row as the rows' texts, else text."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu")
        if value.dim() and value.shape[0] == rows:
            return _rows(value)
        if value.dim() == 0 or value.numel() == 1:
            return value.to(torch.float64).reshape(1, 1).expand(rows, 1).clone()  # one value for every row
        return ("shared", value.to(torch.float64).reshape(-1))
    if isinstance(value, (list, tuple)) and len(value) == rows and all(isinstance(v, (int, float)) for v in value):
        return torch.tensor(value, dtype=torch.float64).reshape(rows, 1)
    if isinstance(value, (list, tuple)) and len(value) == rows:  # one entry per row (Qwen-Image's img_shapes)
        return ("rows", tuple(repr(v) for v in value))
    return ("text", repr(value))


def _row_sample(value: Any, rows: int, limit: int) -> Any:
    """A strided `(rows, <= limit)` float64 sample of every per-row tensor in a block's output."""
    import torch

    parts = value if isinstance(value, (tuple, list)) else [value]
    flat = [
        p.detach().reshape(rows, -1) for p in parts if isinstance(p, torch.Tensor) and p.dim() and p.shape[0] == rows
    ]
    if not flat:
        return None
    joined = torch.cat([p.float() for p in flat], dim=1)
    stride = max(1, -(-joined.shape[1] // limit))
    return joined[:, ::stride].to("cpu", torch.float64)


# ----------------------------------------------------------------------------------------------------
def replay_batch(settings: DiagnosisSettings, batch_spec: Any, tables: tuple[Any, Any] | None = None) -> Replay | str:
    """Run both sides of the check on `batch_spec` once more with their models watched.

    Returns the [`Replay`], or a sentence saying why the sides cannot be watched (a side without a model, a
    model of several transformers such as Wan 2.2's experts, a vLLM-omni engine in its own process, a
    trajectory file).

    Args:
        settings: the check's `DiagnosisSettings`. batch_spec: the plan's batch holding the worst sample.
        tables: the check's ``(rollout, trainer)`` log-prob tables of this batch, if known (the replay is
            compared with them).
    """
    import torch

    from rollout_consistency.gate.sides import plugins

    start = time.perf_counter()
    sides = watched_sides(settings)
    if isinstance(sides, str):
        return sides
    backend, rollout_model, trainer_model = sides
    context = _context(settings, backend, batch_spec, tables)
    rng: dict[str, Any] = {}
    with preserved_state([rollout_model, trainer_model]), torch.no_grad():
        side_start = time.perf_counter()
        rng["rollout"] = rng_state()
        with record_calls(rollout_model) as calls:
            out = run_rollout(backend, batch_spec)
        rollout = SideTrace("rollout", calls, _table(out.log_probs), time.perf_counter() - side_start)
        side_start = time.perf_counter()
        rng["trainer"] = rng_state()
        with record_calls(trainer_model) as calls:
            table = run_trainer(backend, out, settings)
        trainer = SideTrace("trainer", calls, _table(table), time.perf_counter() - side_start)
    seconds = time.perf_counter() - start
    batch = out.batch if isinstance(out, plugins.PluginRollout) else out
    return Replay(
        rollout, trainer, context, rollout_model, trainer_model, seconds, batch=batch, rollout_output=out, rng=rng
    )


def watched_sides(settings: DiagnosisSettings) -> tuple[Any, Any, Any] | str:
    """Both sides built afresh, as the check built them (`settings.start_sides`): ``(backend, rollout model, trainer model)``, or a sentence saying
    why they cannot be watched."""
    from rollout_consistency.gate.sides import plugins

    if settings.rollout_from_file:
        return "the rollout is a trajectory file: its code is not in this process"
    out_of_process = f"the rollout is a {settings.rollout_backend} engine running in its own process"
    if settings.rollout_backend == "vllm-omni":  # known before starting one (an engine start takes minutes)
        return out_of_process
    backend = settings.start_sides()
    engine = backend.rollout_engine
    if engine is not None and not engine.in_process:  # another registered engine, known once started
        return out_of_process
    sides = backend.plugins
    rollout_model = plugins.side_model(sides.rollout) if sides and sides.rollout else backend.rollout_model
    trainer_model = plugins.side_model(sides.trainer) if sides and sides.trainer else backend.trainer_model
    missing = [label for label, model in (("rollout", rollout_model), ("trainer", trainer_model)) if model is None]
    if missing:
        return (
            f"the {' and '.join(missing)} plug-in exposes no `model` (the nn.Module it samples or scores with): "
            f"set it as an attribute of the object the factory returns so the doctor can watch its forwards"
        )
    for label, model in (("rollout", rollout_model), ("trainer", trainer_model)):
        cores = core_names(model)
        if len(cores) > 1:  # Wan 2.2's experts: a forward may run either or both, which one call per forward misses
            return (
                f"the {label}'s model holds {len(cores)} transformers ({', '.join(cores)}: experts); the replay "
                f"watches one transformer per side"
            )
    return backend, rollout_model, trainer_model


def run_rollout(backend: Any, batch_spec: Any) -> Any:
    """The rollout side of the check on `batch_spec` (its plug-in, or the built-in backend)."""
    from rollout_consistency.gate.sides import plugins
    from rollout_consistency.gate.sides.backends import rollout_trajectory

    if backend.plugins and backend.plugins.rollout:
        return plugins.plugin_rollout(backend, batch_spec)
    return rollout_trajectory(backend, batch_spec)


def run_trainer(backend: Any, out: Any, settings: DiagnosisSettings) -> Any:
    """The trainer side of the check on what the rollout returned (its plug-in, or the built-in backend)."""
    from rollout_consistency.gate.sides import plugins
    from rollout_consistency.gate.sides.trainer import trainer_log_probs

    if isinstance(out, plugins.PluginRollout):
        return plugins.plugin_recompute(backend, out.batch, settings.trainer_attention)
    return trainer_log_probs(backend, out, settings.trainer_attention)


def _table(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def _context(
    settings: DiagnosisSettings, backend: Any, batch_spec: Any, tables: tuple[Any, Any] | None
) -> ReplayContext:
    scheduler = backend.scheduler_setup.scheduler()
    return ReplayContext(
        samples=tuple(batch_spec.sample_indices),
        window_starts=tuple(s.window_start for s in batch_spec.samples),
        window_size=settings.window_size,
        sigmas=tuple(float(s) for s in scheduler.sigmas.double().tolist()),
        noise_level=settings.noise_level,
        sde_type=settings.sde_type,
        cfg_scale=backend.cfg_scale,
        attention=(settings.rollout_attention, settings.trainer_attention),
        rollout_table=None if tables is None else np.asarray(tables[0], dtype=np.float64),
        trainer_table=None if tables is None else np.asarray(tables[1], dtype=np.float64),
    )
