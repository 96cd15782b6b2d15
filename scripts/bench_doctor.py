#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the doctor costs next to the check it diagnoses.

    .venv/bin/python scripts/bench_doctor.py [--repeats 3]                 # plans of 1 and 4 batches
    .venv/bin/python scripts/bench_doctor.py --target [--repeats 5]        # the 4-batch target: doctor <= 1.5x check

For a FAILing check the doctor replays the one batch that holds the worst sample through both sides' own code
(`rollout_consistency.gate.diagnosis.replay`), compares the forwards and, when they agree, fits the step
settings. Each run here times one ``run_step1_check`` of a corpus case (tests/doctor_corpus: a user's own plug-in
pair with one bug) and splits it into the check's own work (``report.run["timings_s"]["total"]``, measured before
the doctor starts) and the doctor (the rest); the replay's own time (building both sides afresh and re-running
the batch under hooks) is ``facts["seconds"]``. The plan has 1 batch (4 samples) or 4 batches (16 samples, the
same rollout batch of 4): the doctor's cost stays one batch while the check's grows with the run.

``--target`` runs the 4-batch plan only and closes with the target's verdict: the doctor (its replay, and the
whole doctor) within ``--limit`` (1.5) times the check's own time on the same failing run, by the worst case's
median ratio.

Runs are interleaved (case by case, plan by plan, repeat by repeat); each line gives the median and the range of
each ratio over the repeats. Timings on a shared machine are noisy: compare ratios, not seconds.
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
#: The target's cases: one per loop style, the replay ending at a stage (autocast) or in the step fit.
TARGET_CASES = ("verl_omni_autocast", "flow_grpo_cfg_scale", "dance_grpo_sigma_index", "verl_omni_true_cfg_rescale")
ONE, FOUR = "1 batch (4 samples)", "4 batches (16 samples)"
PLANS = {ONE: dict(num_prompts=2), FOUR: dict(num_prompts=8)}


def run_once(case: str, plan: dict) -> tuple[float, float, float]:
    """(check seconds, doctor seconds, replay seconds) of one check of `case`."""
    from doctor_corpus.run import config_of, load_case

    from rollout_consistency import run_step1_check

    path = ROOT / "tests" / "doctor_corpus" / f"{case}.py"
    config = config_of(path, load_case(path)).replace(**plan)
    start = time.perf_counter()
    report = run_step1_check(config)
    wall = time.perf_counter() - start
    if report.status != "FAIL":
        raise SystemExit(f"{case}: the check gave {report.status}; the benchmark times the doctor on a FAIL")
    check = float(report.run["timings_s"]["total"])
    facts = next((d["details"]["facts"] for d in report.diagnosis if (d.get("details") or {}).get("facts")), {})
    return check, wall - check, float(facts.get("seconds", 0.0))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", action="store_true", help="the 4-batch plan only, with the target's verdict")
    parser.add_argument("--limit", type=float, default=1.5, help="the target: doctor / check at most this")
    args = parser.parse_args(argv)
    cases = TARGET_CASES if args.target else CASES
    plans = {FOUR: PLANS[FOUR]} if args.target else PLANS
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    run_once(cases[0], PLANS[ONE])  # warm-up: imports, first model builds
    for _ in range(args.repeats):
        for case in cases:
            for label, plan in plans.items():
                results.setdefault((case, label), []).append(run_once(case, plan))
    print(
        "| case | plan | check (s, median) | doctor (s, median) | replay (s, median) "
        "| doctor / check: median [min, max] | replay / check: median [min, max] |"
    )
    print("|---|---|---|---|---|---|---|")
    worst = {"doctor": 0.0, "replay": 0.0}
    for (case, label), runs in results.items():
        doctor_ratio = [doctor / check for check, doctor, _ in runs]
        replay_ratio = [replay / check for check, _, replay in runs]
        check, doctor, replay = (statistics.median(r[i] for r in runs) for i in range(3))
        print(
            f"| {case} | {label} | {check:.2f} | {doctor:.2f} | {replay:.2f} | {spread(doctor_ratio)} "
            f"| {spread(replay_ratio)} |"
        )
        if label == FOUR:
            worst["doctor"] = max(worst["doctor"], statistics.median(doctor_ratio))
            worst["replay"] = max(worst["replay"], statistics.median(replay_ratio))
    if args.target:
        verdict = lambda ratio: "met" if ratio <= args.limit else "NOT met"  # noqa: E731
        print(
            f"\ntarget (4 batches, doctor <= {args.limit}x the check, worst case's median): replay "
            f"{worst['replay']:.2f}x ({verdict(worst['replay'])}), whole doctor {worst['doctor']:.2f}x "
            f"({verdict(worst['doctor'])})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
