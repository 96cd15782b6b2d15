# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Diagnosing a FAIL: the ranked likely causes, each with its evidence and fix, and the replay of both sides'
own code that finds the first stage where they part.

    doctor            `diagnose(report)` -> ranked `Diagnosis` (`rollout_consistency.gate.judging.causes`): from
                      the guards, a localisation where both sides' code is here, and the figures (the `doctor`
                      command: `rollout_consistency.commands.doctor`)
    cause_registry    the causes: one `Cause` record per id (summary, fix, evidence kinds, no bug or not) in
                      `CAUSES`, the docs' table of causes
    catalogue         what a confidence means (`CONFIDENCE`); from the records, one fix per id (`FIXES`) and the
                      causes that are no bug (`NOT_A_BUG`)
    figure_causes     causes from the report's figures and recorded settings (and the tables' signature)
    table_signatures  what two log-prob tables say on their own (a ratio, an offset, an offset per timestep)
    localised_causes  the cause a localisation points at
    localise          `localise(trajectory, rollout, trainer)` -> `Localisation`, each side a `SideSpec` (the
                      function itself is `rollout_consistency.gate.localise`); `localise_check`, the check's
                      replay compared call by call
    replay            both sides' own code run once more on one batch, their models' forwards recorded by hooks
    inside_block      inside the first differing block: the submodule where the sides part, one forward looked at
    module_state      a module's state as it runs (training, dropout, LoRA scaling, attention processor, dtype)
    call_match        the two sides' forwards paired by content for the same (sample, step)
    step_fit          the step outside the model (CFG combination, noise level, SDE type, schedule, reduction)
                      fitted to each side
    sigma_schedules   a side's sigma schedule: shifted (odds scaled), its shift recovered where a known base holds
"""

from __future__ import annotations

from .catalogue import CONFIDENCE, FIXES, NOT_A_BUG
from .cause_registry import CAUSES, Cause
from .doctor import attach_diagnosis, diagnose
from .localise import Localisation, SideSpec

__all__ = [
    "CAUSES",
    "CONFIDENCE",
    "FIXES",
    "NOT_A_BUG",
    "Cause",
    "Localisation",
    "SideSpec",
    "attach_diagnosis",
    "diagnose",
]
