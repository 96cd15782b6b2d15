# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Measure the run monitor's drift alarm: its false-alarm rate per run and its detection delay (docs/monitor.md).

The drift alarm is Page's one-sided CUSUM on ``log10`` of the step's mean |Δlogp| normalised by the floor measured
over the first K clean steps (`rollout_consistency.gate.monitor.judge`). A per-step test run hundreds of times: what
a user feels is the rate of runs with at least one false alarm, measured here three ways:

1. the real tiny flow_grpo-style loop (scripts/examples/flow_grpo_monitored.py) with a rollout engine whose
   forward runs in float64 (a correct engine in other code: a clean floor of float32 rounding, heavy-tailed step
   to step), ``--seeds`` runs of ``--steps`` steps, every alarm counted;
2. synthetic runs whose per-step figure is drawn (with replacement) from the clean steps of part 1, ``--runs`` runs
   of 100 and of 1000 steps, each judged by a fresh `StepJudge` (the same code, floor re-measured per run);
3. detection delay: the same synthetic runs with a drift planted at step 100 (the figure multiplied by g^(s−100)
   for slow and fast growth g, or by a constant c from step 100), steps from the onset to the drift alarm; and the
   real loop's ``drift`` bug (from step 30): the step of the first alarm against the step where mean |Δlogp|
   reaches the clip range.

Run: ``.venv/bin/python scripts/measure_monitor.py`` (about 2 minutes on a quiet 2-core machine; ``--quick`` for a
smoke run). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from rollout_consistency.gate import TableSettings
from rollout_consistency.gate.monitor import MonitorSettings, MonitorWarning, StepJudge

_LOOP = Path(__file__).resolve().parent / "examples" / "flow_grpo_monitored.py"


def _load_loop():
    spec = importlib.util.spec_from_file_location("flow_grpo_monitored", _LOOP)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("flow_grpo_monitored", module)
    spec.loader.exec_module(module)
    return module


def settings() -> MonitorSettings:
    """The monitor's defaults under the ``kernel`` profile (the engine's float64 forward is another kernel; this
    toy's floor is heavy-tailed — its last SDE step has σ' = 0.001 — so its steps are judged with the bfloat16
    kernel limits)."""
    return MonitorSettings(gate=TableSettings(profile="kernel", clip_ratio=1e-4))


def real_clean(loop, seeds: int, steps: int) -> tuple[np.ndarray, dict[str, int]]:
    values, alarmed, counts = [], 0, {}
    for seed in range(seeds):
        result = loop.run_loop(settings(), seed=seed, steps=steps, engine_float64=True)
        values += result.mean_abs
        summary = result.monitor.summary()
        alarmed += not summary.passed
        for kind, count in summary.alarm_counts.items():
            counts[kind] = counts.get(kind, 0) + count
    return np.asarray(values), {"runs": seeds, "runs_with_alarm": alarmed, **counts}


def synthetic_run(values: np.ndarray, rng: np.random.Generator, steps: int, drift=None) -> int | None:
    """The first drift alarm's step in a run whose figures are drawn from `values` (None: no alarm)."""
    judge = StepJudge(settings())
    draws = rng.choice(values, size=steps)
    for step in range(steps):
        x = draws[step] * (1.0 if drift is None else drift(step))
        verdict = judge.judge(step, {"mean_abs_dlogp": float(x)})
        if any(a.kind == "drift" for a in verdict.alarms):
            return step
    return None


def _growth(g: float, onset: int):
    return lambda s: g ** max(0, s - onset)


def _jump(c: float, onset: int):
    return lambda s: c if s >= onset else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="real clean loop runs (default 10)")
    parser.add_argument("--steps", type=int, default=100, help="steps per real clean run (default 100)")
    parser.add_argument("--runs", type=int, default=400, help="synthetic runs per figure (default 400)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 seeds, 40 steps, 40 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.runs = 2, 40, 40
    torch.set_num_threads(1)  # a few-ms loop: the thread pool costs more than the work
    warnings.simplefilter("ignore", MonitorWarning)
    loop = _load_loop()
    s = settings()
    started = time.perf_counter()
    print(
        f"drift alarm: one-sided CUSUM on log10(mean|dlogp| + {s.drift_epsilon:g}); floor over the first "
        f"{s.warmup_steps} clean steps; k = {s.drift_slack:g}, h = {s.drift_threshold:g}, z cap = {s.drift_z_cap:g}, "
        f"min spread = {s.drift_min_spread:g} decade\n"
    )

    values, real = real_clean(loop, args.seeds, args.steps)
    logs = np.log10(values)
    print("| part | runs x steps | runs with any alarm | alarms by kind |\n|---|---|---|---|")
    kinds = ", ".join(f"{k} {v}" for k, v in real.items() if k not in ("runs", "runs_with_alarm") and v)
    print(
        f"| real loop, clean (float64 engine) | {args.seeds} x {args.steps} | {real['runs_with_alarm']} | {kinds or 'none'} |"
    )
    print(
        f"\nclean per-step mean |dlogp|: median {np.median(values):.3g}, log10 std {logs.std():.3f}, "
        f"p99/median {np.percentile(values, 99) / np.median(values):.3g}x ({values.size} steps)\n"
    )

    rng = np.random.default_rng(0)
    print("| synthetic clean runs (bootstrap of the clean steps) | runs | runs with a drift alarm | rate per run |")
    print("|---|---|---|---|")
    for steps in (100, 1000):
        runs = args.runs if steps == 100 else max(args.runs // 4, 10)
        false = sum(synthetic_run(values, rng, steps) is not None for _ in range(runs))
        print(f"| {steps} steps | {runs} | {false} | {false / runs:.3g} |")

    print("\n| planted drift from step 100 | runs | detected within 200 steps | median delay | p90 delay |")
    print("|---|---|---|---|---|")
    onset = 100
    plants = [(f"x {g:g}^(s-100)", _growth(g, onset)) for g in (1.02, 1.05, 1.1, 1.25)]
    plants += [(f"x {c:g} from step 100", _jump(c, onset)) for c in (2, 3, 10)]
    for name, drift in plants:
        delays = []
        for _ in range(max(args.runs // 4, 10)):
            hit = synthetic_run(values, rng, onset + 200, drift)
            delays.append(np.inf if hit is None else hit - onset)
        d = np.asarray(delays, dtype=float)
        found = d[np.isfinite(d) & (d >= 0)]
        early = int((d < 0).sum())
        median = f"{np.median(found):.0f}" if found.size else "-"
        p90 = f"{np.percentile(found, 90):.0f}" if found.size else "-"
        print(f"| {name} | {d.size} | {found.size}{f' ({early} before onset)' if early else ''} | {median} | {p90} |")

    print(
        "\n| real loop, drift bug from step 30 (weights error x1.35 a step) | first alarm | its kind | mean|dlogp| >= clip at |"
    )
    print("|---|---|---|---|")
    for seed in range(min(args.seeds, 5)):
        result = loop.run_loop(s, seed=seed, steps=90, bug="drift", bug_step=30, engine_float64=True)
        first = result.first_alarm()
        kind = "-" if first is None else ", ".join(a.kind for a in result.verdicts[first].alarms)
        print(f"| seed {seed} | {first} | {kind} | {loop.steps_to_clip(result)} |")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
