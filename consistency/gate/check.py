# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`run_step1_check(config) -> Report`: the step-1 consistency check, end to end.

Data flows one way (docs/design.md): config → plan (prompts, groups, seeds, windows, batches) → rollout
backend (float32 trajectory) → trainer backend (recomputed log-probs) → metrics → verdict → report. The
CLI (`rollout-consistency check`), `scripts/step1_check.py` and the pytest plugin all call this function.

Two modes:

* **sampling** (default): the rollout backend samples ``num_prompts × num_images_per_prompt`` rollouts in
  batches of ``rollout_batch_size``; each batch is one unit of work for a worker (in this process, or a Ray
  actor with ``workers > 1`` / ``ray_address``), so the report does not depend on the number of workers;
* **trajectory** (``config.trajectory``): a saved `rollout_consistency.adapters.Trajectory` file — any trainer's dump of its
  step-1 rollout — is re-scored by the trainer backend.

With ``config.weight_sync`` set, a sampling check also runs step 2 (one update, the user's weight sync, the check
again: `rollout_consistency.gate.weight_sync_check`); its findings join this report's. Both steps judge the
batches by `rollout_consistency.gate.batch_judging`.

Fails closed: a shape mismatch, NaN/Inf, a missing step, an empty batch, a dead worker, split windows
within a prompt group — each is a FAIL with its reason. Bad settings raise [`ConfigError`] (or the errors in
`USAGE_ERRORS`) before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .batch_judging import stack, stacked_tables, unmeasured_tolerance
from .config import INJECTION_SETTINGS, CheckConfig, ConfigError
from .diagnosis.doctor import attach_diagnosis, diagnose_check
from .diagnosis.settings import DiagnosisSettings
from .judging import tolerance_model
from .judging.experts import GUARD as EXPERTS_GUARD
from .judging.experts import compare_experts
from .judging.metrics import ConsistencyMetrics, MetricsInputError, compute_metrics
from .judging.mismatch import MismatchStats, compute_mismatch
from .judging.report import Report, SampleInfo
from .judging.settings import JudgingSettings
from .judging.tolerances import Profile, Tolerance, ToleranceError, exact_tolerance, get_profile, resolve_tolerance
from .judging.verdict import Problem, decide, window_problems
from .sides.backends import build_backend, run_batch
from .sides.distributed import DistributedError, run_sharded
from .sides.plan import make_plan
from .sides.plugins import compare_fingerprints, is_plugin_spec
from .sides.shared import BackendError, BatchResult
from .sides.trainer import score_trajectory
from .sides.trajectory_checks import check_family_options
from .weight_sync_check import run_weight_sync_check

#: Errors that mean "the check could not be run as asked" (CLI exit code 2), never a PASS.
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, BackendError, DistributedError, FileNotFoundError)


def injection_settings(name: str) -> dict[str, Any]:
    """The settings `--inject name` switches on so its pitfall can show (a run with these settings and no
    injection is the pitfall's *fixed* path)."""
    if name not in INJECTION_SETTINGS:
        raise ConfigError(f"unknown injection {name!r}; expected one of {', '.join(INJECTION_SETTINGS)}.")
    return dict(INJECTION_SETTINGS[name])


def run_step1_check(config: CheckConfig | None = None, **overrides: Any) -> Report:
    """Run the step-1 check and return its [`Report`] (``report.passed``; nothing is printed).

    Args:
        config: the settings (defaults: the built-in tiny Qwen-Image model on the CPU, profile ``exact``).
        **overrides: settings to change, by `CheckConfig` field name.

    Raises:
        ConfigError, BackendError, DistributedError, FileNotFoundError (see `USAGE_ERRORS`), or the
        adapters' ValueError/TypeError for settings a model cannot run with. A check that ran never raises
        for a consistency problem: that is a FAIL in the report.
    """
    start = time.perf_counter()
    config = config if config is not None else CheckConfig()
    if overrides:
        config = config.replace(**overrides)
    notes: list[str] = []
    if config.inject is not None:
        changed = {k: v for k, v in injection_settings(config.inject).items() if getattr(config, k) != v}
        if changed:
            config = config.replace(**changed)
            notes.append(
                f"--inject {config.inject}: set "
                + ", ".join(f"{k}={v}" for k, v in changed.items())
                + " so that the pitfall can show"
            )
    if config.trajectory is not None:
        return _check_trajectory(config, notes, start)
    return _check_sampling(config, notes, start)


