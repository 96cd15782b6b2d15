"""Run the doctor's corpus: every case file beside this one, localised and from its figures alone.

A case file is a user's own plug-in pair (``make_rollout``, ``make_trainer``) with one bug on one side, and a
``CASE`` dict: the cause the doctor should name first (``expected``), the side that carries the bug, and the
checker settings. Each case runs twice:

* **localised**: ``run_step1_check`` with the two plug-ins (the doctor may replay both sides' own code);
* **figures only**: the same loops' log-prob tables through ``gate()`` (what a user with two tables has).

`scripts/measure_doctor.py` prints the accuracy tables; `tests/test_doctor_corpus.py` asserts them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CORPUS = Path(__file__).resolve().parent
_NOT_CASES = {"__init__.py", "loops.py", "run.py"}


def case_files() -> list[Path]:
    return sorted(p for p in CORPUS.glob("*.py") if p.name not in _NOT_CASES)


def load_case(path: Path) -> dict[str, Any]:
    from rollout_consistency.safeguards.object_spec import load_object

    return dict(load_object(f"{path}:CASE"))


@dataclass(frozen=True)
class Outcome:
    """One case's result: the check's status and the ranked causes of each path (``(cause, confidence)``); no
    figures-only run (``figures_report`` None) where the trainer's code scored nothing."""

    name: str
    expected: str
    status: str
    localised: tuple[tuple[str, float], ...]
    figures: tuple[tuple[str, float], ...]
    localised_source: str
    seconds: float
    localised_report: Any = None
    figures_report: Any = None

    @staticmethod
    def first(causes: tuple[tuple[str, float], ...]) -> str | None:
        """The cause ranked first, or None when none is (or when the first is tied with another cause)."""
        if not causes:
            return None
        if len(causes) > 1 and causes[1][1] >= causes[0][1]:
            return None
        return causes[0][0]


def config_of(path: Path, case: dict[str, Any]):
    from rollout_consistency import CheckConfig

    return CheckConfig(
        rollout_backend=f"{path}:make_rollout", trainer_backend=f"{path}:make_trainer", **case["settings"]
    )


def tables(config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both sides' log-prob tables and the timesteps, as the check's workers compute them."""
    from rollout_consistency.gate.sides.backends import build_backend, run_batch
    from rollout_consistency.gate.sides.plan import make_plan

    backend = build_backend(config.sides)
    results = [run_batch(backend, batch) for batch in make_plan(config.sides)]
    stack = lambda name: np.concatenate([getattr(r, name) for r in results])  # noqa: E731
    return stack("rollout_log_probs"), stack("trainer_log_probs"), stack("timesteps")


def ranked(report) -> tuple[tuple[str, float], ...]:
    return tuple((d["cause"], float(d["confidence"])) for d in report.diagnosis)


def run_case(path: Path) -> Outcome:
    from rollout_consistency import run_step1_check
    from rollout_consistency.gate import gate

    case = load_case(path)
    config = config_of(path, case)
    start = time.perf_counter()
    report = run_step1_check(config)
    figures = None
    if not _scored_nothing(report):  # else the user has no trainer table to give gate(): no figures-only run
        rollout, trainer, timesteps = tables(config)
        figures = gate(rollout, trainer, timesteps=timesteps, micro_batch_size=config.resolved_micro_batch_size)
    source = report.diagnosis[0].get("source", "") if report.diagnosis else ""
    return Outcome(
        name=path.stem,
        expected=case["expected"],
        status=report.status,
        localised=ranked(report),
        figures=() if figures is None else ranked(figures),
        localised_source=source,
        seconds=time.perf_counter() - start,
        localised_report=report,
        figures_report=figures,
    )


def _scored_nothing(report) -> bool:
    """The trainer's own code could score none of the rollout's steps (the check's ``schedule`` guard: its scheduler
    holds none of the stored timesteps), so it returned no table."""
    return any(c.name == "schedule" and not c.passed for c in report.verdict.checks)
