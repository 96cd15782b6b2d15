# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Check that gradient checkpointing recomputes exactly the forward it replaced.

`check_checkpointing` runs one forward+backward step of a module without and with gradient
checkpointing, each from the same seeded RNG state, and compares the loss and every parameter's
gradient. A checkpoint helper that re-runs the forward during backward without restoring the RNG
state gives dropout a different mask the second time; the gradients then belong to a different
network than the loss, and this check fails with the per-parameter size of the disagreement.

How checkpointing is switched on for the checkpointed run (pick one; the reference run never
checkpoints):

- `segments=[...]`: submodules (objects, dotted names, or patterns such as `"blocks.*"`, where `*`
  matches one name component) whose `forward` is routed through `checkpoint_fn` for the run.
- `set_checkpointing=fn`: your model has its own switch; `fn(module, checkpoint_fn)` turns it on with
  the given checkpoint function, `fn(module, None)` turns it off.
- neither: a diffusers model (`ModelMixin`) uses its own `enable_gradient_checkpointing(checkpoint_fn)`
  (the exact code path diffusers training takes); any other module has each direct child wrapped.

`checkpoint_fn` is called like `torch.utils.checkpoint.checkpoint`: `checkpoint_fn(function, *args)`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from rollout_consistency.training.checkpointing import checkpoint as safe_checkpoint
from rollout_consistency.training.nan_capture import bitwise_equal
from rollout_consistency.training.rng_state import isolated_rng

__all__ = ["CheckpointingReport", "CheckpointingSettings", "GradientDiff", "check_checkpointing"]

CheckpointFn = Callable[..., Any]
SetCheckpointing = Callable[[nn.Module, "CheckpointFn | None"], None]


@dataclass(frozen=True)
class GradientDiff:
    """Disagreement of one gradient between the reference and the checkpointed run.

    Attributes:
        name: parameter name from `named_parameters()`, or `input[<index or key>]` for an input tensor
            that requires grad.
        shape: gradient shape.
        max_abs_diff: largest |g_checkpointed − g_reference| (computed in float64); `inf` where one side
            is missing or the two differ in where they are non-finite.
        reference_max_abs: largest finite |g_reference|.
        relative_diff: max_abs_diff / reference_max_abs (0 when both are 0, `inf` when only the
            reference is 0).
        bitwise_equal: the two gradients have identical bit patterns.
        missing_in: `"checkpointed"` or `"reference"` when only one run produced this gradient.
        within_tolerance: max_abs_diff <= atol + rtol · reference_max_abs.
    """

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    reference_max_abs: float
    relative_diff: float
    bitwise_equal: bool
    missing_in: str | None
    within_tolerance: bool


