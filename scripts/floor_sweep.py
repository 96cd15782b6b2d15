# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The tolerance model, measured: null cases (legitimate differences) and pitfalls, over many seeds.

Each *null case* changes one legitimate source of difference between rollout and trainer (attention
kernel, batch composition, SDE-step implementation) in float32 or bfloat16; each *pitfall case* is one
``--inject`` reproduction. [`sweep`] runs every case for each launcher seed once, with the ``calibrated``
profile (so the floor of every source present is measured in the same run), and judges the very same
metrics under every profile. A FAIL on a null case is a false alarm; a PASS on a pitfall is a miss.

``scripts/measure_floors.py`` prints the table published in docs/checker.md; tests/test_tolerance_model.py runs
the same sweep on 2 seeds at tiny sizes. A measurement harness over the public check, not part of the package.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_consistency.gate.check import run_step1_check
from rollout_consistency.gate.config import INJECTIONS, CheckConfig
from rollout_consistency.gate.judging.tolerances import (
    PROFILES,
    deviation,
    get_profile,
    narrowest_dtype,
    resolve_tolerance,
)
from rollout_consistency.gate.judging.verdict import Problem, decide

#: Profiles every case is judged under: every registered one.
SWEEP_PROFILES: tuple[str, ...] = PROFILES.names()
#: Profiles that must pass every null case of a dtype (implementation: float32 rounding only).
MUST_PASS: Mapping[str, tuple[str, ...]] = {"float32": ("kernel", "calibrated"), "bfloat16": ("kernel", "calibrated")}
#: Profiles every pitfall must fail.
MUST_FAIL: tuple[str, ...] = ("implementation", "kernel", "calibrated")

NULL_SOURCES: Mapping[str, Mapping[str, Any]] = {
    "kernel": {"rollout_attention": "native", "trainer_attention": "_native_math"},
    "batch composition": {"micro_batch_size": 1},
    "implementation": {"trainer_step_implementation": "flow-grpo"},
}


@dataclass(frozen=True)
class Case:
    """One sweep case: a name, its kind (``null`` or ``pitfall``) and the settings it changes."""

    name: str
    kind: str
    settings: Mapping[str, Any]


def null_cases(dtypes: Sequence[str] = ("float32", "bfloat16")) -> tuple[Case, ...]:
    return tuple(
        Case(f"{dtype} {source}", "null", {"rollout_dtype": dtype, "trainer_dtype": dtype, **settings})
        for dtype in dtypes
        for source, settings in NULL_SOURCES.items()
    )


def pitfall_cases(names: Iterable[str] = INJECTIONS) -> tuple[Case, ...]:
    return tuple(Case(f"--inject {name}", "pitfall", {"inject": name}) for name in names)


@dataclass
class CaseResult:
    """Per profile over the seeds: FAIL count and the largest *load* (deviation / limit of the worst gated
    metric; > 1 is over a limit, inf for a non-zero figure against a 0 limit, or a failed guard)."""

    case: Case
    seeds: int = 0
    fails: dict[str, int] = field(default_factory=dict)
    max_load: dict[str, float] = field(default_factory=dict)
    floor_mean: float = 0.0  # largest combined calibrated floor, mean |dlogp|, over seeds
    floor_max: float = 0.0  # largest combined calibrated floor, max |dlogp|, over seeds
    max_abs_dlogp: float = 0.0  # largest max |dlogp| of the comparison itself over seeds


def _load(verdict: Any) -> float:
    worst = 0.0
    for check in verdict.checks:
        if check.kind == "guard":
            if not check.passed:
                return math.inf
            continue
        dev = deviation(check.name, check.value) if check.value is not None else math.nan
        if math.isnan(dev):
            return math.inf
        load = dev / check.limit if check.limit > 0 else (0.0 if dev == 0 else math.inf)
        worst = max(worst, load)
    return worst


