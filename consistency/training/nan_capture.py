# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Capture the first training step with non-finite gradients, and replay it exactly.

A framework-free hook for a PyTorch training loop. Before each optimizer step it checks all
gradients with one fused multi-tensor reduction (no per-parameter `.item()`); on the first
non-finite gradient it saves, atomically, everything needed to re-run that step — the weights
before the update, the optimizer state, the input batch, the step index and the global RNG states
(Python, NumPy, torch CPU, CUDA when initialised) as they were when the step began — and stops the
run with a message naming the file. `replay` restores all of it and re-runs the step::

    from rollout_consistency.training.nan_capture import NanCapture, replay

    def forward_backward(batch):            # the same code in training and in replay
        loss = compute_loss(model, batch)
        loss.backward()
        return loss

    capture = NanCapture(model, optimizer, directory="nan_captures")
    for step, batch in enumerate(loader):
        capture.begin_step(step)            # before anything of this step draws a random number
        optimizer.zero_grad()
        forward_backward(batch)
        capture.check(batch)                # raises NonFiniteGradientError after saving
        optimizer.step()

    # later, in a fresh process with the same code:
    result = replay("nan_captures/nonfinite-step00000042.pt", forward_backward, model=model, optimizer=optimizer)
    assert result.grads_bitwise_equal

Guarantees: the capture holds the state before the update (the non-finite step is never applied);
the file appears complete or not at all (temporary file in the same directory, fsync, `os.replace`);
a failed write leaves no partial file and does not touch the model or optimizer; on the CPU, replay
reproduces the captured gradients bit for bit (on a GPU, with deterministic algorithms enabled).

Not guaranteed: RNG draws from generator objects your code owns (`torch.Generator`,
`np.random.Generator`), DataLoader workers' state (the batch itself is saved instead), sharded
(FSDP/DeepSpeed) state dicts, and the overflow steps of fp16 training with `GradScaler` — those are
non-finite by design and would be captured too (check with bf16 or fp32, or skip the hook there).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from rollout_consistency.training.rng_state import (
    RngState,
    capture_rng_state,
    restore_rng_state,
    rng_state_from_dict,
    rng_state_to_dict,
)

from .capture_file import CaptureFormatError, read_checked, write_checked

__all__ = [
    "CaptureDirectoryError",
    "CaptureWriteError",
    "NanCapture",
    "NanCaptureRecord",
    "NonFiniteGradientError",
    "ReplayResult",
    "bitwise_equal",
    "grads_are_finite",
    "grads_are_finite_inf_norm",
    "grads_are_finite_stacked",
    "load_capture",
    "nan_capture_callback",
    "replay",
]

CAPTURE_FORMAT = "rollout-consistency/nan-capture"
#: 2: a one-line JSON header (format, version, sha256 and size of the payload) before the torch.save payload.
CAPTURE_VERSION = 2


