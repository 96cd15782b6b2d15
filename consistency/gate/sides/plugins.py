# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Plug-in backends: the user's own sampling and log-prob code inside the checker's plan.

``rollout_backend`` and ``trainer_backend`` take, besides the built-in names, an object spec
``"package.module:factory"`` (or ``"path/to/file.py:factory"``; `rollout_consistency.safeguards.object_spec`). The
factory is called once per worker (in this process, or on each Ray actor) as ``factory(config=CheckConfig)``
(``config`` only if its signature takes it; the check binds it, `SidesSettings.user_code`: the sides themselves
read only their own settings) and returns the side. Each side may be a function, an object with
the side's method (``rollout`` / ``recompute_log_probs``, preferred over ``__call__``: an ``nn.Module``'s
``__call__`` is its forward) or a callable object (`ACCEPTED_SHAPES`);
``rollout-consistency plugin-template`` writes a working pair. Every call into the plug-in is fenced
(`rollout_consistency.safeguards.fence`): ``sys.exit`` is a usage error naming the call, and each call is bounded by
``user_code_timeout_s``.

**Rollout plug-in** — ``rollout(request: RolloutRequest) -> Trajectory | PluginRollout``, called once per
rollout batch of the plan. The request ([`RolloutRequest`], `rollout_consistency.gate.plugin_request`) carries the plan's per-sample seeds, SDE windows, prompts, prompt
groups, the family's text conditioning of the prompts and the settings. It returns either a validated
float32 `rollout_consistency.adapters.Trajectory` (the built-in trainer can re-score it), or a
[`PluginRollout`]: the rollout's ``(n, W)`` float32 log-prob table, the ``(n, W)`` float32 timesteps, the
seeds and window starts it actually used, and ``batch`` — whatever the trainer plug-in re-scores (e.g. a
flow_grpo ``samples`` dict).

**Trainer plug-in** — ``recompute_log_probs(batch, *, micro_batch_size: int) -> (n, W) float32`` (torch tensor or
numpy; ``micro_batch_size`` is passed only when the signature takes it):
the log-probs of every stored window step. For a `Trajectory` the checker cuts the plan's micro-batches
itself (``batch`` is one micro-batch of ``micro_batch_size`` rows); a ``PluginRollout.batch`` is passed
whole and the plug-in cuts micro-batches of ``micro_batch_size``. Called under ``torch.no_grad()`` and the
configured attention kernel.

Optional attributes of either side:

* ``model`` — the ``torch.nn.Module`` whose weights the side samples or scores with: the report records a
  fingerprint of each side's weights (`weights_fingerprint`) and flags a mismatch; the step-2 check
  (`rollout_consistency.gate.sides.weight_sync`) watches it change.
* trainer ``train_step(batches, *, old_log_probs, advantages, micro_batch_size, learning_rate, clip_ratio)``
  — one optimizer update on its real loss, for the step-2 weight-sync check (see that module).
* trainer ``experts(batch)`` — for a model with experts by timestep (Wan 2.2), the expert it scores each stored
  step with (one tuple of names per sample), compared with the rollout's record by the ``experts`` guard;
  ``None`` when the model has none.

Plug-in output is checked like built-in output: seeds and windows against the plan, float32 only, shapes,
finiteness. A plug-in that returns something else raises [`PluginError`] (a usage error, exit 2) naming the
fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rollout_consistency.gate.backend_registry import is_plugin_spec
from rollout_consistency.gate.config import ConfigError
from rollout_consistency.gate.judging.verdict import unscorable_reason
from rollout_consistency.gate.plugin_request import RolloutRequest
from rollout_consistency.safeguards.fence import UserCodeError, fenced
from rollout_consistency.safeguards.object_spec import SpecError, call_with_supported_kwargs, load_object

from .settings import SidesSettings

if TYPE_CHECKING:  # pragma: no cover
    from .plan import BatchSpec
    from .shared import Backend, BatchResult

__all__ = [
    "PluginError",
    "PluginRollout",
    "RolloutPlugin",
    "RolloutRequest",
    "TrainerPlugin",
    "compare_fingerprints",
    "is_plugin_spec",
    "load_plugin",
    "weights_fingerprint",
]


