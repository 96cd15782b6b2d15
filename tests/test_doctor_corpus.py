"""The doctor on code we did not write: every case of tests/doctor_corpus (a user's own plug-in loop in the shape of
flow_grpo, verl-omni or DanceGRPO, one bug on one side) must FAIL with a diagnosis on both paths, name the bug first
when it can replay both sides, and never call a difference noise when the report records no source of one.

`scripts/measure_doctor.py` prints the same runs as accuracy tables (docs/doctor.md)."""

from __future__ import annotations

import pytest
from doctor_corpus.run import Outcome, case_files, load_case, run_case

from rollout_consistency.gate.causes import NOT_A_BUG

CASES = case_files()


def test_the_corpus_covers_the_bugs_users_write():
    assert len(CASES) >= 14
    causes = {load_case(path)["expected"] for path in CASES}
    required = {
        "guidance-mismatch",
        "noise-level-mismatch",
        "sde-type-mismatch",
        "step-index",
        "logprob-offset",
        "logprob-reduction",
        "batch-composition",
        "bf16-latents",
        "text-conditioning",
        "model-input",
        "different-weights",
    }
    assert required <= causes, required - causes


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_the_doctor_names_the_bug_in_a_users_loop(path):
    outcome = run_case(path)
    if outcome.status == "PASS":
        # Only a rounding-sized case may pass: where this CPU's kernels do not depend on the batch, there is no
        # disagreement to diagnose.
        assert outcome.expected in NOT_A_BUG, f"{path.stem}: the gate passed a planted bug"
        pytest.skip("this CPU's kernels give the same bits for both batch compositions")
    report = outcome.localised_report
    assert outcome.localised and outcome.figures, "a FAIL without a diagnosis"
    top = report.diagnosis[0]
    assert Outcome.first(outcome.localised) == outcome.expected, (outcome.localised, top["evidence"])
    # The evidence comes from the replay of both sides' own code, and the replay is faithful.
    facts = (top.get("details") or {}).get("facts")
    assert facts is not None, top
    assert facts["replay"] == {"rollout_max_abs": 0.0, "trainer_max_abs": 0.0}
    # From the figures alone a difference is never called noise: no plug-in report records a kernel or batch
    # difference between the two sides.
    assert not NOT_A_BUG & {cause for cause, _ in outcome.figures}, outcome.figures