def judge(report: Any, profile: str) -> Any:
    """The verdict of `report`'s metrics under `profile` (its guard failures carried over)."""
    if profile == report.tolerance.profile:
        return report.verdict
    problems = [
        Problem(c.name, c.message)
        for c in report.verdict.checks
        if c.kind == "guard" and not c.passed and c.name not in ("exact", "gates")
    ]
    config = report.config or {}
    compute_dtype = narrowest_dtype(config.get("rollout_dtype", "bfloat16"), config.get("trainer_dtype", "bfloat16"))
    if get_profile(profile).needs_floor:  # its floor was measured in the report's own run
        tolerance = report.tolerance
    else:
        tolerance = resolve_tolerance(profile, compute_dtype=compute_dtype)
    return decide(report.metrics, tolerance, problems)


def sweep(
    cases: Sequence[Case],
    seeds: Iterable[int],
    base: CheckConfig | None = None,
    progress: Any = None,
) -> list[CaseResult]:
    """Run every case for every seed (``calibrated``, so the floors are measured) and judge each run under
    every profile of `SWEEP_PROFILES`. `progress(case, seed, report)` is called after each run."""
    base = base or CheckConfig(progress=False)
    seeds = list(seeds)
    results = []
    for case in cases:
        result = CaseResult(case, fails={p: 0 for p in SWEEP_PROFILES}, max_load={p: 0.0 for p in SWEEP_PROFILES})
        for seed in seeds:
            config = base.replace(profile="calibrated", seed=seed, progress=False, **dict(case.settings))
            report = run_step1_check(config)
            result.seeds += 1
            floor = report.tolerance.floor
            if floor is not None:
                result.floor_mean = max(result.floor_mean, floor.mean_abs_dlogp)
                result.floor_max = max(result.floor_max, floor.max_abs_dlogp)
            if report.metrics is not None and report.metrics.overall.count:
                value = report.metrics.overall.max_abs_dlogp
                result.max_abs_dlogp = max(result.max_abs_dlogp, value if math.isfinite(value) else math.inf)
            for profile in SWEEP_PROFILES:
                verdict = judge(report, profile)
                result.fails[profile] += not verdict.passed
                result.max_load[profile] = max(result.max_load[profile], _load(verdict))
            if progress is not None:
                progress(case, seed, report)
        results.append(result)
    return results


def problems_of(results: Sequence[CaseResult]) -> list[str]:
    """False alarms on null cases under a profile that must pass them, and missed pitfalls."""
    out = []
    for r in results:
        dtype = r.case.settings.get("rollout_dtype", "float32")
        if r.case.kind == "null":
            for profile in MUST_PASS.get(dtype, ()):
                if r.fails[profile]:
                    out.append(f"{r.case.name}: {r.fails[profile]}/{r.seeds} false alarm(s) under {profile}")
        else:
            for profile in MUST_FAIL:
                if r.fails[profile] != r.seeds:
                    out.append(
                        f"{r.case.name}: missed on {r.seeds - r.fails[profile]}/{r.seeds} seed(s) under {profile}"
                    )
    return out


def format_results(results: Sequence[CaseResult]) -> str:
    """The table of docs/checker.md: floors, worst load per profile over seeds, FAIL counts."""

    def load(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.2g}"

    head = f"{'case':<28} {'seeds':>5} {'max|dlogp|':>10} {'floor mean':>10} {'floor max':>10}"
    head += "".join(f"  {p + ' load/FAILs':>22}" for p in SWEEP_PROFILES)
    lines = [head]
    for r in results:
        line = f"{r.case.name:<28} {r.seeds:>5} {r.max_abs_dlogp:>10.3g} {r.floor_mean:>10.3g} {r.floor_max:>10.3g}"
        line += "".join(f"  {load(r.max_load[p]) + ' / ' + str(r.fails[p]):>22}" for p in SWEEP_PROFILES)
        lines.append(line)
    return "\n".join(lines)
