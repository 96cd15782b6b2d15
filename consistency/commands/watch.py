# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency watch RUN`: judge every step of a training run from the series it logged, with no code
change — TensorBoard event files, a wandb offline run or an MLflow file store (`gate.monitor.run_logs`), verl-omni's
``rollout_corr/*`` names and the run monitor's (`gate.monitor.watch_series`), judged step by step
(`gate.monitor.run_watch`).

Exit codes: 0 every step judged and no alarm; 1 an alarm at some step (the first one and why are printed);
2 nothing to judge (no watched series in RUN, no step), a bad flag or an unreadable run. ``--follow`` tails a live
run: it stops at the first alarm (1), when the run marks its end, or after ``--idle-exit`` seconds without a new
point.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rollout_consistency.gate.config import ConfigError, parse_thresholds
from rollout_consistency.gate.monitor.run_logs import RunLogError, open_run
from rollout_consistency.gate.monitor.run_watch import RunWatch, WatchError
from rollout_consistency.gate.monitor.settings import MonitorError, MonitorSettings
from rollout_consistency.gate.monitor.watch_series import watch_table
from rollout_consistency.gate.tables.settings import GateInputError, TableSettings
from rollout_consistency.safeguards.cli_guard import EXIT_FAIL, EXIT_PASS

from .command import ParserText
from .report_outputs import write_reports
from .usage import UsageError, check_outputs
from .verdict_flags import add_profile_flags, add_threshold_flag

__all__ = ["PARSER_TEXT", "add_arguments", "run"]


PARSER_TEXT = ParserText(
    description=(
        "Read a training run's logged rollout/trainer consistency series — verl-omni's rollout_corr/"
        "logprob_abs_diff_mean, _max, /ts_<t>, kl, k3_kl ... and the run monitor's monitor/* — from TensorBoard "
        "event files, a wandb offline run or an MLflow file store, and judge every step: the profile's limits, "
        "gaps, NaN, a logged FAIL, and a drift alarm against the run's own floor. Prints the first alarming step "
        "and its likely cause."
    ),
    epilog=(
        "Examples:\n"
        "  rollout-consistency watch tensorboard_log/my_project/my_experiment --profile kernel\n"
        "  rollout-consistency watch wandb/offline-run-20260101_000000-abc123 --json w.json --plot w.png\n"
        "  rollout-consistency watch mlruns --follow --idle-exit 900\n"
        "Exit codes: 0 no alarm, 1 an alarm, 2 nothing to judge or bad input. Docs: docs/monitor.md"
    ),
    raw=True,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_path",
        metavar="RUN",
        help="a TensorBoard log folder or event file, a wandb offline run (or its .wandb file), an MLflow run, "
        "experiment or mlruns store holding one run",
    )
    parser.add_argument("--format", choices=("tensorboard", "wandb", "mlflow"), help="RUN's format (default: found)")
    add_profile_flags(parser)
    add_threshold_flag(parser)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="first clean steps that set the drift alarm's floor (default: the run monitor's, 20)",
    )
    parser.add_argument(
        "--step-stride", type=int, default=1, help="the step increment between logged steps (default: 1)"
    )
    parser.add_argument(
        "--prefix", default="monitor/", help="the run monitor's prefix for its own names (default: monitor/)"
    )
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--json", metavar="PATH", help="write every step's verdict, alarms and figures as JSON")
    outputs.add_argument("--junit", metavar="PATH", help="write JUnit XML (one testcase per step) for CI")
    outputs.add_argument("--plot", metavar="PATH", help="write a PNG of |Δlogp| per step and per timestep")
    follow = parser.add_argument_group("a live run")
    follow.add_argument("--follow", action="store_true", help="tail the run: judge steps as they are logged")
    follow.add_argument("--poll", type=float, default=10.0, metavar="S", help="seconds between reads (default 10)")
    follow.add_argument(
        "--idle-exit",
        type=float,
        default=600.0,
        metavar="S",
        help="with --follow, stop after this many seconds without a new point (default 600)",
    )


def run(args: argparse.Namespace) -> int:
    outputs = {"--json": args.json, "--junit": args.junit, "--plot": args.plot}
    targets = check_outputs(outputs, {"RUN": args.run_path})
    _refuse_outputs_in_the_run(outputs, args.run_path)
    if args.poll <= 0 or args.idle_exit <= 0:
        raise UsageError("--poll and --idle-exit must be positive numbers of seconds.")
    watcher = RunWatch(_settings(args))
    try:
        reader = open_run(args.run_path, args.format)
        if not args.follow:
            result = watcher.update(watch_table(reader.poll(), args.prefix), final=True)
        else:
            result = _follow(reader, watcher, args)
    except (RunLogError, WatchError) as error:
        raise UsageError(str(error)) from error
    print(result.format())
    _write(result, targets)
    return EXIT_PASS if result.passed else EXIT_FAIL


def _refuse_outputs_in_the_run(outputs: dict[str, str | None], run_path: str) -> None:
    """A report written among the run's files could replace one of them (an event file, a metric) or be read
    back as one under --follow: refused before anything is read."""
    import os

    run = os.path.realpath(run_path[len("file:") :] if run_path.startswith("file:") else run_path)
    folder = run if os.path.isdir(run) else os.path.dirname(run)
    for flag, path in outputs.items():
        if path and os.path.commonpath([folder, os.path.realpath(path)]) == folder:
            raise UsageError(
                f"{flag} {path} is inside the run's folder {folder}; writing there could replace or add to the run's "
                f"own files. Write the report elsewhere."
            )


def _settings(args: argparse.Namespace) -> Any:
    try:
        gate = TableSettings(
            profile=args.profile,
            compute_dtype=args.compute_dtype,
            thresholds=parse_thresholds(args.threshold) if args.threshold else None,
            source=str(args.run_path),
        )
        settings = MonitorSettings(gate=gate, step_stride=args.step_stride, prefix=args.prefix)
        return settings if args.warmup_steps is None else settings.replace(warmup_steps=args.warmup_steps)
    except (ConfigError, GateInputError, MonitorError) as error:
        raise UsageError(str(error)) from error


def _follow(reader: Any, watcher: Any, args: argparse.Namespace) -> Any:
    """Poll the run until the first alarm, its end mark, or ``--idle-exit`` seconds without a new point."""

    last_change, points, reported = time.monotonic(), -1, 0
    while True:
        log = reader.poll()
        count = sum(len(p) for p in log.series.values())
        if count != points:
            points, last_change = count, time.monotonic()
        idle = time.monotonic() - last_change > args.idle_exit
        final = log.ended is not None or idle
        table = watch_table(log, args.prefix)
        result = watcher.update(table, final=final)
        for step in result.steps[reported:]:
            state = "PASS" if step.passed else "ALARM " + "; ".join(f"{a.kind}: {a.message}" for a in step.alarms)
            print(f"step {step.step}: {state}", flush=True)
        reported = len(result.steps)
        if result.alarms or final:
            if idle and log.ended is None:
                print(f"no new point for {args.idle_exit:g} s: stopped following", file=sys.stderr)
            return result
        time.sleep(args.poll)


def _write(result: Any, targets: dict[str, Any]) -> None:
    import json
    from pathlib import Path

    writers = {
        "--json": lambda path: Path(path).write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n"),
        "--junit": lambda path: Path(path).write_text(result.junit_xml()),
        "--plot": result.write_plot,
    }
    write_reports([(target, writers[flag]) for flag, target in targets.items()])
