# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Training-consistency tools: the disagreements that appear after step 1 (docs/training-consistency.md).

* `checkpoint` (checkpointing.py): a gradient-checkpoint helper safe to swap in for home-made ones (RNG
  state replayed in backward); `check_checkpointing` (checkpoint_check.py) compares a model's gradients
  with and without its checkpointing, seed for seed.
* `NanCapture`, `replay`, `load_capture` (nan_capture.py): capture the first non-finite step and replay it.
* `isolated_rng`, `capture_rng_state` (rng_state.py): seeded, restorable random-number state.
* `audit_precision`, `diff_precision_reports` (precision.py): the precision policy of each side, compared.
* `ToyDenoiser`, `toy_case` (toy_denoiser.py): a small denoiser with dropout, the worked example the docs,
  the CLI and the demo script use.

Names are imported on first use: the modules import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "checkpoint": "checkpointing",
    "check_checkpointing": "checkpoint_check",
    "CheckpointingReport": "checkpoint_check",
    "CheckpointingSettings": "checkpoint_check",
    "GradientDiff": "checkpoint_check",
    "NanCapture": "nan_capture",
    "replay": "nan_capture",
    "load_capture": "nan_capture",
    "grads_are_finite": "nan_capture",
    "isolated_rng": "rng_state",
    "capture_rng_state": "rng_state",
    "RngState": "rng_state",
    "audit_precision": "precision",
    "diff_precision_reports": "precision",
    "PrecisionReport": "precision",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
