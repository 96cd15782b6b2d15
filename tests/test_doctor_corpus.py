"""The doctor on code we did not write: every case of tests/doctor_corpus (a user's own plug-in loop in the shape of
flow_grpo, verl-omni or DanceGRPO, one bug on one side) must FAIL with a diagnosis on both paths, name the bug first
when it can replay both sides, and never call a difference noise when the report records no source of one; the
confidences the doctor declares must be those it earns here.

`scripts/measure_doctor.py` prints the same runs as accuracy tables (docs/doctor.md)."""

from __future__ import annotations

import pytest
from doctor_corpus.run import Outcome, case_files, load_case, run_case

from rollout_consistency.gate.diagnosis.catalogue import CONFIDENCE, NOT_A_BUG

CASES = case_files()
_RUNS: dict[str, Outcome] = {}


def outcome(path) -> Outcome:
    """Each case runs once per session (the calibration test reads them all)."""
    if path.stem not in _RUNS:
        _RUNS[path.stem] = run_case(path)
    return _RUNS[path.stem]


def test_the_corpus_covers_the_bugs_users_write():
    assert len(CASES) >= 24
    causes = {load_case(path)["expected"] for path in CASES}
    required = {
        "schedule-shift",
        "prediction-precision",
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
        "train-mode",
        "adapter-scale",
        "attention-processor",
    }
    assert required <= causes, required - causes


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_the_doctor_names_the_bug_in_a_users_loop(path):
    case = outcome(path)
    if case.status == "PASS":
        # Only a rounding-sized case may pass: where this CPU's kernels do not depend on the batch, there is no
        # disagreement to diagnose.
        assert case.expected in NOT_A_BUG, f"{path.stem}: the gate passed a planted bug"
        pytest.skip("this CPU's kernels give the same bits for both batch compositions")
    top = case.localised_report.diagnosis[0]
    # (No figures-only run where the trainer scored nothing: a user then has no trainer table to give gate().)
    assert case.localised and (case.figures or case.figures_report is None), "a FAIL without a diagnosis"
    assert Outcome.first(case.localised) == case.expected, (case.localised, top["evidence"])
    # Evidence is what was measured: a case names what its replay must have matched, and claims that would be false.
    declared = load_case(path)
    text = "\n".join(top["evidence"])
    assert all(line in text for line in declared.get("evidence", ())), (declared["evidence"], top["evidence"])
    everything = "\n".join(e for d in case.localised_report.diagnosis for e in d["evidence"])
    assert not [line for line in declared.get("absent", ()) if line in everything], top["evidence"]
    # The evidence comes from the replay of both sides' own code, and the replay is faithful; or, where the trainer
    # could score nothing (its scheduler holds none of the rollout's timesteps), from the guard that says so.
    facts = (top.get("details") or {}).get("facts")
    assert facts is not None, top
    if top["source"] == "guard":
        assert "schedule" in facts and [c for c in case.localised_report.verdict.checks if c.name == "schedule"]
    elif case.expected == "train-mode":
        # A dropout in training mode draws its masks from the global RNG: the replay draws other masks than the
        # check did, so the side in training mode is not reproduced (and the evidence says by how much); the
        # other side is.
        bugged = load_case(path)["side"]
        other = "rollout" if bugged == "trainer" else "trainer"
        assert facts["replay"][f"{other}_max_abs"] == 0.0 < facts["replay"][f"{bugged}_max_abs"], facts["replay"]
    else:
        assert facts["replay"] == {"rollout_max_abs": 0.0, "trainer_max_abs": 0.0}
    # No line asserts what the replay did not show (it never sees which sample a side scored).
    assert not any(
        "other than the one it stepped on" in e for d in case.localised_report.diagnosis for e in d["evidence"]
    )
    # From the figures alone a difference is never called noise: no plug-in report records a kernel or batch
    # difference between the two sides.
    assert not NOT_A_BUG & {cause for cause, _ in case.figures}, case.figures