@dataclass(frozen=True)
class CheckpointingReport:
    """Result of `check_checkpointing`.

    Attributes:
        passed: loss and every gradient within tolerance, the checkpoint function was actually called,
            and the reference step reproduces itself.
        reasons: why it failed (empty when it passed), each naming the fix.
        checkpoint_fn: description of the checkpoint function checked.
        mode: `"segments"`, `"set_checkpointing"` or `"diffusers"` (how checkpointing was switched on).
        segments: names of the wrapped submodules (mode `"segments"`).
        checkpoint_calls: how many times the checkpoint function was called in the checkpointed run.
        seed: seed both runs started from.
        rtol, atol: tolerances used.
        loss_reference, loss_checkpointed: the two losses (float).
        gradients: one entry per gradient, worst (largest relative_diff) first.
        global_relative_diff: ‖g_checkpointed − g_reference‖₂ / ‖g_reference‖₂ over all gradients
            present in both runs (a single size of the disagreement).
        baseline_max_relative_diff: largest relative_diff between two identical non-checkpointed runs
            (0.0 on deterministic hardware), `None` when the baseline run was skipped.
    """

    passed: bool
    reasons: tuple[str, ...]
    checkpoint_fn: str
    mode: str
    segments: tuple[str, ...]
    checkpoint_calls: int
    seed: int
    rtol: float
    atol: float
    loss_reference: float
    loss_checkpointed: float
    gradients: tuple[GradientDiff, ...]
    global_relative_diff: float
    baseline_max_relative_diff: float | None

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    @property
    def bitwise_equal(self) -> bool:
        """Loss and every gradient identical bit for bit."""
        return self.loss_reference == self.loss_checkpointed and all(g.bitwise_equal for g in self.gradients)

    @property
    def max_relative_diff(self) -> float:
        return max((g.relative_diff for g in self.gradients), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (non-finite floats stay floats; `json.dumps` writes them as Infinity/NaN)."""
        data = asdict(self)
        data["verdict"] = self.verdict
        data["bitwise_equal"] = self.bitwise_equal
        data["gradients"] = [dict(g, shape=list(g["shape"])) for g in data["gradients"]]
        data["reasons"] = list(self.reasons)
        data["segments"] = list(self.segments)
        return data

    def format(self, top: int = 10) -> str:
        """Human-readable summary with the `top` worst gradients."""
        lines = [
            f"recompute consistency: {self.verdict}  ({self.checkpoint_fn}, mode={self.mode}, "
            f"{self.checkpoint_calls} checkpointed call(s), seed={self.seed}, rtol={self.rtol:g}, atol={self.atol:g})",
            f"  loss: reference {self.loss_reference:.9g}  checkpointed {self.loss_checkpointed:.9g}",
            f"  gradients: {len(self.gradients)} compared, "
            f"{sum(not g.within_tolerance for g in self.gradients)} beyond tolerance, "
            f"bitwise equal: {self.bitwise_equal}, global relative diff {self.global_relative_diff:.3e}",
        ]
        if self.baseline_max_relative_diff is not None:
            lines.append(
                f"  baseline (two identical reference runs): max relative diff {self.baseline_max_relative_diff:.3e}"
            )
        shown = self.gradients[:top]
        if shown:
            width = max(len(g.name) for g in shown)
            lines.append(f"  {'gradient':<{width}}  {'max|Δ|':>10}  {'max|g|':>10}  {'relative':>10}  ok")
            for g in shown:
                note = f"  missing in {g.missing_in} run" if g.missing_in else ""
                lines.append(
                    f"  {g.name:<{width}}  {g.max_abs_diff:10.3e}  {g.reference_max_abs:10.3e}  "
                    f"{g.relative_diff:10.3e}  {'yes' if g.within_tolerance else 'NO'}{note}"
                )
        lines.extend(f"  reason: {reason}" for reason in self.reasons)
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckpointingSettings:
    """How `check_checkpointing` runs and judges its three training steps (checked when built).

    Args:
        seed: seed for all three runs, 0 <= seed < 2**32.
        rtol, atol: a gradient agrees when max|Δ| <= atol + rtol · max|g_reference| (per gradient); the
            loss agrees when |Δloss| <= atol + rtol · |loss_reference|. The default rtol=1e-6 admits
            only rounding (e.g. accumulation order of a weight shared by several segments); an RNG
            mismatch is orders of magnitude larger. Use rtol=0 to demand bit equality.
        train: put the module in training mode for the runs (dropout active), restoring modes after.
        baseline: also repeat the reference run and fail if it does not reproduce itself (then the
            check cannot tell checkpointing apart from nondeterministic kernels).
    """

    seed: int = 0
    rtol: float = 1e-6
    atol: float = 0.0
    train: bool = True
    baseline: bool = True

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0:
            raise ValueError(f"rtol and atol must be >= 0, got rtol={self.rtol}, atol={self.atol}")

    def allows(self, diff: float, scale: float) -> bool:
        """Whether a difference `diff` is within tolerance of a reference of size `scale`."""
        return diff <= self.atol + self.rtol * scale


def check_checkpointing(
    module: nn.Module,
    inputs: Any,
    checkpoint_fn: CheckpointFn | None = None,
    *,
    segments: Sequence[str | nn.Module] | None = None,
    set_checkpointing: SetCheckpointing | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    settings: CheckpointingSettings | None = None,
    **overrides: Any,
) -> CheckpointingReport:
    """Compare one training step of `module` without and with gradient checkpointing.

    Three runs of forward + loss + backward, each from RNG seeded with `seed` (Python, NumPy, torch
    CPU and CUDA): the reference (no checkpointing), optionally the reference again (the baseline:
    is the step reproducible at all on this machine?), and the checkpointed run. Buffers (e.g.
    BatchNorm statistics) are reset between runs; on return the module's buffers, `.grad` fields,
    train/eval modes and forward methods are as they were, and the caller's RNG states are untouched.

    Args:
        module: the model. It must not checkpoint by itself outside the switch used here.
        inputs: a Tensor (called as `module(inputs)`), a tuple/list (`module(*inputs)`) or a mapping
            (`module(**inputs)`). Input tensors that require grad are compared like parameters.
        checkpoint_fn: the checkpoint function to check, called as `checkpoint_fn(function, *args)`.
            Default: `rollout_consistency.training.checkpointing.checkpoint`. For torch's variants pass
            `functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)` (or `True`).
        segments: submodules to checkpoint: module objects, dotted names from `named_modules()`, or
            patterns where `*` matches one name component (`"blocks.*"`, `"transformer_blocks.*"`).
        set_checkpointing: alternative to `segments`: `set_checkpointing(module, fn)` switches the
            model's own checkpointing on with `fn`; `set_checkpointing(module, None)` switches it off.
        loss_fn: maps the module's output to a scalar loss tensor. Default: the sum over the floating
            tensors in the output (a tensor, or a tuple/list/mapping of them) of `mean(out.float()**2)`.
        settings ([`CheckpointingSettings`], *optional*): seed, tolerances (`rtol`, `atol`), train mode and
            the baseline run; default `CheckpointingSettings()`.
        **overrides: `CheckpointingSettings` fields by name, applied over `settings` (``seed=0``, ``rtol=0``).

    Returns:
        CheckpointingReport; `report.passed` is the verdict, `print(report.format())` explains it.

    An exception raised during the checkpointed run (e.g. torch's `CheckpointError` when the recompute
    differs in shapes) makes the report fail with the exception as its reason; exceptions of the
    reference runs propagate.

    Raises:
        ValueError: bad arguments (unknown segment, both `segments` and `set_checkpointing`, a
            non-scalar loss, a loss that does not depend on any parameter, a diffusers model that
            already has checkpointing enabled), each message naming the fix.
    """
    settings = CheckpointingSettings() if settings is None else settings
    unknown = sorted(set(overrides) - {f.name for f in fields(CheckpointingSettings)})
    if unknown:
        raise TypeError(
            f"check_checkpointing() got unknown setting(s) {', '.join(map(repr, unknown))}; the settings are "
            f"CheckpointingSettings' fields: {', '.join(f.name for f in fields(CheckpointingSettings))}."
        )
    settings = replace(settings, **overrides) if overrides else settings
    seed, train, baseline = settings.seed, settings.train, settings.baseline
    if segments is not None and set_checkpointing is not None:
        raise ValueError("pass either segments= or set_checkpointing=, not both")
    checkpoint_fn = safe_checkpoint if checkpoint_fn is None else checkpoint_fn
    loss_fn = _default_loss if loss_fn is None else loss_fn

    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameter that requires grad; nothing to compare")
    input_leaves = _input_leaves(inputs)

    calls = [0]

    def counting_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return checkpoint_fn(function, *args, **kwargs)

    if set_checkpointing is not None:
        mode, switch, segment_names = "set_checkpointing", _custom_switch(module, set_checkpointing), ()
    elif segments is None and _is_diffusers_model(module):
        mode, switch, segment_names = "diffusers", _diffusers_switch(module), ()
    else:
        resolved = _resolve_segments(module, segments)
        mode, switch, segment_names = "segments", _segment_switch(resolved), tuple(name for name, _ in resolved)

    with _preserved_module_state(module, params, input_leaves, train) as reset_buffers:

        def run(checkpointed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
            reset_buffers()
            context = switch(counting_checkpoint) if checkpointed else contextlib.nullcontext()
            with context:
                return _one_step(module, inputs, loss_fn, seed, params, input_leaves, checkpointed)

        loss_ref, grads_ref = run(checkpointed=False)
        baseline_grads = run(checkpointed=False)[1] if baseline else None
        crash: Exception | None = None
        try:
            loss_ckpt, grads_ckpt = run(checkpointed=True)
        except Exception as error:  # fail closed: a crash under checkpointing is a failed check, with its reason
            crash = error
            loss_ckpt, grads_ckpt = torch.tensor(math.nan), dict.fromkeys(grads_ref)

    checkpoint_name = _describe(checkpoint_fn)
    diffs = _compare_all(grads_ref, grads_ckpt, settings)
    baseline_diffs = None if baseline_grads is None else _compare_all(grads_ref, baseline_grads, settings)

    if crash is not None:
        reasons = [
            f"the checkpointed run raised {type(crash).__name__}: {crash} (torch raises CheckpointError when the "
            "recomputed forward differs in shapes or dtypes from the original)"
        ]
    else:
        reasons = _reasons(
            loss_ref=float(loss_ref),
            loss_ckpt=float(loss_ckpt),
            diffs=diffs,
            tolerance=settings,
            calls=calls[0],
            baseline_diffs=baseline_diffs,
            checkpoint_name=checkpoint_name,
        )
    return CheckpointingReport(
        passed=not reasons,
        reasons=tuple(reasons),
        checkpoint_fn=checkpoint_name,
        mode=mode,
        segments=segment_names,
        checkpoint_calls=calls[0],
        seed=seed,
        rtol=settings.rtol,
        atol=settings.atol,
        loss_reference=float(loss_ref),
        loss_checkpointed=float(loss_ckpt),
        gradients=tuple(diffs),
        global_relative_diff=_global_relative_diff(grads_ref, grads_ckpt),
        baseline_max_relative_diff=(
            None if baseline_diffs is None else max((d.relative_diff for d in baseline_diffs), default=0.0)
        ),
    )


# ----------------------------------------------------------------------------------------------
# running the step


def _call(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def _input_leaves(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(inputs, Mapping):
        items = [(f"input[{key!r}]", value) for key, value in inputs.items()]
    elif isinstance(inputs, (tuple, list)):
        items = [(f"input[{index}]", value) for index, value in enumerate(inputs)]
    else:
        items = [("input", inputs)]
    return [
        (name, value)
        for name, value in items
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf
    ]


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in _flatten(output) if t.is_floating_point()]
    if not tensors:
        raise ValueError(
            f"the module returned no floating-point tensor (got {type(output).__name__}); pass loss_fn= "
            "mapping the output to a scalar loss"
        )
    return sum(t.float().square().mean() for t in tensors)


def _flatten(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _flatten(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item)


def _one_step(
    module: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    seed: int,
    params: list[tuple[str, nn.Parameter]],
    input_leaves: list[tuple[str, torch.Tensor]],
    checkpointed: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    for _, tensor in [*params, *input_leaves]:
        tensor.grad = None
    with isolated_rng(seed):
        loss = loss_fn(_call(module, inputs))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {_shape_of(loss)}")
        if loss.requires_grad:
            loss.backward()
        elif not checkpointed:
            raise ValueError(
                "the loss does not depend on any parameter that requires grad; check loss_fn and that the "
                "module's parameters have requires_grad=True"
            )
        # else: the checkpoint function cut the graph (a reentrant-style helper whose inputs do not
        # require grad); every gradient is missing, which the comparison reports as a failure.
    grads = {
        name: None if tensor.grad is None else tensor.grad.detach().clone() for name, tensor in [*params, *input_leaves]
    }
    return loss.detach().reshape(()).clone(), grads


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def _preserved_module_state(
    module: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    input_leaves: list[tuple[str, torch.Tensor]],
    train: bool,
) -> Iterator[Callable[[], None]]:
    """Yield a function that resets the buffers; restore grads, buffers and modes on exit."""
    modes = [(m, m.training) for m in module.modules()]
    saved_grads = [(t, t.grad) for _, t in [*params, *input_leaves]]
    # Buffers change during a forward (BatchNorm statistics, twice under checkpointing); every run
    # must start from the same ones.
    buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def reset_buffers() -> None:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)

    try:
        if train:
            module.train()
        yield reset_buffers
    finally:
        reset_buffers()
        for tensor, grad in saved_grads:
            tensor.grad = grad
        for submodule, mode in modes:
            submodule.training = mode


# ----------------------------------------------------------------------------------------------
# switching checkpointing on


def _is_diffusers_model(module: nn.Module) -> bool:
    # A diffusers model can only exist if diffusers is imported; importing it here would cost seconds.
    diffusers = sys.modules.get("diffusers")
    model_mixin = getattr(diffusers, "ModelMixin", None) if diffusers is not None else None
    return (
        model_mixin is not None
        and isinstance(module, model_mixin)
        and bool(getattr(module, "_supports_gradient_checkpointing", False))
    )


def _diffusers_switch(module: nn.Module) -> Callable[[CheckpointFn], contextlib.AbstractContextManager[None]]:
    if getattr(module, "is_gradient_checkpointing", False):
        raise ValueError(
            f"{type(module).__name__} already has gradient checkpointing enabled, so no reference run without "
            "it is possible; call module.disable_gradient_checkpointing() before the check"
        )

    @contextlib.contextmanager
    def switch(fn: CheckpointFn) -> Iterator[None]:
        # diffusers calls it as fn(block, *args): the calling convention of torch.utils.checkpoint.
        module.enable_gradient_checkpointing(fn)
        try:
            yield
        finally:
            module.disable_gradient_checkpointing()

    return switch


def _custom_switch(
    module: nn.Module, set_checkpointing: SetCheckpointing
) -> Callable[[CheckpointFn], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def switch(fn: CheckpointFn) -> Iterator[None]:
        set_checkpointing(module, fn)
        try:
            yield
        finally:
            set_checkpointing(module, None)

    return switch


def _resolve_segments(module: nn.Module, segments: Sequence[str | nn.Module] | None) -> list[tuple[str, nn.Module]]:
    named = [(name, m) for name, m in module.named_modules() if name]
    if segments is None:
        resolved = list(module.named_children())
        if not resolved:
            raise ValueError(f"{type(module).__name__} has no submodules to checkpoint; pass segments=")
        return resolved
    if isinstance(segments, (str, nn.Module)):
        segments = [segments]
    resolved: list[tuple[str, nn.Module]] = []
    for spec in segments:
        if isinstance(spec, nn.Module):
            matches = [(name, m) for name, m in named if m is spec]
            if not matches:
                raise ValueError(f"segment {type(spec).__name__} object is not a submodule of the module")
        else:
            matches = [(name, m) for name, m in named if _name_matches(spec, name)]
            if not matches:
                examples = ", ".join(name for name, _ in named[:8])
                raise ValueError(
                    f"segment pattern {spec!r} matches no submodule; names look like: {examples}"
                    " ('*' matches one dotted component)"
                )
        resolved.extend(match for match in matches if all(match[1] is not m for _, m in resolved))
    return resolved


def _name_matches(pattern: str, name: str) -> bool:
    pattern_parts, name_parts = pattern.split("."), name.split(".")
    return len(pattern_parts) == len(name_parts) and all(
        fnmatch.fnmatchcase(part, pat) for part, pat in zip(name_parts, pattern_parts, strict=False)
    )


def _segment_switch(
    resolved: list[tuple[str, nn.Module]],
) -> Callable[[CheckpointFn], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def switch(fn: CheckpointFn) -> Iterator[None]:
        # An instance attribute `forward` shadows the class method for nn.Module.__call__; hooks
        # still run once, outside the checkpointed region.
        patched = []
        try:
            for _, segment in resolved:
                had_own = "forward" in vars(segment)
                original = segment.forward
                segment.forward = _checkpointed_forward(original, fn)
                patched.append((segment, had_own, original))
            yield
        finally:
            for segment, had_own, original in reversed(patched):
                if had_own:
                    segment.forward = original
                else:
                    del segment.forward

    return switch


def _checkpointed_forward(original: Callable[..., Any], fn: CheckpointFn) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        # Keyword arguments are bound up front: the reentrant torch variant and most home-made
        # helpers accept positional inputs only.
        target = functools.partial(original, **kwargs) if kwargs else original
        return fn(target, *args)

    return forward


# ----------------------------------------------------------------------------------------------
# comparing


def _compare_all(
    reference: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None], tolerance: CheckpointingSettings
) -> list[GradientDiff]:
    """Per-gradient comparison, worst (largest relative difference) first."""
    diffs = [_compare(name, reference[name], other[name], tolerance) for name in reference]
    return sorted((d for d in diffs if d is not None), key=lambda d: (-_sort_key(d.relative_diff), d.name))


def _compare(
    name: str, reference: torch.Tensor | None, other: torch.Tensor | None, tolerance: CheckpointingSettings
) -> GradientDiff | None:
    if reference is None and other is None:
        return None  # parameter unused in this step
    if reference is None or other is None:
        present = reference if reference is not None else other
        return GradientDiff(
            name=name,
            shape=tuple(present.shape),
            max_abs_diff=math.inf,
            reference_max_abs=_finite_max_abs(reference) if reference is not None else 0.0,
            relative_diff=math.inf,
            bitwise_equal=False,
            missing_in="checkpointed" if other is None else "reference",
            within_tolerance=False,
        )
    if reference.is_sparse:
        reference, other = reference.to_dense(), other.to_dense()
    bitwise = bitwise_equal(reference, other)
    ref64, other64 = reference.detach().double(), other.detach().double()
    same = (ref64 == other64) | (ref64.isnan() & other64.isnan())
    diff = torch.where(same, torch.zeros_like(ref64), (ref64 - other64).abs()).nan_to_num(nan=math.inf)
    max_abs_diff = float(diff.max()) if diff.numel() else 0.0
    scale = _finite_max_abs(reference)
    if max_abs_diff == 0.0:
        relative = 0.0
    else:
        relative = max_abs_diff / scale if scale > 0 else math.inf
    return GradientDiff(
        name=name,
        shape=tuple(reference.shape),
        max_abs_diff=max_abs_diff,
        reference_max_abs=scale,
        relative_diff=relative,
        bitwise_equal=bitwise,
        missing_in=None,
        within_tolerance=tolerance.allows(max_abs_diff, scale),
    )


def _finite_max_abs(tensor: torch.Tensor) -> float:
    values = tensor.detach().double().abs()
    values = values[values.isfinite()]
    return float(values.max()) if values.numel() else 0.0


def _global_relative_diff(reference: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None]) -> float:
    num = den = 0.0
    for name, ref in reference.items():
        oth = other[name]
        if ref is None or oth is None:
            continue
        ref64, oth64 = ref.detach().double(), oth.detach().double()
        num += float((oth64 - ref64).square().sum())
        den += float(ref64.square().sum())
    if num == 0.0:
        return 0.0
    return math.sqrt(num / den) if den > 0 else math.inf


def _sort_key(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _reasons(
    *,
    loss_ref: float,
    loss_ckpt: float,
    diffs: list[GradientDiff],
    tolerance: CheckpointingSettings,
    calls: int,
    baseline_diffs: list[GradientDiff] | None,
    checkpoint_name: str,
) -> list[str]:
    reasons: list[str] = []
    if calls == 0:
        reasons.append(
            f"{checkpoint_name} was never called during the checkpointed run, so nothing was checked; the "
            "segments are not used by forward, or the model bypasses checkpointing (e.g. only checkpoints in "
            "training mode with grad enabled) — pass segments= naming submodules that forward calls"
        )
    if not math.isfinite(loss_ref):
        reasons.append(f"the reference loss is not finite ({loss_ref}); fix the model or inputs first")
    elif not (math.isfinite(loss_ckpt) and tolerance.allows(abs(loss_ckpt - loss_ref), abs(loss_ref))):
        reasons.append(
            f"the loss differs under checkpointing ({loss_ref:.9g} vs {loss_ckpt:.9g}); the checkpointed forward "
            "itself is not the same computation"
        )
    if not diffs:
        reasons.append("no parameter received a gradient in either run; check loss_fn")
    missing = [d.name for d in diffs if d.missing_in == "checkpointed"]
    if missing:
        reasons.append(
            f"{len(missing)} gradient(s) missing under checkpointing (e.g. {', '.join(missing[:3])}): a reentrant "
            "checkpoint drops parameter gradients when no input of the segment requires grad; use "
            "rollout_consistency.training.checkpointing.checkpoint (use_reentrant=False)"
        )
    wrong = [d for d in diffs if not d.within_tolerance and d.missing_in is None]
    if wrong:
        worst = wrong[0]
        reasons.append(
            f"{len(wrong)} of {len(diffs)} gradients differ beyond tolerance (worst {worst.name}: relative "
            f"{worst.relative_diff:.3e}); the recompute in backward is not the forward that produced the loss, "
            "typically because the checkpoint helper does not restore the RNG state (dropout draws a new mask) — "
            "swap in rollout_consistency.training.checkpointing.checkpoint"
        )
    unreproducible = [d for d in baseline_diffs or [] if not d.within_tolerance]
    if unreproducible:
        reasons.append(
            f"the step without checkpointing does not reproduce itself ({unreproducible[0].name}: relative diff "
            f"{unreproducible[0].relative_diff:.3e} between "
            "two identical runs): nondeterministic kernels; run with torch.use_deterministic_algorithms(True) "
            "or raise rtol above this noise floor"
        )
    return reasons


def _describe(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        keywords = ", ".join(f"{key}={value!r}" for key, value in fn.keywords.items())
        return f"{_describe(fn.func)}({keywords})" if keywords else _describe(fn.func)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name
