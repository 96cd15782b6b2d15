# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Audit the numeric-precision settings of a process, and diff two audits (rollout vs trainer).

Two computations that must agree (the rollout engine's log-probabilities and the trainer's
recomputation of them) stop agreeing when they run under different precision settings: TF32 on one
side only, a different autocast dtype, cuDNN autotuning, half-precision parameters. Other settings
make training fragile on their own: fp16 without a GradScaler, a GradScaler with bf16, bf16 on a GPU
without native bf16.

`audit_precision(model=..., optimizer=..., scaler=...)` reads the settings of the *current process*
(global torch flags, the autocast state, the model's and optimizer's dtypes, the scaler) into a flat
`settings` mapping and derives `findings`, each naming its fix. Run it on both sides, ship one side's
`report.to_dict()` as JSON, and `diff_precision_reports(rollout, trainer)` lists every setting that
differs and why it matters; the step-1 checker embeds `diff.to_dict()` in its report.

What it cannot see: the order of calls in your loop (e.g. whether you clip gradients only after
`scaler.unscale_(optimizer)`: do), per-call overrides (`torch.backends.cuda.sdp_kernel(...)` contexts
entered elsewhere, `autocast` regions that are not active at the moment of the audit: pass
`autocast_dtype=` to declare them), and settings inside engines that do not run PyTorch code paths
(vLLM's own attention kernels).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "DETECT",
    "PrecisionDiff",
    "PrecisionFinding",
    "PrecisionReport",
    "SettingDifference",
    "audit_precision",
    "diff_precision_reports",
    "precision_findings",
]

JSONValue = None | bool | int | float | str | dict[str, int]
SEVERITIES = ("error", "warning", "info")
_SEVERITY_ORDER = {severity: index for index, severity in enumerate(SEVERITIES)}
#: Fixed keys of one `PrecisionDiff.to_dict()` difference entry; the two sides' values sit beside them.
_DIFF_ENTRY_KEYS = ("key", "severity", "why", "fix")
DETECT = "detect"
_HALF = ("float16", "bfloat16")
_CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")


@dataclass(frozen=True)
class PrecisionFinding:
    """One problem found by the audit.

    Attributes:
        code: stable identifier (e.g. `"fp16-without-grad-scaler"`), for filtering and tests.
        severity: `"error"` (wrong results or a crash ahead), `"warning"` (fragile or wasteful),
            `"info"` (fine alone, but both sides must agree).
        message: what is wrong, with the values involved.
        fix: what to change.
    """

    code: str
    severity: str
    message: str
    fix: str