#: What the stage evidence of a case must say: both sides' values, at the stage where they part.
STAGE_EVIDENCE = {
    "dance_grpo_time_shift": ("the rollout's from shift 3 over linspace(1, 0, 5)", "the trainer's from shift 1 over"),
    "flow_grpo_scheduler_shift": ("the rollout's sigmas from shift 3 over", "the trainer's from shift 1 over"),
    "flow_grpo_guidance_rescale": (
        "CFG stage: the conditional and unconditional predictions agree bit for bit",
        ("the trainer's uncond + 4.5·(cond − uncond), rescaled by guidance_rescale 0.7"),
    ),
    "verl_omni_cfg_renorm": (
        "(cfg_rescale, cfg_renorm)",
        "the trainer's uncond + 4·(cond − uncond), renormalised to 1·‖cond‖",
    ),
    "verl_omni_bf16_noise_pred": ("the rollout's is unrounded", "the trainer's rounded to bfloat16 before CFG"),
    "dance_grpo_bf16_pred": ("the rollout's is unrounded", "the trainer's rounded to bfloat16 before the step"),
}


@pytest.mark.parametrize("name", sorted(STAGE_EVIDENCE))
def test_the_evidence_names_both_sides_at_the_stage_where_they_part(name):
    case = outcome(next(p for p in CASES if p.stem == name))
    text = " ".join(case.localised_report.diagnosis[0]["evidence"])
    for part in STAGE_EVIDENCE[name]:
        assert part in text, text


def test_gate_names_a_noise_level_mismatch_from_its_tables_not_bf16_latents():
    """A user with two tables (trainer noise_level 0.8, rollout 0.7, 8 samples per timestep): Δlogp moves with the
    rollout's own log-prob within each timestep, the signature of another transition std, not of a rounded sample."""
    from doctor_corpus.run import config_of, tables

    from rollout_consistency.gate import gate

    path = next(p for p in CASES if p.stem == "verl_omni_noise_level")
    config = config_of(path, load_case(path)).replace(num_prompts=4, sde_window_kind="fixed")
    rollout, trainer, timesteps = tables(config)
    causes = gate(rollout, trainer, timesteps=timesteps).diagnosis
    assert causes[0]["cause"] == "noise-level-mismatch" and causes[0]["source"] == "tables", causes[:2]
    assert causes[0]["details"]["tables"]["steady"]  # the same std ratio at every timestep
    assert "bf16-latents" not in [d["cause"] for d in causes]


def test_declared_confidences_are_what_the_corpus_measures():
    """A confidence is the share of cases its kind of evidence named rightly, (right + 1) / (cases + 2); where a
    kind ranked first here at least 4 times, the declared value must be within 0.15 of the measured one."""
    hits: dict[str, list[bool]] = {}
    for path in CASES:
        case = outcome(path)
        if case.status != "FAIL":
            continue
        for report, causes in ((case.localised_report, case.localised), (case.figures_report, case.figures)):
            if report is None:  # no figures-only run: the trainer scored nothing
                continue
            top = [c for c, v in causes if v >= causes[0][1]]
            hits.setdefault(report.diagnosis[0]["kind"], []).append(case.expected in top)
    measured = {kind: ((sum(h) + 1) / (len(h) + 2), len(h)) for kind, h in hits.items()}
    for kind, (estimate, count) in measured.items():
        if count >= 4:
            assert abs(CONFIDENCE[kind] - estimate) <= 0.15, (kind, CONFIDENCE[kind], estimate, count)


CONTROLS = sorted((CASES[0].parent / "controls").glob("*_clean.py"))


@pytest.mark.parametrize("path", CONTROLS, ids=[p.stem for p in CONTROLS])
def test_a_loop_without_a_bug_passes(path):
    """No false alarm on the corpus's loops as written, one per loop style (DanceGRPO's stores whole-number
    timesteps, int(sigma * 1000), which the windows guard once took for another schedule)."""
    from doctor_corpus.run import config_of

    from rollout_consistency import run_step1_check

    assert len(CONTROLS) == 3
    report = run_step1_check(config_of(path, load_case(path)))
    assert report.status == "PASS", report.verdict.reasons
