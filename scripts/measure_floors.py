# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Measure the tolerance model: null cases and pitfalls over many launcher seeds (docs/checker.md).

    python scripts/measure_floors.py              # 20 seeds, the default check sizes (~ minutes on 2 cores)
    python scripts/measure_floors.py --seeds 3    # quick

For each case (float32 / bfloat16 x {kernel, batch composition, implementation}, and every ``--inject``)
and each seed the check runs once with the ``calibrated`` profile — which measures every source of
difference present — and the same metrics are judged under exact / implementation / kernel / calibrated.
The table gives the largest max |dlogp| and calibrated floor over seeds, then per profile the worst *load*
(deviation / limit of the worst gated metric: <= 1 passes) and the number of FAILs. Exit code 1 if a null
case has a false alarm under kernel or calibrated, or a pitfall passes under implementation, kernel or
calibrated.
"""

from __future__ import annotations

import argparse
import sys
import time

from floor_sweep import format_results, null_cases, pitfall_cases, problems_of, sweep  # beside this script

from rollout_consistency.gate.config import INJECTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="launcher seeds 0..N-1 per case (default 20)")
    parser.add_argument(
        "--slow-pitfall-seeds",
        type=int,
        default=None,
        help="seeds for the 256 px bf16 pitfalls (bf16-latents, stepwise-bf16; ~1 min a run on 2 cores); default --seeds",
    )
    parser.add_argument("--no-pitfalls", action="store_true", help="null cases only")
    args = parser.parse_args(argv)
    slow = ("bf16-latents", "stepwise-bf16")
    slow_seeds = args.seeds if args.slow_pitfall_seeds is None else args.slow_pitfall_seeds
    start = time.perf_counter()

    def progress(case, seed, report):
        print(f"  {case.name} seed {seed}: {report.status} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    results = sweep(null_cases(), range(args.seeds), progress=progress)
    if not args.no_pitfalls:
        fast = [n for n in INJECTIONS if n not in slow]
        results += sweep(pitfall_cases(fast), range(args.seeds), progress=progress)
        results += sweep(pitfall_cases(slow), range(slow_seeds), progress=progress)
    print(format_results(results))
    problems = problems_of(results)
    print(f"\n{len(results)} cases, seeds 0..N-1 as in the 'seeds' column, in {time.perf_counter() - start:.0f} s")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("false alarms (kernel, calibrated): 0; pitfalls detected: all" if not problems else "")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
