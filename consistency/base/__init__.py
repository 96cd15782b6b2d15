# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The facts every layer reads, importing nothing of ours (and not torch).

    registry          `Registry`: entries known by name, the mechanism behind every extension point
    builtin_families  `BUILTIN_FAMILIES`: one record per built-in model family, the table the gate and adapters read
    sampling_rules    what a rollout's sampling settings must be, checked in one place
    lazy_face         `lazy_face`: a package face that imports each name's module on first use (every face of ours)

Importing this package loads `lazy_face` and none of the others: each is imported on first use.
"""

from __future__ import annotations

from rollout_consistency.base.lazy_face import lazy_face

__all__ = ["builtin_families", "lazy_face", "registry", "sampling_rules"]

__getattr__, __dir__ = lazy_face(__name__, {})
