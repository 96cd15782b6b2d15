#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the doctor costs next to the check it diagnoses.

    .venv/bin/python scripts/bench_doctor.py [--repeats 3]

For a FAILing check the doctor replays the one batch that holds the worst sample through both sides' own code
(`rollout_consistency.gate.diagnosis.replay`), compares the forwards and, when they agree, fits the step
settings. Each run here times one ``run_step1_check`` of a corpus case (tests/doctor_corpus) and splits it into
the check's own work (``report.run["timings_s"]["total"]``, measured before the doctor starts) and the doctor
(the rest; its replay's own time is ``facts["seconds"]``). The plan has 1 batch (4 samples) or 4 batches (16
samples, the same rollout batch of 4): the doctor's cost stays one batch while the check's grows with the run.

Runs are interleaved (case by case, plan by plan, repeat by repeat); each line gives the median and the range of
``doctor / check`` over the repeats. Timings on a shared machine are noisy: compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CASES = ("verl_omni_noise_level", "flow_grpo_cfg_scale", "dance_grpo_sigma_index", "verl_omni_mask_dropped")
PLANS = {"1 batch (4 samples)": dict(num_prompts=2), "4 batches (16 samples)": dict(num_prompts=8)}


def run_once(case: str, plan: dict) -> tuple[float, float, float]:
    """(check seconds, doctor seconds, replay seconds) of one check of `case`."""
    from doctor_corpus.run import config_of, load_case

    from rollout_consistency import run_step1_check

    path = ROOT / "tests" / "doctor_corpus" / f"{case}.py"
    config = config_of(path, load_case(path)).replace(**plan)
    start = time.perf_counter()
    report = run_step1_check(config)
    wall = time.perf_counter() - start
    check = float(report.run["timings_s"]["total"])
    facts = next((d["details"]["facts"] for d in report.diagnosis if (d.get("details") or {}).get("facts")), {})
    return check, wall - check, float(facts.get("seconds", 0.0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    run_once(CASES[0], PLANS["1 batch (4 samples)"])  # warm-up: imports, first model builds
    for _ in range(args.repeats):
        for case in CASES:
            for label, plan in PLANS.items():
                results.setdefault((case, label), []).append(run_once(case, plan))
    print(
        "| case | plan | check (s, median) | doctor (s, median) | replay (s, median) | doctor / check: median [min, max] |"
    )
    print("|---|---|---|---|---|---|")
    for (case, label), runs in results.items():
        ratios = [doctor / check for check, doctor, _ in runs]
        check, doctor, replay = (statistics.median(r[i] for r in runs) for i in range(3))
        print(
            f"| {case} | {label} | {check:.2f} | {doctor:.2f} | {replay:.2f} | "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