class PluginError(ConfigError):
    """A plug-in backend that cannot be loaded or returned something outside the protocol."""


@dataclass(frozen=True)
class PluginRollout:
    """A rollout plug-in's output when it has no `Trajectory`: its own log-prob table and batch object.

    Attributes:
        log_probs: ``(n, W)`` float32 (numpy or torch): the log-prob of each stored SDE step, in window order.
        timesteps: ``(n, W)`` float32: the timestep of each stored step.
        seeds: the seed each sample was drawn with (checked against the plan).
        window_starts: the first SDE step of each sample's window (checked against the plan).
        prompt_groups: each sample's prompt group (checked against the plan).
        batch: what the trainer plug-in re-scores (passed to it as is).
        experts: for a model with experts by timestep (Wan 2.2), the expert that took each stored step, one
            tuple of names per sample (compared with the trainer plug-in's ``experts(batch)``); None otherwise.
    """

    log_probs: Any
    timesteps: Any
    seeds: tuple[int, ...]
    window_starts: tuple[int, ...]
    prompt_groups: tuple[int, ...]
    batch: Any = None
    experts: Any = None


class RolloutPlugin(Protocol):
    def __call__(self, request: RolloutRequest) -> Any: ...


class TrainerPlugin(Protocol):
    def __call__(self, batch: Any, *, micro_batch_size: int) -> Any: ...


#: The shapes a side may take, shown in the error when the factory returned something else.
ACCEPTED_SHAPES = {
    "rollout": "a function rollout(request), or an object with a rollout(request) method (or __call__)",
    "trainer": "a function trainer(batch, *, micro_batch_size), or an object with a "
    "recompute_log_probs(batch, *, micro_batch_size) method (or __call__)",
}
#: The method each side's object may carry instead of ``__call__`` (preferred when both exist: an nn.Module's
#: ``__call__`` is its forward). Not ``compute_log_prob``: flow_grpo's function of that name scores one timestep
#: with another signature, and a trainer object may well carry it as a helper.
METHODS = {"rollout": "rollout", "trainer": "recompute_log_probs"}

_EXAMPLES = {
    "rollout": """
    class MyRollout:                              # rollout_backend = "my_loop.py:make_rollout"
        def __init__(self, config): self.pipeline = load_my_pipeline(config)
        def rollout(self, request):               # RolloutRequest -> Trajectory | PluginRollout
            return my_sample_with_logprob(self.pipeline, request)
    def make_rollout(config): return MyRollout(config)""",
    "trainer": """
    class MyTrainer:                              # trainer_backend = "my_loop.py:make_trainer"
        def __init__(self, config): self.transformer = load_my_policy(config)
        def recompute_log_probs(self, samples, *, micro_batch_size):   # -> (n, W) float32
            return my_compute_log_probs(self.transformer, samples, micro_batch_size)
    def make_trainer(config): return MyTrainer(config)""",
}


@dataclass
class PluginSides:
    """A worker's plug-in sides (None where the side is built in).

    Attributes:
        rollout, trainer: the objects the factories returned (their ``model``, ``train_step`` are read here).
        specs: side -> spec. timeout_s: `ExecutionSettings.user_code_timeout_s`, the bound on each call.
    """

    rollout: Any = None
    trainer: Any = None
    specs: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None

    def call_rollout(self, request: RolloutRequest) -> Any:
        """The rollout plug-in on one request, fenced (`rollout_consistency.safeguards.fence`)."""
        call, takes = _resolve_call(self.rollout, "rollout")
        what = f"{takes}(request) on rollout batch {request.batch}"
        with _naming_errors(self.owner("rollout"), what), fenced(self.owner("rollout"), what, timeout_s=self.timeout_s):
            return call(request)

    def call_trainer(self, batch: Any, micro_batch_size: int) -> Any:
        """The trainer plug-in on one batch, fenced; ``micro_batch_size`` only when its signature takes it."""
        call, takes = _resolve_call(self.trainer, "trainer")
        what = f"{takes}(batch, micro_batch_size={micro_batch_size})"
        with _naming_errors(self.owner("trainer"), what), fenced(self.owner("trainer"), what, timeout_s=self.timeout_s):
            return call_with_supported_kwargs(
                call, optional={"micro_batch_size": micro_batch_size}, positional=(batch,)
            )

    def owner(self, side: str) -> str:
        return f"{side}_backend {self.specs[side]!r}"


