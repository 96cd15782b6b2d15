"""The doctor: every `--inject` pitfall named first (from the figures of real reports), and disagreements of
our own making localised to the stage where the two sides part (replays on the tiny real Qwen-Image)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_consistency import Report
from rollout_consistency.adapters import INJECTION_NAMES, BatchRequests, SamplingSettings, qwen_image
from rollout_consistency.adapters.pitfalls import StockMaskSumRope
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image
from rollout_consistency.cli import main
from rollout_consistency.gate.diagnosis.catalogue import NOT_A_BUG
from rollout_consistency.gate.diagnosis.doctor import attach_diagnosis, diagnose, rediagnose
from rollout_consistency.gate.diagnosis.localise import SideSpec, localise
from rollout_consistency.gate.diagnosis.localised_causes import from_localisation
from rollout_consistency.schedulers import SDEWindow

# Real reports of `rollout-consistency check --inject NAME --json` (default settings; written before the doctor
# existed, so they carry no diagnosis: the doctor reads the figures alone).
REPORTS = Path(__file__).parent / "doctor_reports"


def load(name: str) -> Report:
    return Report.from_json((REPORTS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", INJECTION_NAMES)
def test_every_injected_pitfall_is_named_first_from_its_figures(name):
    causes = diagnose(load(name))
    assert causes and causes[0].cause == name, [c.cause for c in causes]
    assert causes[0].evidence and causes[0].fix


def test_a_long_guard_message_is_evidence_cut_where_a_sentence_ends():
    """The windows guard's message (686 characters here) is cut at its last sentence end within 300 characters,
    never inside a word or a name (it was cut at "(rollout_consis"), and says where the whole message is."""
    report = load("per-request-window")
    message = next(c.message for c in report.verdict.checks if c.name == "windows")
    (evidence,) = next(d for d in diagnose(report) if d.cause == "per-request-window").evidence
    head, _, pointer = evidence.removeprefix("windows guard: ").partition(" … ")
    assert len(message) > 300 and message.startswith(head) and head.endswith("not the policy.")
    assert pointer == "(the whole message is under FAIL because)" and message in report.reasons[0]
    checks = tuple(
        dataclasses.replace(c, message="rollouts used different SDE windows: 2 groups split; draw per group.")
        if c.name == "windows"
        else c
        for c in report.verdict.checks
    )
    short = dataclasses.replace(report, verdict=dataclasses.replace(report.verdict, checks=checks))
    (evidence,) = next(d for d in diagnose(short) if d.cause == "per-request-window").evidence
    assert evidence == "windows guard: rollouts used different SDE windows: 2 groups split; draw per group."  # whole


def test_a_clean_pass_needs_no_diagnosis_and_a_near_limit_pass_gets_one():
    report = load("per-request-window")
    clean = dataclasses.replace(report, verdict=dataclasses.replace(report.verdict, checks=()))
    assert diagnose(dataclasses.replace(clean, verdict=_passing(report.verdict))) == ()
    near = load("mask-sum-rope")
    near = dataclasses.replace(
        near,
        verdict=_passing(near.verdict),
        tolerance=dataclasses.replace(near.tolerance, limits={"max_abs_dlogp": 2e-3}),
    )
    assert "near-limit" in [d.cause for d in diagnose(near)]


def _passing(verdict):
    return dataclasses.replace(verdict, checks=tuple(dataclasses.replace(c, passed=True) for c in verdict.checks))


def test_a_rollout_engine_failure_is_diagnosed():
    """A batch whose engine failed (no entries at all) still gets a cause, not an empty diagnosis."""
    from rollout_consistency.gate.judging.verdict import Problem, decide

    report = load("per-request-window")
    failed = decide(None, report.tolerance, [Problem("rollout", "batch 0: the vLLM-omni engine failed: CUDA OOM")])
    causes = diagnose(dataclasses.replace(report, verdict=failed, metrics=None))
    assert causes[0].cause == "worker-failure" and "CUDA OOM" in causes[0].evidence[0], causes


def test_a_failed_calibration_guard_is_a_guard_cause(monkeypatch):
    """A check whose calibration floor cannot be compared (the floor run returned one row short) FAILs its
    calibration guard; the doctor names `calibration` as the guard's cause: source and kind ``guard``, the guard's
    message its evidence (its source was ``signature``, the figures', though no figure was read)."""
    import rollout_consistency.gate.check as check_module
    from rollout_consistency import run_step1_check

    real = check_module.run_batch

    def short_floor(backend, batch):
        result = real(backend, batch)
        return dataclasses.replace(result, floor_log_probs=result.floor_log_probs[:1].copy())

    monkeypatch.setattr(check_module, "run_batch", short_floor)
    report = run_step1_check(
        profile="calibrated", progress=False, num_prompts=2, num_images_per_prompt=2, rollout_batch_size=2
    )
    (guard,) = [c for c in report.verdict.checks if c.name == "calibration" and not c.passed]
    (cause,) = [d for d in report.diagnosis if d["cause"] == "calibration"]
    assert cause["source"] == "guard" and cause["kind"] == "guard", cause
    assert cause["evidence"] == ["calibration guard: " + guard.message], cause
    # Read back (`rollout-consistency doctor REPORT.json`), the guard's cause is derived again, the same.
    again = [d for d in rediagnose(Report.from_json(report.to_json()), ()) if d.cause == "calibration"]
    assert [(d.source, d.kind) for d in again] == [("guard", "guard")]


def test_diagnosis_reaches_json_table_and_the_first_line_of_junit(tmp_path):
    report = attach_diagnosis(load("bf16-latents"))
    data = json.loads(report.to_json())
    first = data["diagnosis"][0]
    assert {"cause", "summary", "evidence", "fix"} <= set(first) and first["cause"] == "bf16-latents"
    assert Report.from_dict(data).diagnosis[0]["cause"] == "bf16-latents"
    table = report.format_table()
    assert table.index("[bf16-latents]") < table.index("ratio_mean")  # the cause comes before the figures
    root = ET.fromstring(report.to_junit() if hasattr(report, "to_junit") else _junit(report, tmp_path))
    failure = root.find(".//failure")
    assert failure.get("message").startswith("likely cause [bf16-latents]")
    assert failure.text.splitlines()[0].startswith("likely cause [bf16-latents]")


def _junit(report, tmp_path):
    path = tmp_path / "r.xml"
    report.write_junit(path)
    return path.read_text().split("\n", 1)[1]


def test_gate_of_a_users_tables_carries_the_diagnosis():
    """`gate()` on a user's own tables: a FAIL names its likely cause; a clean PASS carries none."""
    import numpy as np

    from rollout_consistency.gate import gate

    rollout = np.random.default_rng(0).normal(-3.0, 0.1, size=(16, 4)).astype(np.float32)
    assert gate(rollout, rollout.copy()).diagnosis == ()
    report = gate(rollout, rollout + np.float32(2e-4))  # every entry off by the same amount
    assert not report.passed and report.diagnosis
    assert {"cause", "summary", "evidence", "fix"} <= set(report.diagnosis[0])
    assert json.loads(report.to_json())["diagnosis"] == [dict(d) for d in report.diagnosis]


def test_a_rounding_level_gate_fail_is_never_called_noise_without_a_recorded_source():
    """Tables alone record no kernels or batches: a rounding-sized difference is then a different computation
    (or, when every entry moves by the same amount, a constant offset), never `attention-kernel` or
    `batch-composition`; the evidence says what the report does not record and how to localise."""
    import numpy as np

    from rollout_consistency.gate import gate

    rng = np.random.default_rng(0)
    rollout = rng.normal(-3.0, 0.1, size=(16, 4)).astype(np.float32)
    signs = np.sign(rng.normal(size=rollout.shape)).astype(np.float32)
    offset = gate(rollout, rollout + np.float32(2e-7)).diagnosis
    assert offset[0]["cause"] == "logprob-offset" and offset[0]["source"] == "tables", offset
    causes = gate(rollout, (rollout + 2e-7 * signs).astype(np.float32)).diagnosis
    assert [d["cause"] for d in causes] == ["different-computation"]
    assert not NOT_A_BUG & {d["cause"] for d in offset + causes}
    evidence = " | ".join(causes[0]["evidence"])
    assert "spread both ways" in evidence or "two-sided" in evidence
    assert "records neither side's attention kernel nor its batch composition" in evidence
    assert "--rollout-backend" in evidence and "None" not in evidence


def test_a_rounding_level_fail_is_a_kernel_difference_where_the_report_records_one():
    import numpy as np

    from rollout_consistency.gate import gate

    rng = np.random.default_rng(0)
    rollout = rng.normal(-3.0, 0.1, size=(16, 4)).astype(np.float32)
    trainer = (rollout + 2e-7 * np.sign(rng.normal(size=rollout.shape))).astype(np.float32)
    report = gate(rollout, trainer)
    recorded = {"rollout_backend": "torch", "rollout_attention": "native", "trainer_attention": "_native_math"}
    recorded |= {"rollout_batch_size": 4, "micro_batch_size": 4}
    causes = diagnose(dataclasses.replace(report, config=recorded))
    assert causes[0].cause == "attention-kernel", causes
    assert "records different attention: rollout native (torch), trainer _native_math" in causes[0].evidence[-1]
    recorded |= {"trainer_attention": "native", "micro_batch_size": 1}
    assert diagnose(dataclasses.replace(report, config=recorded))[0].cause == "batch-composition"


def test_doctor_command_reads_an_earlier_report(tmp_path, capsys):
    out = tmp_path / "diagnosis.json"
    assert main(["doctor", str(REPORTS / "mask-sum-rope.json"), "--json", str(out)]) == 0
    assert "[mask-sum-rope]" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["cause"] == "mask-sum-rope"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["doctor", str(bad)]) == 2
    bad.write_text(json.dumps({"schema": "something-else"}))
    assert main(["doctor", str(bad)]) == 2
    assert main(["doctor", str(tmp_path / "missing.json")]) == 2
    assert "check --json" in capsys.readouterr().err