class NonFiniteGradientError(RuntimeError):
    """A training step produced non-finite gradients; the step was captured to `path`.

    Attributes:
        step: the step index passed to `NanCapture.begin_step`.
        path: the capture file (`None` for the subclass `CaptureWriteError`).
        parameters: names of the parameters whose gradients are not finite.
    """

    def __init__(self, message: str, *, step: int, path: Path | None, parameters: tuple[str, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.parameters = parameters


class CaptureWriteError(NonFiniteGradientError):
    """Non-finite gradients were found but the capture could not be written (disk full, no permission).

    No partial file is left behind, and the model and optimizer are untouched: the non-finite step
    was not applied. The underlying `OSError` is chained as `__cause__`.
    """


class CaptureDirectoryError(OSError):
    """The capture directory cannot be created or written; raised by `NanCapture(...)` at start-up."""


# ----------------------------------------------------------------------------------------------
# the fused finiteness check


def grads_are_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite. One host sync per device on the fast path.

    Fast path: one multi-tensor reduction per device, the 2-norms of all tensors
    (`torch._foreach_norm`, the kernel `clip_grad_norm_` uses), then one `isfinite().all()` over the
    stacked norms. A NaN or inf element always makes its norm NaN or inf, so a finite result proves
    every tensor finite. The converse can fail only by overflow (squares of finite values beyond
    float range); a non-finite norm is therefore confirmed element-wise before the answer is False.
    On a CPU this is ~20x cheaper than the inf-norm and isfinite() alternatives
    (scripts/bench_nan_capture.py prints all three).

    Args:
        tensors: floating-point tensors of any shapes, dtypes and devices (sparse ones allowed).
    """
    groups = _by_device(tensors)
    if all(bool(torch.stack(torch._foreach_norm(group, 2.0)).isfinite().all()) for group in groups):
        return True
    return all(_exactly_finite(group) for group in groups)  # a non-finite norm may be overflow: confirm


def _by_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_sparse:
            tensor = tensor.coalesce().values()
        if tensor.numel():
            by_device.setdefault(tensor.device, []).append(tensor)
    return list(by_device.values())


def _exactly_finite(group: list[torch.Tensor]) -> bool:
    return bool(torch.stack([tensor.isfinite().all() for tensor in group]).all())


def grads_are_finite_inf_norm(tensors: Sequence[torch.Tensor]) -> bool:
    """`grads_are_finite`'s alternative (benchmarked beside it): exact single pass with the inf-norm (max |x|)."""
    return all(
        bool(torch.stack(torch._foreach_norm(group, math.inf)).isfinite().all()) for group in _by_device(tensors)
    )


def grads_are_finite_stacked(tensors: Sequence[torch.Tensor]) -> bool:
    """Exact, per-tensor isfinite().all() stacked: confirms a non-finite norm (also benchmarked)."""
    return all(_exactly_finite(group) for group in _by_device(tensors))


# ----------------------------------------------------------------------------------------------
# capturing


class NanCapture:
    """Hook for a training loop: `begin_step(step)` before the forward, `check(batch)` before `optimizer.step()`.

    Args:
        model: the module being trained; its `named_parameters()` with `requires_grad` are checked and its
            `state_dict()` is saved.
        optimizer: saved with `state_dict()` when given (recommended; replay restores it).
        directory: where the capture file goes; created if missing. Checked for writability here, so
            that a bad directory fails at start-up rather than at the moment of the NaN. A clean run
            leaves it empty.
        stop: raise `NonFiniteGradientError` after the capture (default). With `stop=False`, `check`
            returns False instead, and the caller must skip the update (e.g. `optimizer.zero_grad()`
            and continue); only the first non-finite step is captured.

    Raises:
        CaptureDirectoryError: `directory` cannot be created or written.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        directory: str | os.PathLike[str] = "nan_captures",
        *,
        stop: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.directory = Path(directory)
        self.stop = stop
        self.captured_path: Path | None = None
        self._params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._step: int | None = None
        self._rng: RngState | None = None
        _probe_writable(self.directory)

    def begin_step(self, step: int) -> None:
        """Mark the start of step `step`: snapshot the RNG states (about 60 µs on a CPU).

        Call it before anything of this step draws a random number (dropout, noise, augmentation).
        """
        self._step = step
        self._rng = capture_rng_state()

    def check(self, batch: Any, *, grad_norm: torch.Tensor | float | None = None) -> bool:
        """Check the gradients; on the first non-finite one, capture the step.

        Args:
            batch: the input of this step exactly as `step_fn` will take it in replay (tensors, or lists,
                tuples and dicts of them; other objects need `trust_pickle=True` at load time).
            grad_norm: the total norm of *all* the model's gradients if the loop already computed it, i.e.
                the return value of `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` called before
                `check`. A finite total norm proves every gradient finite, so the check then costs no pass
                over the gradients; a non-finite one is confirmed element-wise. (Clipping then belongs to
                the step: put it in the `step_fn` you replay with.)

        Returns:
            True when all gradients are finite (go on with `optimizer.step()`); False when they are not and
            `stop=False`.

        Raises:
            NonFiniteGradientError: non-finite gradients, captured (with `stop=True`).
            CaptureWriteError: non-finite gradients, and the capture could not be written (always raised).
            RuntimeError: `begin_step` was not called for this step, or no parameter has a gradient (nothing
                would be checked: call it after the backward).
        """
        if self._rng is None or self._step is None:
            raise RuntimeError("call capture.begin_step(step) at the start of every step, before the forward")
        grads = [p.grad for _, p in self._params if p.grad is not None]
        if not grads:  # nothing to check is not "all finite"
            raise RuntimeError(
                f"capture.check found no gradient on any of the model's {len(self._params)} trainable parameters: "
                "call it after loss.backward() and before optimizer.step() (and before zero_grad)"
            )
        step, rng = self._step, self._rng
        self._rng = None  # each snapshot serves one check
        if grad_norm is None:
            finite = grads_are_finite(grads)
        else:
            finite = math.isfinite(float(grad_norm)) or grads_are_finite_stacked(grads)
        if finite:
            return True
        if self.captured_path is not None:
            return False  # stop=False and already captured the first one
        bad = tuple(name for name, p in self._params if p.grad is not None and not grads_are_finite([p.grad]))
        try:
            payload = {**self._payload(step, rng, batch, bad), "grad_norm_given": grad_norm is not None}
            path = _atomic_save(payload, self.directory, f"nonfinite-step{step:08d}.pt")
        except OSError as error:
            raise CaptureWriteError(
                f"non-finite gradients at step {step} in {len(bad)} parameter(s) ({_names(bad)}), but the capture "
                f"could not be written to {self.directory}: {error}. Nothing was left behind and the update was not "
                "applied: the model and optimizer are as they were before this step. Free disk space or pass "
                "another directory to NanCapture(directory=...).",
                step=step,
                path=None,
                parameters=bad,
            ) from error
        self.captured_path = path
        if not self.stop:
            return False
        raise NonFiniteGradientError(
            f"non-finite gradients at step {step} in {len(bad)} parameter(s) ({_names(bad)}). Captured the weights "
            f"before the update, optimizer state, batch and RNG states to {path}; reproduce the step with "
            f"rollout_consistency.training.nan_capture.replay({str(path)!r}, step_fn, model=model, optimizer=optimizer).",
            step=step,
            path=path,
            parameters=bad,
        )

    def _payload(self, step: int, rng: RngState, batch: Any, bad: tuple[str, ...]) -> dict[str, Any]:
        return {
            "format": CAPTURE_FORMAT,
            "version": CAPTURE_VERSION,
            "step": step,
            "model_state": self.model.state_dict(),
            "optimizer_state": None if self.optimizer is None else self.optimizer.state_dict(),
            "batch": batch,
            "rng": rng_state_to_dict(rng),
            "grads": {name: p.grad for name, p in self._params if p.grad is not None},
            "nonfinite_parameters": list(bad),
            "torch_version": str(torch.__version__),
        }


def _names(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def _probe_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise CaptureDirectoryError(
            error.errno,
            f"the NaN-capture directory {directory} is not writable ({error}); pass a writable directory to "
            "NanCapture(directory=...)",
        ) from error


def _serialize(payload: dict[str, Any], file: BinaryIO) -> None:
    write_checked(payload, file, CAPTURE_FORMAT, CAPTURE_VERSION)


def _atomic_save(payload: dict[str, Any], directory: Path, filename: str) -> Path:
    """Write to a temporary file in `directory`, fsync, then rename into place; never a partial file."""
    fd, temporary = tempfile.mkstemp(prefix=".nan-capture-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            _serialize(payload, file)
            file.flush()
            os.fsync(file.fileno())
        final = _unused_path(directory, filename)
        os.replace(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)
    return final


def _unused_path(directory: Path, filename: str) -> Path:
    # Never overwrite an earlier capture (e.g. of a previous run that failed at the same step).
    path = directory / filename
    stem, suffix = path.stem, path.suffix
    index = 1
    while path.exists():
        path = directory / f"{stem}.{index}{suffix}"
        index += 1
    return path


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable; not possible on every platform/filesystem, and the file is complete anyway.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# loading and replaying


@dataclass(frozen=True)
class NanCaptureRecord:
    """Contents of a capture file.

    Attributes:
        step: step index. model_state / optimizer_state: state dicts before the update (optimizer_state
        None when no optimizer was given). batch: the input batch. rng: RNG states at the start of the
        step. grads: the captured gradients by parameter name. nonfinite_parameters: names of the
        non-finite ones. torch_version: torch that wrote the file.
    """

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    batch: Any
    rng: RngState
    grads: dict[str, torch.Tensor]
    nonfinite_parameters: tuple[str, ...]
    torch_version: str
    grad_norm_given: bool = False


def load_capture(
    path: str | os.PathLike[str], *, map_location: Any = None, trust_pickle: bool = False
) -> NanCaptureRecord:
    """Read a capture file.

    Args:
        path: file written by `NanCapture`.
        map_location: as for `torch.load` (default: tensors come back on the device they were saved from).
        trust_pickle: load with `weights_only=False`, needed when the batch holds objects other than tensors
            and containers; only for files you trust (unpickling can run code).

    Raises:
        ValueError: not a capture file, an unsupported version, or objects that need `trust_pickle=True`.
    """

    payload = read_checked(path, CAPTURE_FORMAT, CAPTURE_VERSION)  # CaptureFormatError before unpickling
    try:
        data = torch.load(payload, map_location=map_location, weights_only=not trust_pickle)
    except Exception as error:
        if not trust_pickle and "weights_only" in str(error).lower():
            detail = next((line.strip() for line in str(error).splitlines() if "Unsupported" in line), "")
            raise ValueError(
                f"{path} holds objects that safe loading refuses, probably in the batch ({detail}); if you trust "
                "the file, pass trust_pickle=True"
            ) from error
        raise CaptureFormatError(
            f"{path}: the capture passed its checksum but cannot be unpickled ({error})"
        ) from error
    if not isinstance(data, dict) or data.get("format") != CAPTURE_FORMAT:
        raise ValueError(f"{path} is not a NaN-capture file written by rollout_consistency.training.nan_capture")
    if data.get("version") != CAPTURE_VERSION:
        raise ValueError(f"{path} has capture format version {data.get('version')}; this code reads {CAPTURE_VERSION}")
    missing = [k for k in _RECORD_KEYS if k not in data]
    if missing:
        raise CaptureFormatError(f"{path}: the capture lacks {', '.join(missing)}; it was not written by NanCapture")
    return NanCaptureRecord(
        step=data["step"],
        model_state=data["model_state"],
        optimizer_state=data["optimizer_state"],
        batch=data["batch"],
        rng=rng_state_from_dict(data["rng"]),
        grads=data["grads"],
        nonfinite_parameters=tuple(data["nonfinite_parameters"]),
        torch_version=data["torch_version"],
        grad_norm_given=bool(data.get("grad_norm_given", False)),
    )


_RECORD_KEYS = ("step", "model_state", "optimizer_state", "batch", "rng", "grads", "nonfinite_parameters")


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of `replay`.

    Attributes:
        step: the replayed step.
        grads_bitwise_equal: every recomputed gradient has the same bit pattern as the captured one, and
            the same parameters have gradients.
        mismatched_parameters: names whose gradients differ (or exist on one side only).
        nonfinite_parameters: names whose recomputed gradients are not finite.
        output: whatever `step_fn` returned (e.g. the loss).
        compared: what was compared, in words (which gradients, how).
        expected_differences: reasons a difference can be expected on this replay (e.g. the step was checked
            after clip-grad-norm, another torch version, a GPU); empty when bit-exactness is promised.
    """

    step: int
    grads_bitwise_equal: bool
    mismatched_parameters: tuple[str, ...]
    nonfinite_parameters: tuple[str, ...]
    output: Any
    compared: str = ""
    expected_differences: tuple[str, ...] = ()

    def describe(self) -> str:
        """What was compared, the outcome, and why a difference could be expected."""
        outcome = "bit-identical" if self.grads_bitwise_equal else f"DIFFERENT in {_names(self.mismatched_parameters)}"
        lines = [f"step {self.step}: {self.compared}: {outcome}"]
        lines += [f"  a difference can be expected: {reason}" for reason in self.expected_differences]
        return "\n".join(lines)


def replay(
    path: str | os.PathLike[str],
    step_fn: Callable[[Any], Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: Any = None,
    trust_pickle: bool = False,
) -> ReplayResult:
    """Restore a captured step and run it again.

    Loads the weights into `model` (and the optimizer state into `optimizer`), sets the gradients of
    `model` to None (as `zero_grad()` does), restores every RNG state, calls `step_fn(batch)` — which must
    run the forward and backward on `model` exactly as the training loop did between `begin_step` and
    `check` — and compares the resulting gradients with the captured ones. The optimizer is not stepped.
    The process's RNG states are left where the replayed step left them.

    Args:
        path: capture file.
        step_fn: `step_fn(batch) -> Any`, forward + backward of one step.
        model: a module of the same architecture as the captured one (its mode, train or eval, is kept:
            set it as it was in training).
        optimizer: optional; restored from the capture for inspection or when `step_fn` uses it.
        map_location, trust_pickle: see `load_capture`.
    """
    record = load_capture(path, map_location=map_location, trust_pickle=trust_pickle)
    model.load_state_dict(record.model_state)
    if optimizer is not None:
        if record.optimizer_state is None:
            raise ValueError(f"{path} was captured without an optimizer; call replay without optimizer=")
        optimizer.load_state_dict(record.optimizer_state)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    restore_rng_state(record.rng)
    output = step_fn(record.batch)
    recomputed = {name: p.grad for name, p in params if p.grad is not None}
    mismatched = tuple(
        sorted(
            name
            for name in set(recomputed) | set(record.grads)
            if name not in recomputed
            or name not in record.grads
            or not bitwise_equal(recomputed[name], record.grads[name])
        )
    )
    nonfinite = tuple(name for name, grad in recomputed.items() if not grads_are_finite([grad]))
    return ReplayResult(
        step=record.step,
        grads_bitwise_equal=not mismatched,
        mismatched_parameters=mismatched,
        nonfinite_parameters=nonfinite,
        output=output,
        compared=(
            f"the gradients of {len(set(recomputed) | set(record.grads))} parameter(s) as step_fn left them, bit "
            f"for bit (dtype, shape, bit pattern) against the {len(record.grads)} captured at check()"
        ),
        expected_differences=_expected_differences(record, recomputed),
    )


def _expected_differences(record: NanCaptureRecord, recomputed: dict[str, torch.Tensor]) -> tuple[str, ...]:
    reasons = []
    if record.grad_norm_given:
        reasons.append(
            "the training step passed grad_norm= (clip_grad_norm_ ran before check): the captured gradients are "
            "the clipped ones, so step_fn must clip the same way"
        )
    if record.torch_version != str(torch.__version__):
        reasons.append(f"captured with torch {record.torch_version}, replayed with {torch.__version__}")
    if any(g.device.type != "cpu" for g in list(record.grads.values()) + list(recomputed.values())):
        reasons.append("gradients on a GPU are bit-exact only with torch.use_deterministic_algorithms(True)")
    return tuple(reasons)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (NaN payloads and the sign of zero included); any devices."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_type).cpu(), b.contiguous().view(int_type).cpu())


# ----------------------------------------------------------------------------------------------
# optional Lightning integration


def nan_capture_callback(directory: str | os.PathLike[str] = "nan_captures") -> Any:
    """A `lightning.pytorch.Callback` running `NanCapture` on the LightningModule and its optimizer.

    Snapshots RNG in `on_train_batch_start` (before `training_step`), checks gradients in
    `on_before_optimizer_step` (after backward, after AMP unscaling, before the update). Replay with
    `replay(path, lambda batch: module.training_step(batch, 0)["loss"].backward(), model=module)` (adapt to
    what your `training_step` returns). The run stops with `NonFiniteGradientError` at the first
    non-finite step. Requires one optimizer and `accumulate_grad_batches=1` (with accumulation the
    batch of a step is several batches).

    Raises:
        ImportError: `lightning` is not installed (`pip install lightning`).
    """
    try:
        import lightning.pytorch as pl
    except ImportError as error:
        raise ImportError("nan_capture_callback needs Lightning: pip install lightning") from error

    class NanCaptureCallback(pl.Callback):
        def __init__(self) -> None:
            self.capture: NanCapture | None = None
            self._batch: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    "nan_capture_callback needs accumulate_grad_batches=1: with accumulation one optimizer step "
                    "spans several batches and the capture would hold only the last"
                )
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"nan_capture_callback supports one optimizer, the trainer has {len(trainer.optimizers)}"
                )
            self.capture = NanCapture(pl_module, trainer.optimizers[0], directory)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            assert self.capture is not None
            self.capture.begin_step(trainer.global_step)
            self._batch = batch

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            assert self.capture is not None
            self.capture.check(self._batch)

    return NanCaptureCallback()