# ----------------------------------------------------------------------------------------------------
def _check_sampling(config: CheckConfig, notes: list[str], start: float) -> Report:
    doctor = DiagnosisSettings.from_config(config)  # the doctor's own settings, built once here
    sides = config.sides  # the sides' own settings, built once here: they never see the CheckConfig
    plan = make_plan(sides)
    progress = _progress_bar(config, total=config.num_samples)
    try:
        sharded = run_sharded(
            run_batch,
            plan,
            setup=functools.partial(build_backend, sides),
            workers=config.workers,
            ray_address=config.ray_address,
            ray_timeout_s=config.ray_timeout_s,
            on_result=lambda _index, result: progress.update(len(result.sample_indices)),
        )
    finally:
        progress.close()
    notes.extend(sharded.notes)
    problems = [
        Problem("workers", f"{failure.describe()}: {plan[failure.shard].describe()}") for failure in sharded.failures
    ]
    problems += [Problem("rollout", p) for r in sharded.results if r is not None for p in r.problems]
    results = [r for r in sharded.results if r is not None and not r.problems]
    problems += [Problem(guard, message) for r in results for guard, message in r.findings]
    samples_by_index = {s.index: s for batch in plan for s in batch.samples}
    returned = [samples_by_index[i] for r in results for i in r.sample_indices]
    starts = [s for r in results for s in r.window_starts]
    groups = [g for r in results for g in r.prompt_groups]
    for message in window_problems(returned, starts, groups):
        problems.append(Problem("windows", message))
    seeds_seen = [s for r in results for s in r.seeds]
    if seeds_seen != [s.seed for s in returned]:
        problems.append(Problem("shapes", "the rollout stored other seeds than the plan gave it (samples reordered?)"))

    extra_run = _plugin_and_step2_checks(config, results, problems, notes)
    samples = tuple(
        SampleInfo(s.index, s.prompt_index, s.prompt_group, s.seed, start_, s.window_size)
        for s, start_ in zip(returned, starts, strict=False)
    )
    report = _judged_report(
        config,
        results,
        problems,
        notes,
        samples=samples,
        precision=_first_precision(results),
        run_extra=extra_run,
        run_info=lambda: _run_info(config, sharded.mode, sharded.workers, sharded.timings_s, results, start),
    )
    return diagnose_check(report, doctor, plan, results)  # the doctor: ranked causes, localised by a replay


def _check_trajectory(config: CheckConfig, notes: list[str], start: float) -> Report:
    from rollout_consistency.adapters import Trajectory, TrajectoryFormatError

    try:
        trajectory = Trajectory.load(config.trajectory)
    except TrajectoryFormatError as error:
        raise ConfigError(f"--trajectory {config.trajectory}: {error}") from error
    check_family_options(trajectory.model_family, trajectory.family_options, config.trajectory)
    if trajectory.model_family != config.model_family:
        notes.append(f"model_family {trajectory.model_family!r} taken from the trajectory file")
    # Only the trainer side is built: the rollout side is the file.
    # The profile stays the one the named rollout backend implies (a vLLM-omni dump is gated at `kernel`).
    config = config.replace(
        model_family=trajectory.model_family,
        rollout_dtype=config.trainer_dtype,
        rollout_backend="torch",
        profile=config.resolved_profile,
    )
    if config.workers > 1 or config.ray_address is not None:
        notes.append("trajectory mode re-scores one file in this process (workers/ray_address unused)")
    notes.append(f"trajectory {config.trajectory} ({trajectory.provenance.get('path', 'unknown path')})")
    setup_start = time.perf_counter()
    backend = build_backend(config.sides)
    setup_s = time.perf_counter() - setup_start
    work_start = time.perf_counter()
    n = trajectory.batch_size
    # The rollout side is a file: no second process to audit for precision settings.
    result = dataclasses.replace(
        score_trajectory(backend, trajectory, batch=0, sample_indices=tuple(range(n))), precision=None
    )
    problems = [Problem("windows", m) for m in window_problems(None, result.window_starts, result.prompt_groups)]
    problems += [Problem(guard, message) for guard, message in result.findings]
    samples = tuple(
        SampleInfo(i, -1, result.prompt_groups[i], result.seeds[i], result.window_starts[i], trajectory.window_size)
        for i in range(n)
    )

    def run_info() -> dict[str, Any]:
        timings = {"startup": 0.0, "setup": setup_s, "work": time.perf_counter() - work_start}
        return _run_info(config, "in-process", 1, timings, [result], start)

    report = _judged_report(
        config, [result], problems, notes, samples=samples, precision=None, run_extra={}, run_info=run_info
    )
    return attach_diagnosis(report)  # the doctor from the figures alone: the rollout's code is not at hand


