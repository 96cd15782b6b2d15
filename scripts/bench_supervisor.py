#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the command line's supervisor costs: start-up with it (the console entry) against without it.

The console entry (`rollout-consistency ...`, `python -m rollout_consistency ...`) runs each command in a forked
child and waits for the exit code it hands over (`rollout_consistency.safeguards.supervisor`). Measured here, side by side:

* ``fork``: `run_supervised` around a command that does nothing, against calling it directly, in one process
  (the supervisor's own cost: fork, pipe, wait);
* ``gate``: ``python -m rollout_consistency gate DUMP`` (supervised) against the same command run in-process
  through ``main(argv)`` (``python -c``), as interleaved pairs of fresh processes: the start-up a CI job pays;
* ``call`` (``--calls N``): the pytest plugin's supervised check of user code — `call_supervised` of
  `run_step1_check` on the tiny model, in a fresh interpreter — against the same check in this process, after
  one warm-up check here (the session's imports already paid), as interleaved pairs.

Prints the median and the spread (min-max) of each ratio; timings on a shared machine are noisy, ratios of
interleaved pairs less so::

    python scripts/bench_supervisor.py --pairs 10 --calls 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _fork_overhead(repeats: int) -> tuple[float, float]:
    from rollout_consistency.safeguards.supervisor import run_supervised

    def nothing(_argv: list[str]) -> int:
        return 0

    start = time.perf_counter()
    for _ in range(repeats):
        nothing([])
    direct = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        try:
            code = run_supervised(nothing, [], "bench")
        except SystemExit as child:  # the child ends here (its SystemExit); only the parent goes on
            os._exit(int(child.code or 0))
        if code != 0:
            raise SystemExit("the supervised no-op did not hand over 0")
    return direct, (time.perf_counter() - start) / repeats


def _run(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="interleaved process pairs (default 10)")
    parser.add_argument("--forks", type=int, default=50, help="supervised no-op commands timed (default 50)")
    parser.add_argument("--calls", type=int, default=0, help="supervised/in-process check pairs (default 0: skip)")
    args = parser.parse_args()

    direct, supervised = _fork_overhead(args.forks)
    print(f"fork: supervised no-op {supervised * 1e3:.2f} ms, direct {direct * 1e6:.1f} us (mean of {args.forks})")

    from rollout_consistency.gate import write_dump

    with tempfile.TemporaryDirectory() as directory:
        dump = Path(directory) / "d.safetensors"
        table = np.full((8, 4), -1.0, dtype=np.float32)
        write_dump(dump, table, table.copy())
        supervised_argv = [sys.executable, "-m", "rollout_consistency", "gate", str(dump)]
        in_process_argv = [
            sys.executable,
            "-c",
            "import sys; from rollout_consistency.cli import main; sys.exit(main(sys.argv[1:]))",
            "gate",
            str(dump),
        ]
        _run(supervised_argv)  # warm the file cache
        ratios, times = [], []
        for i in range(args.pairs):
            order = (supervised_argv, in_process_argv) if i % 2 == 0 else (in_process_argv, supervised_argv)
            measured = {id(argv): _run(argv) for argv in order}
            with_, without = measured[id(supervised_argv)], measured[id(in_process_argv)]
            ratios.append(with_ / without)
            times.append((with_, without))
    median = statistics.median(ratios)
    extra = statistics.median(w - wo for w, wo in times)
    print(
        f"gate: supervised / in-process = {median:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) over "
        f"{args.pairs} pairs; median extra {extra * 1e3:.0f} ms on a median in-process run of "
        f"{statistics.median(wo for _, wo in times):.2f} s"
    )
    if args.calls:
        _call_overhead(args.calls)
    return 0


def _call_overhead(pairs: int) -> None:
    from rollout_consistency import load_config, run_step1_check
    from rollout_consistency.safeguards.supervised_call import call_supervised

    config = load_config(num_prompts=1, num_images_per_prompt=2, rollout_batch_size=2, progress=False)
    run_step1_check(config)  # the session's imports, paid once
    times = []
    for i in range(pairs):
        measured = {}
        for name in ("in-process", "supervised") if i % 2 == 0 else ("supervised", "in-process"):
            start = time.perf_counter()
            if name == "supervised":
                report = call_supervised(run_step1_check, config, prog="bench")
            else:
                report = run_step1_check(config)
            measured[name] = time.perf_counter() - start
            if not report.passed:
                raise SystemExit(f"the {name} check did not pass")
        times.append((measured["supervised"], measured["in-process"]))
    ratio = statistics.median(w / wo for w, wo in times)
    print(
        f"call: supervised / in-process check = {ratio:.2f} over {pairs} pairs; median extra "
        f"{statistics.median(w - wo for w, wo in times):.1f} s on a median in-process check of "
        f"{statistics.median(wo for _, wo in times):.2f} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