@contextlib.contextmanager
def _naming_errors(owner: str, what: str) -> Iterator[None]:
    """An exception of the user's call as a usage error (exit 2) naming the plug-in and the call: the user's
    bug, not ours (`--debug` still shows its traceback). Out-of-memory keeps its own message."""
    try:
        yield
    except (UserCodeError, MemoryError):
        raise
    except Exception as error:
        text = str(error).strip().splitlines()
        raise UserCodeError(
            f"{owner}: {what} raised {type(error).__name__}{': ' + text[0] if text else ''} "
            "(your code; --debug shows the traceback)"
        ) from error


def _resolve_call(plugin: Any, side: str) -> tuple[Any, str]:
    """(the callable to use, how it is called in messages) for a side's object (see `ACCEPTED_SHAPES`)."""
    method = getattr(plugin, METHODS[side], None)
    if callable(method):
        return method, f"{type(plugin).__name__}.{METHODS[side]}"
    return plugin, getattr(plugin, "__name__", type(plugin).__name__)


def load_plugin(spec: str, settings: SidesSettings, side: str) -> Any:
    """Import the factory named by `spec` and build the `side` (``"rollout"``/``"trainer"``) plug-in.

    The import, the factory call and every later call into the plug-in are fenced (`rollout_consistency.safeguards.fence`):
    a ``sys.exit`` in them is a usage error, and each is bounded by ``user_code_timeout_s``. The factory receives
    the `CheckConfig` (``config``, where its signature takes it) through `SidesSettings.user_code`. The file
    of a ``file.py:factory`` spec is imported once per process with its folder importable
    (`rollout_consistency.safeguards.object_spec`), so a rollout and a trainer in one file share its module state.

    Raises:
        PluginError: the spec cannot be resolved, the factory fails to accept ``config``, or it returns
            something that is none of the `ACCEPTED_SHAPES` (the message shows a 5-line example).
        rollout_consistency.safeguards.fence.UserCodeError: the import or the factory raised SystemExit or overran.
    """
    owner = f"{side}_backend {spec!r}"
    timeout = settings.execution.user_code_timeout_s
    try:
        factory = load_object(spec, owner=owner, timeout_s=timeout)
        with fenced(owner, "the factory", timeout_s=timeout):
            plugin = settings.user_code.plugin_factory(factory)
    except SpecError as error:
        raise PluginError(f"{owner}: {error}") from error
    if not callable(getattr(plugin, METHODS[side], None)) and not callable(plugin):
        raise PluginError(
            f"{owner}: the factory returned a {type(plugin).__name__}, which is not a {side}; return "
            f"{ACCEPTED_SHAPES[side]}. For example:\n" + _EXAMPLES[side]
        )
    return plugin


def build_sides(settings: SidesSettings) -> PluginSides | None:
    """The plug-in sides `settings` name (None when both sides are built in)."""
    execution = settings.execution
    specs = {
        side: name
        for side, name in (("rollout", execution.rollout_backend), ("trainer", execution.trainer_backend))
        if is_plugin_spec(name)
    }
    if not specs:
        return None
    return PluginSides(
        rollout=load_plugin(specs["rollout"], settings, "rollout") if "rollout" in specs else None,
        trainer=load_plugin(specs["trainer"], settings, "trainer") if "trainer" in specs else None,
        specs=specs,
        timeout_s=execution.user_code_timeout_s,
    )


def side_model(plugin: Any) -> Any:
    """The ``nn.Module`` a plug-in exposes as ``model`` (None if it exposes none)."""
    model = getattr(plugin, "model", None)
    return model if hasattr(model, "state_dict") else None