BAD_REPORTS = {
    # name: (file content, what the one-line error must say)
    "a JSON list": ("[1, 2]", "holds a JSON list"),
    "missing fields": (None, "lacks metrics, samples"),
    "another version": (None, "schema_version 99"),
    "another schema": (None, "has schema 'someone-elses-report', not a step-1 report"),
    "a malformed diagnosis entry": (None, "malformed step-1 report"),
    "not JSON": ("{not json", "is not JSON"),
}


@pytest.mark.parametrize("name", list(BAD_REPORTS))
def test_bad_input_to_the_doctor_is_a_one_line_usage_error(name, tmp_path, capsys):
    text, expected = BAD_REPORTS[name]
    if text is None:
        data = json.loads((REPORTS / "bf16-latents.json").read_text())
        if name == "missing fields":
            del data["metrics"], data["samples"]
        elif name == "another version":
            data["schema_version"] = 99
        elif name == "another schema":
            data["schema"] = "someone-elses-report"
        else:
            data["diagnosis"] = [{"summary": "no cause"}]
        text = json.dumps(data)
    path = tmp_path / "report.json"
    path.write_text(text)
    assert main(["doctor", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert "Traceback" not in err and ("check --json" in err or "run the check again" in err), err


# ---------------------------------------------------------------------------------------------- localisation
@pytest.fixture(scope="module")
def model():
    return load_qwen_image()


@pytest.fixture(scope="module")
def trajectory(model):
    encoder = TinyPromptEncoder()
    # Short prompts padded wider, padded keys visible: the setting in which text RoPE lengths matter.
    cond = encoder.conditioning(["a cat", "a red cube on a table"], pad_to=12)
    return qwen_image.rollout(
        model,
        cond,
        height=32,
        width=32,
        num_inference_steps=4,
        requests=BatchRequests(seeds=[1, 2], windows=SDEWindow(1, 2, 4), denoise_to_end=False),
        sampling=SamplingSettings(noise_level=0.7),
        mask_text_padding=False,
    )


def rollout_side(model, **changes):
    return dataclasses.replace(SideSpec("rollout", model, rows_per_forward=2, draws_sample=True), **changes)


def trainer_side(model, **changes):
    return dataclasses.replace(SideSpec("trainer", model, rows_per_forward=2), **changes)


def perturbed_weights(model):
    other = load_qwen_image()
    with torch.no_grad():
        other.proj_out.weight.add_(1e-3)
    return other


def rounded_timestep_velocity(transformer, latents, timesteps, *args, **kwargs):
    # A trainer that builds one model input differently: the timestep through bf16.
    return qwen_image.velocity(transformer, latents, timesteps.bfloat16().float(), *args, **kwargs)


CASES = {
    # name: (rollout changes, trainer changes, expected first stage prefix, expected cause)
    "noise_level differs": ({}, {"noise_level": 0.6}, "transition.", "settings-mismatch"),
    "timestep computed differently": ({}, {"velocity": rounded_timestep_velocity}, "inputs.timestep", "model-input"),
    "text lengths from mask.sum()": (
        {"model": "stock-rope"},
        {},
        "inputs.text_lengths",
        "mask-sum-rope",
    ),
    "other attention kernel": ({}, {"attention": "_native_math"}, "blocks.0", "attention-kernel"),
    "different weights": ({}, {"model": "perturbed"}, "weights", "different-weights"),
}


#: Cases whose size is float32 rounding of a forward: whether (and how far) they show depends on this CPU's kernels.
ROUNDING_CASES = {"other attention kernel"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_disagreement_is_localised_to_its_stage(case, model, trajectory):
    rollout_changes, trainer_changes, stage, cause = CASES[case]
    trainer_changes = dict(trainer_changes)
    trainer_model = perturbed_weights(model) if trainer_changes.pop("model", None) else model
    rollout_changes = dict(rollout_changes)
    if rollout_changes.pop("model", None):
        rollout_changes["model"] = StockMaskSumRope(model)
    replays_the_maker = not rollout_changes
    rollout_model = rollout_changes.pop("model", model)
    loc = localise(
        trajectory, rollout_side(rollout_model, **rollout_changes), trainer_side(trainer_model, **trainer_changes)
    )
    if replays_the_maker:  # the replay of the rollout that made the trajectory reproduces its log-probs
        assert loc.replay_max_abs == 0
    if case in ROUNDING_CASES and loc.first_stage is None:
        # Two kernels may agree bit for bit on this CPU for these shapes: then no stage may differ.
        assert all(s.max_abs == 0 for s in loc.stages), loc.describe()
        return
    assert loc.first_stage is not None and loc.first_stage.startswith(stage), loc.describe()
    assert from_localisation(loc, {}).cause == cause
    log_prob = next(s for s in loc.stages if s.stage == "log_prob")
    if case not in ROUNDING_CASES:  # a rounding-level velocity difference may round away in the log-prob
        assert log_prob.max_abs > 0  # the disagreement reaches the log-prob


def test_identical_sides_agree_at_every_stage(model, trajectory):
    loc = localise(trajectory, rollout_side(model), trainer_side(model))
    assert loc.first_stage is None and loc.replay_max_abs == 0 and not loc.settings
    # Computation order: "first differing stage" means the first in this list.
    assert [s.stage for s in loc.stages] == [
        "inputs.latents",
        "inputs.timestep",
        "inputs.conditioning",
        "inputs.text_lengths",
        "rope",
        "embed",
        "blocks.0",
        "blocks.1",
        "velocity",
        "transition.mean",
        "transition.std",
        "scored_sample",
        "log_prob",
    ]


def test_batch_composition_is_named_when_it_changes_the_forward(model, trajectory):
    loc = localise(trajectory, rollout_side(model), trainer_side(model, rows_per_forward=1))
    assert loc.setting_names() == ("rows_per_forward",)
    if loc.first_stage is None:
        # This CPU's kernels are batch-invariant for these shapes (the floor, measured here, is 0).
        assert all(s.max_abs == 0 for s in loc.stages)
    else:
        assert from_localisation(loc, {}).cause == "batch-composition", loc.describe()
        assert next(s for s in loc.stages if s.stage == "log_prob").max_abs < 1e-5  # rounding, not a bug


def test_stored_latents_rounded_after_scoring_are_localised_to_the_scored_sample(trajectory, model):
    # The bf16-latents bug on stored float32 latents: the store rounds latents[:, k+1] after the log-prob.
    rounded = trajectory.latents.clone()
    rounded[:, 1:] = rounded[:, 1:].bfloat16().float()
    stored = dataclasses.replace(trajectory, latents=rounded)
    loc = localise(stored, rollout_side(model), trainer_side(model))
    assert loc.first_stage in ("inputs.latents", "scored_sample"), loc.describe()
    first_window_step = loc.stages[[s.stage for s in loc.stages].index(loc.first_stage)]
    assert first_window_step.max_abs > 0


def test_the_check_attaches_a_localised_diagnosis():
    from rollout_consistency import run_step1_check

    report = run_step1_check(inject="mask-sum-rope", progress=False, num_prompts=2, num_images_per_prompt=1)
    top = report.diagnosis[0]
    assert top["cause"] == "mask-sum-rope" and top["source"] == "localisation", top
    assert top["details"]["first_stage"] == "inputs.text_lengths"


def test_windows_drawn_per_request_are_named_alone_not_tied_with_the_plan_window():
    """Windows drawn per request are not the plan's windows either, so the check's windows guard gives both reasons
    (`check --inject per-request-window` since the guard compares each side with the plan); the plan-window reason is
    the per-request one's consequence: one cause, `per-request-window`, its evidence its own reason (before, the two
    tied at the guard's confidence, and the evidence was cut before the per-request reason began)."""
    from rollout_consistency.gate.judging.verdict import PLAN_WINDOW_MARK, Problem, decide, plan_window_problems

    report = load("per-request-window")
    (per_request,) = [c.message for c in report.verdict.checks if c.name == "windows"]
    planned = np.array([[505.664, 283.847]] * 2, dtype=np.float32)
    (plan,) = plan_window_problems(
        "rollout", np.zeros((2, 2)), 2, [0, 1], timesteps=planned[:, ::-1].copy(), expected=planned
    )
    assert PLAN_WINDOW_MARK in plan
    both = decide(report.metrics, report.tolerance, [Problem("windows", plan), Problem("windows", per_request)])
    causes = diagnose(dataclasses.replace(report, verdict=both))
    assert [d.cause for d in causes] == ["per-request-window"], [(d.cause, d.evidence) for d in causes]
    assert causes[0].evidence[0].startswith("windows guard: " + per_request[:60])
    # Alone, the plan-window reason still names its own cause.
    alone = decide(report.metrics, report.tolerance, [Problem("windows", plan)])
    assert diagnose(dataclasses.replace(report, verdict=alone))[0].cause == "window-plan"


def test_the_check_with_windows_drawn_per_request_names_per_request_window_alone():
    """End to end (the injection draws each request's window from the batch's seed, so the run is repeatable):
    `check --inject per-request-window` FAILs its windows guard with both reasons (per request, and not the plan's),
    and the doctor names `per-request-window` first and alone, from the report and in the check's own diagnosis."""
    from rollout_consistency import run_step1_check
    from rollout_consistency.gate.judging.verdict import PER_REQUEST_WINDOW_MARKS, PLAN_WINDOW_MARK

    report = run_step1_check(inject="per-request-window", progress=False, num_prompts=2, num_images_per_prompt=2)
    (windows,) = [c.message for c in report.verdict.checks if c.name == "windows" and not c.passed]
    assert PLAN_WINDOW_MARK in windows and any(mark in windows for mark in PER_REQUEST_WINDOW_MARKS), windows
    causes = diagnose(report)
    assert [d.cause for d in causes] == ["per-request-window"], [(d.cause, d.confidence) for d in causes]
    assert (causes[0].source, causes[0].kind) == ("guard", "guard")
    assert [d["cause"] for d in report.diagnosis] == ["per-request-window"]


@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_trainer_micro_batches_smaller_than_the_rollouts_are_not_read_as_the_cause(micro_batch_size):
    """The trainer's smaller forwards pass one `img_shapes` entry per row (fewer rows) and, without padded rows,
    no text mask: per-row inputs compared row by row, and a mask that masks nothing is no mask; the bug still
    is the stored latents rounded after scoring."""
    from rollout_consistency import run_step1_check

    # Batch-invariant mode: the forwards of both sides give a row the same bits on any CPU (else another CPU's
    # batch-dependent kernels could part them first, at rounding level).
    report = run_step1_check(
        inject="bf16-latents",
        micro_batch_size=micro_batch_size,
        batch_invariant=True,
        progress=False,
        num_prompts=2,
        num_images_per_prompt=2,
    )
    assert not report.passed
    top = report.diagnosis[0]
    assert top["cause"] == "bf16-latents" and top["source"] == "localisation", top