@dataclass(frozen=True)
class PrecisionReport:
    """Settings of one process and the findings derived from them.

    Attributes:
        settings: flat mapping from setting name (e.g. `"matmul.float32_precision"`,
            `"autocast.dtype"`, `"model.param_dtypes"`) to a JSON value.
        findings: problems, errors first.
        label: free text naming the side (e.g. `"rollout"`, `"trainer"`).
    """

    settings: Mapping[str, JSONValue]
    findings: tuple[PrecisionFinding, ...]
    label: str = ""

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict; `PrecisionReport.from_dict` reads it back."""
        return {
            "label": self.label,
            "settings": {key: _copy_value(value) for key, value in self.settings.items()},
            "findings": [
                {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix} for f in self.findings
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionReport:
        """Inverse of `to_dict` (e.g. the rollout side's report loaded from JSON)."""
        try:
            settings = dict(data["settings"])
            findings = tuple(PrecisionFinding(**finding) for finding in data.get("findings", ()))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a precision report (as written by PrecisionReport.to_dict): {error}") from error
        return cls(settings=settings, findings=findings, label=str(data.get("label", "")))

    def format(self) -> str:
        """Human-readable settings and findings."""
        title = f"precision audit{f' ({self.label})' if self.label else ''}"
        width = max((len(key) for key in self.settings), default=0)
        lines = [title] + [f"  {key:<{width}}  {_show(value)}" for key, value in sorted(self.settings.items())]
        if not self.findings:
            lines.append("  no findings")
        for finding in self.findings:
            lines.append(f"  [{finding.severity}] {finding.code}: {finding.message}")
            lines.append(f"      fix: {finding.fix}")
        return "\n".join(lines)


@dataclass(frozen=True)
class SettingDifference:
    """One setting that differs between two reports.

    Attributes:
        key: setting name. a, b: its values on each side (`None` also when a side did not record it).
        severity: `"error"` when the difference changes the numbers computed, `"warning"` when it may,
            `"info"` when it is descriptive (device name) or recorded on one side only.
        why: what the difference does. fix: how to align the two sides.
    """

    key: str
    a: JSONValue
    b: JSONValue
    severity: str
    why: str
    fix: str


@dataclass(frozen=True)
class PrecisionDiff:
    """Differences between two precision reports, most severe first.

    Attributes:
        labels: names of the two sides, e.g. `("rollout", "trainer")`.
        differences: one entry per differing setting.
    """

    labels: tuple[str, str]
    differences: tuple[SettingDifference, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # `to_dict` keys each side's value by its label, next to the fixed entry keys: a label equal to
        # the other or to one of those keys would overwrite a value (e.g. drop `severity`).
        a, b = self.labels
        if a == b or {a, b} & set(_DIFF_ENTRY_KEYS):
            raise ValueError(
                f"precision diff labels {self.labels!r} must differ from each other and from "
                f"{', '.join(_DIFF_ENTRY_KEYS)}; pass other labels (e.g. labels=('rollout', 'trainer'))"
            )

    @property
    def consistent(self) -> bool:
        """No difference that changes the numbers (no `"error"` difference)."""
        return not any(d.severity == "error" for d in self.differences)

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels": list(self.labels),
            "consistent": self.consistent,
            "differences": [
                {
                    "key": d.key,
                    self.labels[0]: _copy_value(d.a),
                    self.labels[1]: _copy_value(d.b),
                    "severity": d.severity,
                    "why": d.why,
                    "fix": d.fix,
                }
                for d in self.differences
            ],
        }

    def format(self) -> str:
        a, b = self.labels
        if not self.differences:
            return f"precision settings: {a} and {b} agree"
        verdict = "consistent (descriptive differences only)" if self.consistent else "INCONSISTENT"
        lines = [f"precision settings, {a} vs {b}: {verdict}"]
        for d in self.differences:
            lines.append(f"  [{d.severity}] {d.key}: {a}={_show(d.a)}  {b}={_show(d.b)}")
            lines.append(f"      {d.why}; fix: {d.fix}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# reading the settings


def audit_precision(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    autocast_dtype: torch.dtype | str | None = DETECT,
    device: str | torch.device | None = None,
    label: str = "",
) -> PrecisionReport:
    """Read the precision settings of this process (and of `model`, `optimizer`, `scaler`).

    Args:
        model: its parameter and buffer dtypes are recorded (`model.param_dtypes`: dtype name → count).
        optimizer: class, fused/foreach flags, `eps`, and the dtypes of the parameters it updates.
        scaler: a `torch.amp.GradScaler` (or the deprecated `torch.cuda.amp.GradScaler`); `None` when the
            loop has none.
        autocast_dtype: the autocast dtype of the training forward. `DETECT` (default) reads the autocast
            state active at the call (call it inside the `torch.autocast` region, or pass the dtype:
            `torch.bfloat16` / `torch.float16`; `None` for no autocast).
        device: device type to audit (`"cuda"`, `"cpu"`). Default: the device of the model's first
            parameter, else CUDA when available, else CPU.
        label: names the side in reports and diffs.

    Returns:
        PrecisionReport with `settings` and `findings` (errors first).
    """
    device_type = _device_type(model, device)
    settings: dict[str, JSONValue] = {"torch.version": str(torch.__version__)}
    settings.update(_device_settings(device_type))
    settings.update(_matmul_settings())
    settings.update(_determinism_settings())
    settings.update(_attention_settings())
    settings.update(_autocast_settings(device_type, autocast_dtype))
    if model is not None:
        settings["model.param_dtypes"] = _dtype_counts(model.parameters())
        settings["model.buffer_dtypes"] = _dtype_counts(model.buffers())
    if optimizer is not None:
        settings.update(_optimizer_settings(optimizer))
    settings.update(_scaler_settings(scaler))
    return PrecisionReport(settings=settings, findings=precision_findings(settings), label=label)


def _device_type(model: nn.Module | None, device: str | torch.device | None) -> str:
    if device is not None:
        return torch.device(device).type
    if model is not None:
        first = next(model.parameters(), None)
        if first is not None:
            return first.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_settings(device_type: str) -> dict[str, JSONValue]:
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return {
            "device.type": "cuda",
            "device.name": torch.cuda.get_device_name(),
            "device.capability": f"{major}.{minor}",
            "device.bf16_supported": bool(torch.cuda.is_bf16_supported(including_emulation=False)),
        }
    # bf16 runs on every CPU (natively with AVX512-BF16/AMX, emulated otherwise).
    return {
        "device.type": device_type,
        "device.name": platform.processor() or platform.machine(),
        "device.capability": None,
        "device.bf16_supported": device_type == "cpu" or None,
    }


def _read(getter: Any) -> Any:
    """Read a torch flag; torch >= 2.9 raises when legacy and new TF32 APIs were mixed."""
    try:
        return getter()
    except RuntimeError as error:
        if "mix of the legacy and new APIs" in str(error):
            return "mixed-api"
        raise


def _fp32_precision(*backends: Any) -> str | None:
    """First explicit `fp32_precision` along the inheritance chain (torch >= 2.9), else None."""
    for backend in backends:
        value = getattr(backend, "fp32_precision", None) if backend is not None else None
        if value not in (None, "none"):
            return str(value)
    return None


def _matmul_settings() -> dict[str, JSONValue]:
    backends = torch.backends
    cudnn_conv = getattr(backends.cudnn, "conv", None)
    matmul_new = _fp32_precision(backends.cuda.matmul, backends)
    conv_new = _fp32_precision(cudnn_conv, backends.cudnn, backends)
    matmul_legacy = _read(lambda: bool(backends.cuda.matmul.allow_tf32)) if matmul_new is None else None
    conv_legacy = _read(lambda: bool(backends.cudnn.allow_tf32)) if conv_new is None else None
    return {
        "matmul.float32_precision": _read(torch.get_float32_matmul_precision),
        "cuda.matmul.tf32": (matmul_new == "tf32") if matmul_new is not None else matmul_legacy,
        "cudnn.conv.tf32": (conv_new == "tf32") if conv_new is not None else conv_legacy,
        "cuda.matmul.fp16_reduced_precision_reduction": bool(
            backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda.matmul.bf16_reduced_precision_reduction": bool(
            backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
    }


def _determinism_settings() -> dict[str, JSONValue]:
    return {
        "cudnn.enabled": bool(torch.backends.cudnn.enabled),
        "cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms.warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        # Read for the report only (cuBLAS reads it at start-up); nothing is seeded from it.
        "env.CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _attention_settings() -> dict[str, JSONValue]:
    cuda = torch.backends.cuda
    return {
        "sdp.flash": bool(cuda.flash_sdp_enabled()),
        "sdp.mem_efficient": bool(cuda.mem_efficient_sdp_enabled()),
        "sdp.math": bool(cuda.math_sdp_enabled()),
        "sdp.cudnn": bool(cuda.cudnn_sdp_enabled()) if hasattr(cuda, "cudnn_sdp_enabled") else None,
    }


def _autocast_settings(device_type: str, autocast_dtype: torch.dtype | str | None) -> dict[str, JSONValue]:
    if isinstance(autocast_dtype, str):
        if autocast_dtype != DETECT:
            raise ValueError(f"autocast_dtype must be a torch.dtype, None or DETECT, got {autocast_dtype!r}")
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if enabled else None
        source = "detected"
    else:
        if autocast_dtype is not None and autocast_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"autocast_dtype must be torch.float16, torch.bfloat16 or None, got {autocast_dtype}")
        enabled, dtype, source = autocast_dtype is not None, autocast_dtype, "declared"
    return {
        "autocast.enabled": enabled,
        "autocast.dtype": _dtype_name(dtype) if dtype is not None else None,
        "autocast.source": source,
    }


def _optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, JSONValue]:
    groups = optimizer.param_groups
    eps = [group["eps"] for group in groups if isinstance(group.get("eps"), (int, float))]
    return {
        "optimizer.class": type(optimizer).__name__,
        "optimizer.param_dtypes": _dtype_counts(p for group in groups for p in group["params"]),
        "optimizer.eps": min(eps) if eps else None,
        # None: torch picks the implementation (foreach on CUDA); True/False: forced.
        "optimizer.fused": _group_flag(groups, "fused"),
        "optimizer.foreach": _group_flag(groups, "foreach"),
    }


def _group_flag(groups: list[dict[str, Any]], name: str) -> bool | str | None:
    values = {group.get(name) for group in groups}
    return values.pop() if len(values) == 1 else "mixed"


def _scaler_settings(scaler: Any) -> dict[str, JSONValue]:
    if scaler is None:
        return {"grad_scaler.enabled": False, "grad_scaler.passed": False}
    enabled = bool(scaler.is_enabled())
    return {
        "grad_scaler.enabled": enabled,
        "grad_scaler.passed": True,
        "grad_scaler.scale": float(scaler.get_scale()) if enabled else None,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_counts(tensors: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors:
        name = _dtype_name(tensor.dtype)
        counts[name] = counts.get(name, 0) + tensor.numel()
    return dict(sorted(counts.items()))


# ----------------------------------------------------------------------------------------------
# findings


def precision_findings(settings: Mapping[str, JSONValue]) -> tuple[PrecisionFinding, ...]:
    """Derive findings from a settings mapping (as in `PrecisionReport.settings`), errors first.

    Pure function: it also re-evaluates a report read from another machine's JSON.
    """
    found: list[PrecisionFinding] = []

    def add(code: str, severity: str, message: str, fix: str) -> None:
        found.append(PrecisionFinding(code, severity, message, fix))

    autocast = settings.get("autocast.dtype") if settings.get("autocast.enabled") else None
    params = dict(settings.get("model.param_dtypes") or {})
    optimizer_params = dict(settings.get("optimizer.param_dtypes") or {})
    half_params = sorted(d for d in params if d in _HALF)
    uses_fp16 = autocast == "float16" or "float16" in params
    uses_bf16 = autocast == "bfloat16" or "bfloat16" in params
    scaler_on = bool(settings.get("grad_scaler.enabled"))
    device = settings.get("device.type")

    if uses_fp16 and not scaler_on:
        where = "autocast float16" if autocast == "float16" else "float16 parameters"
        add(
            "fp16-without-grad-scaler",
            "error",
            f"{where} without an enabled GradScaler: small gradients underflow to zero in float16",
            "use scaler = torch.amp.GradScaler(device); scaler.scale(loss).backward(); scaler.unscale_(optimizer) "
            "before clipping; scaler.step(optimizer); scaler.update() — or train in bfloat16, which needs no scaler",
        )
    if scaler_on and uses_bf16 and not uses_fp16:
        add(
            "grad-scaler-with-bf16",
            "warning",
            "GradScaler enabled with bfloat16: bfloat16 has float32's exponent range, so scaling buys nothing and "
            "costs an extra pass over the gradients (and skipped steps after overflows)",
            "remove the GradScaler (or construct it with enabled=False) for bfloat16 training",
        )
    if scaler_on and "float16" in params:
        add(
            "grad-scaler-with-fp16-params",
            "error",
            "GradScaler with float16 parameters: scaler.unscale_ raises 'Attempting to unscale FP16 gradients'",
            "keep parameters in float32 (model.float()) and let autocast run the forward in float16",
        )
    if uses_bf16 and device == "cuda" and settings.get("device.bf16_supported") is False:
        add(
            "bf16-unsupported-hardware",
            "error",
            f"bfloat16 on {settings.get('device.name')} (compute capability {settings.get('device.capability')}), "
            "which has no native bfloat16: it is emulated, slowly, or fails in some kernels",
            "use float16 autocast with a GradScaler on this GPU, or run on compute capability >= 8.0 (Ampere or newer)",
        )
    if autocast is not None and half_params:
        add(
            "half-params-under-autocast",
            "warning",
            f"model parameters in {', '.join(half_params)} under autocast: autocast expects float32 master weights; "
            "with half-precision weights it only adds casts, and the optimizer updates half-precision values",
            "keep parameters in float32 (model.float()) and let autocast cast for the forward",
        )
    half_updated = sorted(d for d in optimizer_params if d in _HALF)
    if half_updated:
        add(
            "optimizer-updates-half-params",
            "warning",
            f"the optimizer updates {', '.join(half_updated)} parameters directly: updates smaller than the dtype's "
            "spacing are rounded away (in bfloat16, 1 + 2**-9 == 1), so small learning rates stall silently",
            "keep float32 master parameters for the optimizer (autocast for the forward), or use an optimizer with "
            "float32 master copies / stochastic rounding",
        )
    eps = settings.get("optimizer.eps")
    if "float16" in optimizer_params and isinstance(eps, (int, float)) and 0 < eps < 2**-24:
        add(
            "optimizer-eps-underflows-fp16",
            "error",
            f"optimizer eps={eps:g} rounds to 0 in float16 (smallest subnormal 2**-24 ≈ 6e-8): the update divides by "
            "sqrt(v) + 0, which overflows where v is 0",
            "keep float32 master parameters, or raise eps to >= 1e-4 for float16 parameters",
        )
    if settings.get("matmul.float32_precision") == "mixed-api" or "mixed-api" in (
        settings.get("cuda.matmul.tf32"),
        settings.get("cudnn.conv.tf32"),
    ):
        add(
            "tf32-mixed-api",
            "warning",
            "the process set TF32 through both the legacy flags (allow_tf32, set_float32_matmul_precision) and the "
            "new fp32_precision API; torch raises when reading the resulting state",
            "use one API only, e.g. torch.backends.cuda.matmul.fp32_precision = 'ieee' (or 'tf32') everywhere",
        )
    precision = settings.get("matmul.float32_precision")
    if precision in ("high", "medium") or (device == "cuda" and settings.get("cuda.matmul.tf32") is True):
        add(
            "tf32-matmul",
            "info",
            f"float32 matmuls run in reduced precision (matmul precision {precision!r}, CUDA TF32 "
            f"{settings.get('cuda.matmul.tf32')}): about 1e-3 relative error per product, off since PyTorch 1.12",
            "fine for training speed if the rollout side runs the same way; for bit-consistency checks call "
            "torch.set_float32_matmul_precision('highest') on both sides",
        )
    if device == "cuda":
        if settings.get("cudnn.benchmark"):
            add(
                "cudnn-benchmark",
                "warning",
                "cudnn.benchmark=True: the autotuner may choose different convolution algorithms in different "
                "processes, so two runs of the same step give different numbers",
                "set torch.backends.cudnn.benchmark = False when comparing or replaying computations",
            )
        deterministic = settings.get("deterministic_algorithms")
        workspace = settings.get("env.CUBLAS_WORKSPACE_CONFIG")
        if deterministic and workspace not in _CUBLAS_DETERMINISTIC_CONFIGS:
            add(
                "deterministic-without-cublas-workspace",
                "error",
                f"torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG={workspace!r}: cuBLAS calls "
                "will raise RuntimeError",
                "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts",
            )
        elif not deterministic:
            add(
                "nondeterministic-algorithms",
                "info",
                "deterministic algorithms are off: some CUDA kernels (atomics in backward, scatter/index_add) differ "
                "bit-wise between two runs of the same step",
                "for bit-exact replay or comparison call torch.use_deterministic_algorithms(True) with "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 (and cudnn.benchmark=False)",
            )
    return tuple(sorted(found, key=lambda f: _SEVERITY_ORDER[f.severity]))


# ----------------------------------------------------------------------------------------------
# diffing


# severity of a difference, what it does, how to align; keys not listed default to "warning".
_SETTING_NOTES: dict[str, tuple[str, str, str]] = {
    "torch.version": (
        "warning",
        "different PyTorch releases may ship different kernels",
        "use the same torch release on both sides",
    ),
    "device.type": ("warning", "CPU and CUDA kernels round differently", "compare on the same device type"),
    "device.name": (
        "info",
        "different hardware",
        "expected across machines; compare on the same GPU model for bit-consistency",
    ),
    "device.capability": ("info", "different GPU generation", "expected across machines"),
    "device.bf16_supported": ("info", "different hardware capabilities", "expected across machines"),
    "matmul.float32_precision": (
        "error",
        "float32 matmuls use TF32/bf16 internally on one side only",
        "call torch.set_float32_matmul_precision() with the same value on both sides ('highest' for bit-consistency)",
    ),
    "cuda.matmul.tf32": (
        "error",
        "CUDA float32 matmuls use TF32 on one side only",
        "set torch.backends.cuda.matmul.fp32_precision (or allow_tf32) identically on both sides",
    ),
    "cudnn.conv.tf32": (
        "error",
        "cuDNN float32 convolutions use TF32 on one side only",
        "set torch.backends.cudnn.conv.fp32_precision (or cudnn.allow_tf32) identically on both sides",
    ),
    "cuda.matmul.fp16_reduced_precision_reduction": (
        "error",
        "float16 GEMM accumulation precision differs",
        "set torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction identically",
    ),
    "cuda.matmul.bf16_reduced_precision_reduction": (
        "error",
        "bfloat16 GEMM accumulation precision differs",
        "set torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction identically",
    ),
    "cudnn.enabled": (
        "error",
        "convolutions run through different libraries",
        "set torch.backends.cudnn.enabled identically",
    ),
    "cudnn.benchmark": (
        "warning",
        "autotuned convolution algorithms may differ between the sides",
        "set torch.backends.cudnn.benchmark = False on both sides",
    ),
    "cudnn.deterministic": (
        "warning",
        "cuDNN algorithm choice differs",
        "set torch.backends.cudnn.deterministic identically",
    ),
    "deterministic_algorithms": (
        "warning",
        "one side may use nondeterministic kernels",
        "call torch.use_deterministic_algorithms() identically",
    ),
    "deterministic_algorithms.warn_only": (
        "info",
        "only the reaction to nondeterministic ops differs",
        "align if you rely on the error",
    ),
    "env.CUBLAS_WORKSPACE_CONFIG": (
        "warning",
        "cuBLAS workspace configuration differs (affects determinism)",
        "export the same CUBLAS_WORKSPACE_CONFIG on both sides",
    ),
    "sdp.flash": (
        "error",
        "scaled_dot_product_attention may pick a different kernel (flash)",
        "enable the same SDPA backends on both sides (torch.backends.cuda.enable_*_sdp)",
    ),
    "sdp.mem_efficient": (
        "error",
        "scaled_dot_product_attention may pick a different kernel (memory-efficient)",
        "enable the same SDPA backends on both sides",
    ),
    "sdp.math": (
        "error",
        "scaled_dot_product_attention may pick a different kernel (math)",
        "enable the same SDPA backends on both sides",
    ),
    "sdp.cudnn": (
        "error",
        "scaled_dot_product_attention may pick a different kernel (cuDNN)",
        "enable the same SDPA backends on both sides",
    ),
    "autocast.enabled": (
        "error",
        "the forward runs under autocast on one side only",
        "run the transformer forward under the same autocast setting on both sides",
    ),
    "autocast.dtype": (
        "error",
        "the forward runs in a different low-precision dtype",
        "use the same autocast dtype on both sides",
    ),
    "autocast.source": (
        "info",
        "the autocast state was detected on one side and declared on the other",
        "nothing to align",
    ),
    "model.param_dtypes": (
        "warning",
        "the weights are held in different dtypes: ops that autocast keeps in float32 (norms, softmax) see "
        "different weights",
        "hold the weights in the same dtype on both sides, or confirm the step-1 check passes with this difference",
    ),
    "model.buffer_dtypes": (
        "error",
        "buffers (e.g. RoPE tables, norms' statistics) are held in different dtypes",
        "cast buffers identically on both sides",
    ),
    "optimizer.class": ("info", "only the trainer side normally has an optimizer", "nothing to align for step 1"),
    "optimizer.param_dtypes": (
        "info",
        "only the trainer side normally has an optimizer",
        "nothing to align for step 1",
    ),
    "optimizer.eps": ("info", "only the trainer side normally has an optimizer", "nothing to align for step 1"),
    "optimizer.fused": (
        "info",
        "fused and unfused optimizers round differently after step 1",
        "align when comparing two trainers",
    ),
    "optimizer.foreach": (
        "info",
        "foreach and per-tensor optimizers may round differently",
        "align when comparing two trainers",
    ),
    "grad_scaler.enabled": (
        "info",
        "gradient scaling affects training, not the step-1 forward",
        "see the report's findings",
    ),
    "grad_scaler.passed": ("info", "a GradScaler was audited on one side only", "nothing to align"),
}
_NOT_COMPARED = frozenset({"grad_scaler.scale"})  # changes every few steps by design


def diff_precision_reports(
    a: PrecisionReport | Mapping[str, Any],
    b: PrecisionReport | Mapping[str, Any],
    labels: tuple[str, str] | None = None,
) -> PrecisionDiff:
    """List the settings that differ between two reports (or their `to_dict()` forms).

    Args:
        a, b: the two sides, typically rollout and trainer.
        labels: names of the sides, distinct and none of `key`, `severity`, `why`, `fix` (the keys of a
            `to_dict()` entry). Default: the reports' labels, else `("a", "b")`; suffixed `" (1)"`/`" (2)"`
            when they coincide or clash with those keys.

    Returns:
        PrecisionDiff, most severe difference first. A setting recorded on one side only (e.g. the
        optimizer, absent on the rollout side) is listed with severity `"info"`.

    Raises:
        ValueError: the reports have no setting in common (e.g. one with no settings): nothing would be compared.
    """
    a = a if isinstance(a, PrecisionReport) else PrecisionReport.from_dict(a)
    b = b if isinstance(b, PrecisionReport) else PrecisionReport.from_dict(b)
    if labels is None:
        labels = (a.label or "a", b.label or "b")
        if labels[0] == labels[1] or set(labels) & set(_DIFF_ENTRY_KEYS):
            labels = (f"{labels[0]} (1)", f"{labels[1]} (2)")
    both = (set(a.settings) & set(b.settings)) - _NOT_COMPARED
    if not both:  # every setting "recorded on one side only" would pass with nothing compared
        raise ValueError(
            f"the two precision reports share no setting ({labels[0]}: {len(a.settings)} settings, {labels[1]}: "
            f"{len(b.settings)}): nothing would be compared; write each with `rollout-consistency precision --json` "
            f"(or PrecisionReport.to_dict()) on its side"
        )
    differences = []
    for key in sorted(set(a.settings) | set(b.settings)):
        if key in _NOT_COMPARED:
            continue
        in_a, in_b = key in a.settings, key in b.settings
        value_a, value_b = a.settings.get(key), b.settings.get(key)
        if in_a and in_b and _same(value_a, value_b):
            continue
        severity, why, fix = _SETTING_NOTES.get(key, ("warning", "setting differs", "set it identically on both sides"))
        if not (in_a and in_b):
            severity, why = "info", f"recorded on the {labels[0] if in_a else labels[1]} side only"
            fix = "audit the same objects (model, optimizer, scaler) on both sides to compare this setting"
        differences.append(SettingDifference(key, value_a, value_b, severity, why, fix))
    return PrecisionDiff(
        labels=labels, differences=tuple(sorted(differences, key=lambda d: (_SEVERITY_ORDER[d.severity], d.key)))
    )


def _same(x: JSONValue, y: JSONValue) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _copy_value(value: JSONValue) -> JSONValue:
    return dict(value) if isinstance(value, dict) else value


def _show(value: JSONValue) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "(none)"
    return str(value)
