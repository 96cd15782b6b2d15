# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Diagnosing a FAIL: the ranked likely causes, each with its evidence and fix, and the replay that finds the
first stage where two sides part.

    doctor    `diagnose(report)` -> ranked `Diagnosis` (`rollout_consistency.gate.judging.causes`), from the
              figures and, where both sides' code is here, from a localisation; `FIXES` (one fix per cause id);
              the `doctor` command's parser and run
    localise  `localise(trajectory, rollout, trainer)` -> `Localisation`, each side a `SideSpec`; the function
              itself is `rollout_consistency.gate.localise` (its module shares its name)
"""

from __future__ import annotations

from .doctor import FIXES, attach_diagnosis, diagnose
from .localise import Localisation, SideSpec

__all__ = ["FIXES", "Localisation", "SideSpec", "attach_diagnosis", "diagnose"]
