# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""rollout-consistency: keep the rollout and the trainer of diffusion RL computing the same log-probabilities.

The package (docs/design.md)::

    rollout_consistency.gate         the step-1 gate: config, sides (plan, backends, plug-ins), judging (metrics, verdict, report), diagnosis, tables
    rollout_consistency.training     training tools: gradient-checkpointing check, NaN capture, RNG state, precision
    rollout_consistency.adapters     rollout and trainer adapters (Qwen-Image, SD3, FLUX; diffusers, vLLM-omni)
    rollout_consistency.schedulers   the patched FlowMatch SDE scheduler and SDE windows
    rollout_consistency.lint         the static lint
    rollout_consistency.cli          `rollout-consistency` / `python -m rollout_consistency` (sub-commands in `commands`)

The step-1 check in five names (docs/checker.md)::

    from rollout_consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_family="qwen-image", profile="exact"))
    print(report.format_table())
    assert report.passed, report.reasons

Importing `rollout_consistency` imports nothing else of ours but the gate's two-line face and `base.lazy_face`
(which serves the names), nor numpy, torch or diffusers: every name is loaded on first use
(`rollout_consistency.safeguards.fence`, the lint and the command line pay only for what they import).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from rollout_consistency.base.lazy_face import lazy_face as _lazy_face
from rollout_consistency.gate import __all__ as _GATE_NAMES

try:
    __version__ = version("rollout-consistency")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["CheckConfig", "ConfigError", "Report", "__version__", "gate", "load_config", "run_step1_check", "training"]

# The module (under this package) that serves each name, imported on first use (the gate loads numpy;
# `training`, torch); `gate` and `training` themselves, as any module of ours, are served as modules.
_SERVED_BY = {
    "gate.config": ("CheckConfig", "ConfigError", "load_config"),
    "gate.judging.report": ("Report",),
    "gate.check": ("run_step1_check",),
    # Names 0.1.0 exported from the root; still served (not part of `__all__`) so code written for 0.1.0 keeps
    # running: these, and every other name of `rollout_consistency.gate.__all__`. New code imports them from
    # `rollout_consistency.training` / `rollout_consistency.gate`.
    "training": (
        "checkpoint",
        "NanCapture",
        "replay",
        "load_capture",
        "audit_precision",
        "diff_precision_reports",
        "PrecisionReport",
    ),
}
_SERVED_BY["gate"] = tuple(
    name for name in _GATE_NAMES if name != "gate" and all(name not in names for names in _SERVED_BY.values())
)
# The gate's face (`base.lazy_face`): a name above, or a module of ours (`from rollout_consistency import lint`
# asks here first) — that module alone; dunder probes (copy, pickle, inspect) load nothing.
__getattr__, _ = _lazy_face(__name__, _SERVED_BY)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