# ----------------------------------------------------------------------------------------------------
# The batch: the plug-in rollout inside the plan, then the trainer (plug-in or built in).
def make_request(backend: Backend, batch: BatchSpec, conditioning: Mapping[str, Any]) -> RolloutRequest:
    from rollout_consistency.schedulers import SDEWindow

    settings = backend.settings
    samples = batch.samples
    steps = settings.sampling.num_inference_steps
    return settings.user_code.rollout_request(  # the request's `config`: the CheckConfig, bound by the check
        RolloutRequest,
        batch=batch.index,
        sample_indices=batch.sample_indices,
        seeds=tuple(s.seed for s in samples),
        prompts=tuple(s.prompt for s in samples),
        prompt_groups=tuple(s.prompt_group for s in samples),
        windows=tuple(SDEWindow(s.window_start, s.window_size, steps) for s in samples),
        conditioning=conditioning,
        scheduler_setup=backend.scheduler_setup,
        family=backend.family,
        options=dict(backend.options),
        guidance_scale=backend.guidance,
    )


def plugin_rollout(backend: Backend, batch: BatchSpec) -> Any:
    """Run the rollout plug-in on one batch: a validated `Trajectory` or a checked `PluginRollout`."""
    import torch

    from rollout_consistency.adapters import Trajectory

    from .shared import encode_prompts

    with torch.no_grad():
        conditioning = encode_prompts(backend, [s.prompt for s in batch.samples])
    request = make_request(backend, batch, conditioning)
    from .shared import attention

    with attention(backend.settings.model.rollout_attention):
        out = backend.plugins.call_rollout(request)
    spec = backend.plugins.specs["rollout"]
    if isinstance(out, Trajectory):
        try:
            return out.validate()
        except (ValueError, TypeError) as error:
            raise PluginError(f"rollout_backend {spec!r} returned an invalid Trajectory: {error}") from error
    if not isinstance(out, PluginRollout):
        raise PluginError(
            f"rollout_backend {spec!r} returned a {type(out).__name__}; return a rollout_consistency.adapters."
            f"Trajectory or a rollout_consistency.gate.PluginRollout."
        )
    n = len(batch.samples)
    for name in ("seeds", "window_starts", "prompt_groups"):
        if len(getattr(out, name)) != n:
            raise PluginError(
                f"rollout_backend {spec!r}: PluginRollout.{name} has {len(getattr(out, name))} entries for {n} samples."
            )
    return out


