# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Diagnosing a FAIL: the ranked likely causes, each with its evidence and fix, and the replay of both sides'
own code that finds the first stage where they part.

    doctor            `diagnose(report)` -> ranked `Diagnosis` (`rollout_consistency.gate.judging.causes`): from
                      the guards, a localisation where both sides' code is here, and the figures; the `doctor`
                      command's parser and run
    catalogue         the cause ids, one fix per id (`FIXES`), what a confidence means (`CONFIDENCE`), the causes
                      that are no bug (`NOT_A_BUG`)
    figure_causes     causes from the report's figures and recorded settings (and the tables' signature)
    table_signatures  what two log-prob tables say on their own (a ratio, an offset, an offset per timestep)
    localised_causes  the cause a localisation points at
    localise          `localise(trajectory, rollout, trainer)` -> `Localisation`, each side a `SideSpec` (the
                      function itself is `rollout_consistency.gate.localise`); `localise_check`, the check's
                      replay compared call by call
    replay            both sides' own code run once more on one batch, their models' forwards recorded by hooks
    call_match        the two sides' forwards paired by content for the same (sample, step)
    step_fit          the step outside the model (CFG combination, noise level, SDE type, schedule, reduction)
                      fitted to each side
    sigma_schedules   a side's sigma schedule: shifted (odds scaled), its shift recovered where a known base holds
"""

from __future__ import annotations

from .catalogue import CONFIDENCE, FIXES, NOT_A_BUG
from .doctor import attach_diagnosis, diagnose
from .localise import Localisation, SideSpec

__all__ = ["CONFIDENCE", "FIXES", "NOT_A_BUG", "Localisation", "SideSpec", "attach_diagnosis", "diagnose"]