def _plugin_and_step2_checks(
    config: CheckConfig, results: Sequence[BatchResult], problems: list[Problem], notes: list[str]
) -> dict[str, Any]:
    """Plug-in notes, the two sides' weight fingerprints, and the step-2 weight-sync check when asked for."""
    notes.extend(
        f"{side} plug-in {spec}"
        for side, spec in (("rollout_backend", config.rollout_backend), ("trainer_backend", config.trainer_backend))
        if is_plugin_spec(spec)
    )
    weights = next((r.weights for r in results if r.weights is not None), None)
    mismatch, weight_notes = compare_fingerprints(weights)
    problems.extend(Problem("weights", m) for m in mismatch)
    notes.extend(weight_notes)
    extra: dict[str, Any] = {"weights": weights}
    if config.weight_sync is not None:
        step2 = run_weight_sync_check(config)
        problems.extend(Problem("weight_sync", m) for m in step2.problems)
        notes.extend(step2.notes)
        extra["step2"] = step2.info
    return extra


def _expert_boundary(config: CheckConfig) -> tuple[float, str, str] | None:
    """Wan 2.2's boundary rule as the experts guard reads it: ``(boundary timestep, high-noise expert, low-noise
    expert)``, from the config's boundary_ratio and the family's ``num_train_timesteps``; None without one."""
    if config.boundary_ratio is None:
        return None
    from rollout_consistency.adapters import get_family
    from rollout_consistency.adapters.wan import EXPERT_NAMES

    scheduler_config = get_family(config.model_family).scheduler_config or {}
    steps = float(scheduler_config.get("num_train_timesteps", 1000))
    return config.boundary_ratio * steps, EXPERT_NAMES[0], EXPERT_NAMES[1]


def _experts_guard(
    config: CheckConfig,
    results: Sequence[BatchResult],
    problems: list[Problem],
    notes: list[str],
    run: dict[str, Any],
) -> tuple[str, ...]:
    """The ``experts`` guard (models with experts by timestep): its problems, notes and ``run["experts"]``; the
    guard names to list in the verdict (none when no comparison was made)."""
    comparison = compare_experts(results, boundary=_expert_boundary(config))
    notes.extend(comparison.notes)
    problems.extend(Problem(EXPERTS_GUARD, m) for m in comparison.problems)
    if not comparison.compared:
        return ()
    run["experts"] = [dict(row) for row in comparison.by_timestep]
    return (EXPERTS_GUARD,)


# ----------------------------------------------------------------------------------------------------
def _judged_report(
    config: CheckConfig,
    results: Sequence[BatchResult],
    problems: list[Problem],
    notes: list[str],
    *,
    samples: tuple[SampleInfo, ...],
    precision: Any,
    run_extra: dict[str, Any],
    run_info: Callable[[], dict[str, Any]],
) -> Report:
    """Both modes' `Report`: the experts guard and the judged figures over `results`, the verdict, the precision
    note, and `report.run` = `run_info()` (called last, so its total time includes the judging) plus `run_extra`
    (which the experts guard extends)."""
    guards = _experts_guard(config, results, problems, notes, run_extra)
    metrics, tolerance, mismatch = _judge(config.judging, results, problems, notes)
    notes.extend(_precision_note(precision))
    return Report(
        verdict=decide(metrics, tolerance, problems, guards=guards),
        tolerance=tolerance,
        metrics=metrics,
        samples=samples,
        config=config.to_dict(),
        precision=precision,
        notes=tuple(notes),
        run={**run_info(), **run_extra},
        mismatch=mismatch,
    )