def as_float32_table(value: Any, what: str) -> np.ndarray:
    """A ``(n, W)`` float32 numpy copy of a tensor/array; PluginError for any other dtype or rank."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise PluginError(
                f"{what} is {value.dtype}; return float32 log-probs (a bf16 table has lost the digits compared)."
            )
        value = value.detach().cpu().numpy()
    value = np.asarray(value)
    if value.dtype != np.float32:
        raise PluginError(
            f"{what} is {value.dtype}; return float32 log-probs (a bf16 table has lost the digits compared)."
        )
    if value.ndim != 2:
        raise PluginError(f"{what} has shape {value.shape}; return (samples, window steps).")
    return value.copy()


def trainer_log_probs(sides: PluginSides, batch: Any, micro_batch_size: int) -> np.ndarray:
    """The trainer plug-in's ``(n, W)`` float32 log-probs of `batch` (a Trajectory is cut into micro-batches).

    Raises:
        SharedTableError: an output shares memory with a tensor of what the plug-in was given (it returned the
            rollout's stored log-probs, or a view of them); the error keeps the table.
    """
    import torch

    from rollout_consistency.adapters import Trajectory

    from .rollout_seal import aliased
    from .shared import SharedTableError

    what = f"{sides.owner('trainer')} output"
    whole = not isinstance(batch, Trajectory)
    starts = [0] if whole else range(0, batch.batch_size, micro_batch_size)
    parts, shared = [], []
    with torch.no_grad():
        for start in starts:  # one micro-batch at a time: each selected copy is freed after its call
            piece = batch if whole else batch.select(range(start, min(start + micro_batch_size, batch.batch_size)))
            output = sides.call_trainer(piece, micro_batch_size)
            shared += aliased(output, piece, "batch" if whole else "micro_batch")
            parts.append(as_float32_table(output, what))
    table = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if shared:
        raise SharedTableError(f"{sides.owner('trainer')}: {shared[0]}", table)
    return table


def plugin_recompute(backend: Backend, batch: Any, kernel: str) -> np.ndarray:
    """`backends.recompute` for a trainer plug-in: its log-probs under attention kernel `kernel`."""
    from .shared import attention

    with attention(kernel):
        return trainer_log_probs(backend.plugins, batch, backend.settings.execution.micro_batch_size)


def plugin_trainer_experts(backend: Backend, batch: Any, shape: tuple[int, ...]) -> tuple[tuple[str, ...], ...] | None:
    """The trainer plug-in's optional ``experts(batch)`` (one name per stored step), checked against `shape`."""
    sides = backend.plugins
    report = getattr(sides.trainer, "experts", None)
    if report is None:
        return None
    with fenced(sides.owner("trainer"), "experts(batch)", timeout_s=sides.timeout_s):
        rows = report(batch)
    if rows is None:  # this trainer's model has no experts by timestep
        return None
    names = tuple(tuple(str(n) for n in row) for row in rows)
    if len(names) != shape[0] or any(len(row) != shape[1] for row in names):
        raise PluginError(
            f"trainer_backend {backend.plugins.specs['trainer']!r}: experts(batch) must give one name per stored "
            f"step, {shape[0]} rows of {shape[1]}; got {[len(row) for row in names]}."
        )
    return names


def plugin_experts(backend: Backend, out: PluginRollout) -> dict[str, Any] | None:
    """`BatchResult.experts` for a rollout plug-in's `PluginRollout` re-scored by a trainer plug-in."""
    rollout = None if out.experts is None else tuple(tuple(str(n) for n in row) for row in out.experts)
    trainer = plugin_trainer_experts(backend, out.batch, np.shape(out.log_probs))
    if rollout is None and trainer is None:
        return None
    return {"rollout": rollout, "trainer": trainer}


def run_plugin_batch(backend: Backend, batch: BatchSpec) -> BatchResult:
    """`backends.run_batch` with a rollout plug-in: its output, re-scored by the (plug-in or built-in) trainer."""
    from rollout_consistency.schedulers import TimestepNotInScheduleError

    from .rollout_seal import recompute_checked, seal, seal_problems
    from .shared import BatchResult
    from .trainer import score_trajectory

    start = time.perf_counter()
    out = plugin_rollout(backend, batch)
    seconds = {"rollout": time.perf_counter() - start}
    if not isinstance(out, PluginRollout):
        return score_trajectory(backend, out, batch=batch.index, sample_indices=batch.sample_indices, seconds=seconds)
    if backend.plugins.trainer is None:
        raise PluginError(
            f"rollout_backend {backend.plugins.specs['rollout']!r} returned a PluginRollout (a log-prob table), "
            f"which the built-in trainer cannot re-score: return a Trajectory, or set trainer_backend to your own "
            f"'package.module:factory'."
        )
    spec = backend.plugins.specs["rollout"]
    # Sealed before the trainer (user code) sees the batch: the tables compared are the rollout's as it made them.
    sealed = seal(
        as_float32_table(out.log_probs, f"rollout_backend {spec!r} log_probs"),
        as_float32_table(out.timesteps, f"rollout_backend {spec!r} timesteps"),
        out,
        "rollout",
    )
    start = time.perf_counter()
    try:
        trainer, aliases = recompute_checked(backend, out.batch, backend.settings.model.trainer_attention)
        findings, scored = [("distinct", message) for message in aliases], True
    except UserCodeError as error:
        if not isinstance(error.__cause__, TimestepNotInScheduleError):
            raise
        # The two sides' schedules disagree: a FAIL of the gate, not a usage error. Nothing was scored (NaN).
        trainer = np.full_like(sealed.log_probs, np.nan)
        reason = unscorable_reason(backend.plugins.owner("trainer"), error.__cause__.missing, error.__cause__.schedule)
        findings, scored = [("schedule", reason)], False
    seconds["trainer"] = time.perf_counter() - start
    floor = None
    if backend.floor_kernel is not None and not scored:
        floor = trainer  # nothing scored: no floor to measure either
    elif backend.floor_kernel is not None:
        start = time.perf_counter()
        floor, _ = recompute_checked(backend, out.batch, backend.floor_kernel)
        seconds["floor"] = time.perf_counter() - start
    experts = plugin_experts(backend, out)  # user code too (a plug-in's experts(batch)): before the seal is checked
    findings += [("distinct", message) for message in seal_problems(sealed)]
    return BatchResult(
        batch=batch.index,
        sample_indices=batch.sample_indices,
        rollout_log_probs=sealed.log_probs,
        trainer_log_probs=trainer,
        floor_log_probs=floor,
        timesteps=sealed.timesteps,
        window_starts=tuple(int(s) for s in out.window_starts),
        prompt_groups=tuple(int(g) for g in out.prompt_groups),
        seeds=tuple(int(s) for s in out.seeds),
        seconds=seconds,
        precision=backend.precision,
        weights=backend.weights,
        experts=experts,
        findings=tuple(findings),
    )


# ----------------------------------------------------------------------------------------------------
# Weight fingerprints.


def weights_fingerprint(module: Any) -> dict[str, Any] | None:
    """A cheap fingerprint of `module.state_dict()` (None for None).

    ``layout``: SHA-256 over every tensor's name, dtype and shape in name order. ``sha256``: SHA-256 over
    the values — byte for byte for tensors up to 2**20 elements; for larger ones a strided sample of 2**16
    elements plus the float64 sum and 2-norm computed on the tensor's device (so a 20B-parameter model is
    not copied to the host; ``exact`` is then False: a change that preserves the sample, the sum and the
    norm would go unseen, which no optimizer step does). ``tensors``, ``elements``: counts.
    """
    import torch

    from .rollout_seal import value_bytes

    if module is None:
        return None
    state = module.state_dict()
    layout, values = hashlib.sha256(), hashlib.sha256()
    exact, elements = True, 0
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        layout.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        elements += tensor.numel()
        data, whole = value_bytes(tensor)
        values.update(data)
        exact = exact and whole
    return {
        "sha256": values.hexdigest(),
        "layout": layout.hexdigest(),
        "tensors": len(state),
        "elements": elements,
        "exact": exact,
    }


def compare_fingerprints(weights: Mapping[str, Any] | None) -> tuple[list[str], list[str]]:
    """(problems, notes) for a report's ``run["weights"]`` = ``{"rollout": fp, "trainer": fp}``.

    Same layout (names, dtypes, shapes) but other values: the two sides hold different weights — a problem.
    Other layouts (another dtype, a LoRA wrapper's names, an engine's own module): not comparable — a note.
    """
    if not weights:
        return [], []
    rollout, trainer = weights.get("rollout"), weights.get("trainer")
    if rollout is None or trainer is None:
        missing = [side for side, fp in (("rollout", rollout), ("trainer", trainer)) if fp is None]
        return [], [f"weights: no fingerprint for the {' and '.join(missing)} side (it exposes no model)"]
    if rollout["layout"] != trainer["layout"]:
        return [], [
            f"weights: rollout ({rollout['tensors']} tensors) and trainer ({trainer['tensors']} tensors) have "
            f"other tensor names, dtypes or shapes; their values were not compared"
        ]
    if rollout["sha256"] != trainer["sha256"]:
        return [
            f"the rollout and the trainer hold different weights (sha256 {rollout['sha256'][:12]} vs "
            f"{trainer['sha256'][:12]}, same names, dtypes and shapes): load the same checkpoint on both sides"
        ], []
    return [], [f"weights: rollout and trainer identical (sha256 {rollout['sha256'][:12]})"]


def fingerprints(rollout_model: Any, trainer_model: Any) -> dict[str, Any]:
    """``{"rollout": fp | None, "trainer": fp | None}``; a shared module is hashed once."""
    trainer = weights_fingerprint(trainer_model)
    rollout = trainer if rollout_model is trainer_model else weights_fingerprint(rollout_model)
    return {"rollout": rollout, "trainer": trainer}