def _judge(
    judging: JudgingSettings, results: Sequence[BatchResult], problems: list[Problem], notes: list[str]
) -> tuple[ConsistencyMetrics | None, Tolerance, MismatchStats | None]:
    """Metrics over every returned sample (global order), the resolved tolerance, and the mismatch statistics."""
    profile = get_profile(judging.profile)
    settings = judging.metric_settings
    if not results:
        problems.append(Problem("nonempty", "no rollout batch came back"))
        return None, _fallback_tolerance(judging, profile), None
    try:
        rollout, trainer, timesteps = stacked_tables(results)
        metrics = compute_metrics(rollout, trainer, timesteps=timesteps, **settings)
        mismatch = compute_mismatch(
            rollout,
            trainer,
            valid=np.isfinite(rollout) & np.isfinite(trainer),  # non-finite entries FAIL through the metrics
            timesteps=timesteps,
            clip_ratio_low=metrics.clip_ratio_low,
            clip_ratio_high=metrics.clip_ratio_high,
        )
    except MetricsInputError as error:
        problems.append(Problem("shapes", str(error)))
        return None, _fallback_tolerance(judging, profile), None

    floor, floor_parts = None, {}
    if profile.needs_floor:
        floor_tables = [r.floor_log_probs for r in results]
        if any(t is None for t in floor_tables):
            problems.append(Problem("calibration", "the calibration floor was not measured for every batch"))
        else:
            try:
                tables = {"kernel": stack(floor_tables, "floor log-probs")}
                for source in results[0].floor_tables:
                    tables[source] = stack([r.floor_tables[source] for r in results], f"{source} floor log-probs")
                floor, floor_parts = tolerance_model.calibration_floor(trainer, tables, **settings)
            except (MetricsInputError, KeyError) as error:
                problems.append(Problem("calibration", f"the calibration floor cannot be compared: {error}"))
    try:
        tolerance = resolve_tolerance(
            profile.name,
            judging.thresholds,
            floor=floor,
            multiple=judging.calibration_multiple,
            floor_sources=" + ".join(floor_parts) or None,
            compute_dtype=judging.compute_dtype,
        )
    except ToleranceError as error:
        problems.append(Problem("calibration", str(error)))
        tolerance = _fallback_tolerance(judging, profile)
    for source, part in floor_parts.items():
        notes.append(
            f"calibrated floor, {source} (trainer '{judging.trainer_attention}' vs itself with the {source} changed): "
            f"mean |dlogp| {part.mean_abs_dlogp:.3g}, max {part.max_abs_dlogp:.3g}, ppo_kl {part.ppo_kl:.3g}"
        )
    if profile.bit_exact:
        tolerance, advice = tolerance_model.exact_promise(judging, tolerance, metrics)
        if advice:
            problems.append(Problem("exact", advice))
    return metrics, tolerance, mismatch


def _fallback_tolerance(judging: JudgingSettings, profile: Profile) -> Tolerance:
    """Limits to show when the profile could not be resolved (the verdict fails on the recorded problem)."""
    if profile.needs_floor:
        return Tolerance(profile.name, exact_tolerance().limits, basis="calibration failed: the exact limits are shown")
    return unmeasured_tolerance(judging, profile.name)


def _first_precision(results: Sequence[BatchResult]) -> Any:
    for result in results:
        if result.precision is not None:
            return result.precision
    return None


def _precision_note(precision: Any) -> list[str]:
    """One note naming the settings in which the two sides differ (the audit itself is `report.precision`)."""
    if not precision or not precision.get("differences"):
        return []
    keys = ", ".join(str(d.get("key")) for d in precision["differences"])
    state = "consistent" if precision.get("consistent", True) else "INCONSISTENT"
    return [f"precision audit ({state}): rollout and trainer differ in {keys} (details in report.precision)"]


def _progress_bar(config: CheckConfig, total: int) -> Any:
    from tqdm.auto import tqdm

    # disable=None: shown only on a terminal, so CI logs are not filled with bar redraws.
    disable = True if not config.progress else None
    return tqdm(total=total, desc="step-1 check", unit="sample", disable=disable, leave=False, file=sys.stderr)


def _run_info(
    config: CheckConfig,
    mode: str,
    workers: int,
    timings: Mapping[str, float],
    results: Sequence[BatchResult],
    start: float,
) -> dict[str, Any]:
    """`report.run`: execution mode, workers, forwards and seconds by stage (summed over batches), environment."""
    import diffusers
    import torch

    stage_seconds: dict[str, float] = {}
    forwards: dict[str, int] = {}
    for result in results:
        for key, value in result.seconds.items():
            stage_seconds[key] = stage_seconds.get(key, 0.0) + value
        for key, value in result.forwards.items():
            forwards[key] = forwards.get(key, 0) + value
    timings = {**{k: float(v) for k, v in timings.items()}, **stage_seconds, "total": time.perf_counter() - start}
    return {
        "mode": mode,
        "workers": workers,
        "forwards": forwards,
        "timings_s": timings,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "device": config.device,
        },
    }
