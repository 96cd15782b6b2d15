"""`rollout-consistency watch RUN` on runs the real trackers wrote (`test_watch_run_logs.write_runs`: verl's Tracking
adapters' calls, verl-omni's metrics dict): the first alarming step and its likely cause, JSON / JUnit / PNG, exit 1
on any alarm, 0 when clean, 2 with nothing to judge; bad logs (NaN, repeated steps, gaps) FAIL; ``--follow`` on a
run being written."""

from __future__ import annotations

import json
import math
import threading
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from tracked_runs import TIMESTEPS, offline_env, run_metrics, verl_omni_metrics, write_runs

from rollout_consistency.cli import main
from rollout_consistency.gate.monitor.figures import StepStats

STEPS, FAULT = 14, 9


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """14 steps; from step 9 the last timestep's trainer log-probs move by 5e-3 (a late-step schedule mismatch)."""
    return write_runs(tmp_path_factory.mktemp("faulty"), run_metrics(STEPS, fault_from=FAULT))


def watch(*args: str) -> int:
    return main(["watch", *args])


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_a_fault_is_found_at_its_step_with_its_cause_in_every_format(faulty, kind, tmp_path, capsys):
    outputs = {name: str(tmp_path / f"w.{name}") for name in ("json", "junit", "plot")}
    flags = [f"--{flag}={path}" for flag, path in outputs.items()]
    code = watch(faulty[kind], "--profile", "kernel", "--warmup-steps", "5", *flags)
    out = capsys.readouterr().out
    assert code == 1
    assert f"first alarm: step {FAULT}: verdict: " in out
    assert "likely cause: the gap grew at 1 of 4 timesteps: t=250" in out
    with open(outputs["json"]) as handle:
        report = json.load(handle)
    assert report["status"] == "FAIL" and report["first_alarm"]["step"] == FAULT
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))
    assert [s["passed"] for s in report["steps"]] == [step < FAULT for step in range(STEPS)]
    assert report["summaries"]["verl"]["floor"]["steps"] == [0, 1, 2, 3, 4]
    suite = ET.parse(outputs["junit"]).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == (str(STEPS), str(STEPS - FAULT))
    failed = [case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None]
    assert failed == [f"step {s}" for s in range(FAULT, STEPS)]
    with open(outputs["plot"], "rb") as handle:
        assert handle.read(4) == b"\x89PNG"


def test_the_drift_alarm_finds_a_growth_below_the_profiles_limits(tmp_path, capsys):
    """A gap 30x the floor at one timestep stays under every kernel limit: the per-step verdict passes, and
    only the drift alarm (CUSUM against the run's own floor) fires, at the fault's step."""
    rows = run_metrics(30)
    for step in range(8, 30):  # every mean-type figure 20x (mean |Δlogp| ~1.6e-4 < 3e-4); the max unchanged
        rows[step] = {k: v * 20 if ("/ts_" in k or k.endswith("_mean")) else v for k, v in rows[step].items()}
    paths = write_runs(tmp_path, rows)
    assert watch(paths["mlflow"], "--profile", "kernel", "--warmup-steps", "5", "--json", str(tmp_path / "w.json")) == 1
    report = json.loads((tmp_path / "w.json").read_text())
    kinds = {a["kind"] for s in report["steps"] for a in s["alarms"]}
    assert kinds == {"drift"}
    assert report["first_alarm"]["step"] > 8 and "growing since step 8" in report["first_alarm"]["message"]
    assert all(s["passed"] for s in report["steps"][:8])


def test_a_clean_run_passes_with_exit_0(tmp_path, capsys):
    paths = write_runs(tmp_path, run_metrics(STEPS))
    for kind in ("tensorboard", "mlflow"):
        assert watch(paths[kind], "--profile", "kernel") == 0, capsys.readouterr().out
        out = capsys.readouterr().out
        assert f"PASS: {STEPS} steps judged (steps 0..{STEPS - 1}), profile kernel" in out
        assert "alarms: none" in out
    # the exact profile: bf16 noise is a gap at every step
    assert watch(paths["mlflow"]) == 1
    assert "first alarm: step 0: verdict: " in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------
# Nothing to judge, bad logs


def tensorboard_run(directory, points):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for step, name, value in points:
        writer.add_scalar(name, value, global_step=step)
    writer.close()
    return str(directory)


def test_nothing_to_judge_is_exit_2_never_a_pass(tmp_path, capsys):
    run = tensorboard_run(tmp_path / "bypass", [(s, "actor/rollout_corr/logprob_abs_diff_max", 0.1) for s in range(3)])
    assert watch(run) == 2
    err = capsys.readouterr().err
    assert "holds no rollout/trainer consistency series (only bypass mode's actor/rollout_corr/*" in err
    run = tensorboard_run(tmp_path / "loss", [(s, "actor/pg_loss", 0.1) for s in range(3)])
    assert watch(run) == 2
    assert "nothing to judge. verl-omni logs rollout_corr/logprob_abs_diff_* when" in capsys.readouterr().err
    run = tensorboard_run(tmp_path / "timesteps", [(s, "rollout_corr/logprob_abs_diff/ts_800", 1e-5) for s in range(3)])
    assert watch(run) == 2  # per-timestep series alone hold no gated figure
    assert watch(str(tmp_path / "absent")) == 2
    assert "no such file or folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(1, 1e-5), (2, math.nan), (3, 1e-5)], "step 2: log: rollout_corr/logprob_abs_diff_max is nan at step 2"),
        ([(1, 1e-5), (2, 1e-5), (2, 2e-5), (3, 1e-5)], "step 2: log: rollout_corr/logprob_abs_diff_max logged twice"),
        ([(1, 1e-5), (3, 1e-5), (2, 1e-5)], "step 2: log: rollout_corr/logprob_abs_diff_max at step 2 was logged"),
        ([(1, 1e-5), (2, 1e-5), (4, 1e-5)], "step 4: gap: step 4 follows step 2"),
    ],
    ids=["nan", "repeated", "out-of-order", "gap"],
)
def test_a_bad_log_fails(tmp_path, capsys, points, expected):
    run = tensorboard_run(
        tmp_path / "run", [(step, "rollout_corr/logprob_abs_diff_max", value) for step, value in points]
    )
    assert watch(run, "--profile", "kernel", "--warmup-steps", "1", "--json", str(tmp_path / "w.json")) == 1
    report = json.loads((tmp_path / "w.json").read_text())
    alarms = [f"step {a['step']}: {a['kind']}: {a['message']}" for s in report["steps"] for a in s["alarms"]]
    assert any(alarm.startswith(expected) for alarm in alarms), alarms


def test_a_series_missing_at_one_step_is_a_gap_of_that_step(tmp_path, capsys):
    points = [(s, "rollout_corr/logprob_abs_diff_max", 1e-5) for s in range(4) if s != 2]
    points += [(s, "rollout_corr/logprob_abs_diff_mean", 1e-6) for s in range(4)]
    assert watch(tensorboard_run(tmp_path, points), "--profile", "kernel") == 1
    out = capsys.readouterr().out
    assert "first alarm: step 2: log: rollout_corr/logprob_abs_diff_max is missing at step 2" in out


# ----------------------------------------------------------------------------------------------------
# Our own names: the monitor's scalars, a step-1 report logged each step


def test_a_verl_omni_run_that_also_has_the_run_monitor_is_judged_per_source_never_logged_twice(tmp_path, capsys):
    """The trainer logs verl-omni's ``rollout_corr/*`` and the run monitor logs its figures into the same tracker
    at every step (two log calls a step, as both would): no series is logged twice, and watch judges both."""
    rng = np.random.default_rng(5)
    timesteps = np.tile(np.array(TIMESTEPS, np.float32), (4, 1))
    rows, steps = [], []
    for step in range(6):
        rollout = rng.normal(-1.0, 0.1, (4, len(TIMESTEPS))).astype(np.float32)
        trainer = rollout.copy()
        if step == 4:
            trainer[1, 2] += np.float32(1e-3)
        rows.append(verl_omni_metrics(trainer, rollout, timesteps))
        rows.append(StepStats.from_tables(rollout, trainer, timesteps=timesteps).figures().scalars())
        steps += [step, step]
    paths = write_runs(tmp_path, rows, steps)
    for kind in ("tensorboard", "mlflow"):
        assert watch(paths[kind], "--json", str(tmp_path / f"{kind}.json")) == 1  # exact profile: step 4
        report = json.loads((tmp_path / f"{kind}.json").read_text())
        assert set(report["sources"]) == {"verl", "monitor/"}, kind
        messages = [a["message"] for s in report["steps"] for a in s["alarms"]]
        assert not any("logged twice" in m for m in messages), (kind, messages)
        assert report["first_alarm"]["step"] == 4
        assert {s["step"] for s in report["steps"] if not s["passed"]} == {4}
        assert report["steps"][0]["figures"]["monitor/"]["entries"] == 4 * len(TIMESTEPS)


def test_a_logged_step1_fail_is_an_alarm(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    from rollout_consistency.gate import gate

    writer = SummaryWriter(log_dir=str(tmp_path))
    rng = np.random.default_rng(0)
    for step in range(3):
        rollout = rng.normal(-1.0, 0.1, (4, 2)).astype(np.float32)
        trainer = rollout + np.float32(1e-2 if step == 2 else 0.0)
        gate(rollout, trainer).log_to(writer, step=step, plot=False)
    writer.close()
    assert watch(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "first alarm: step 2: verdict: " in out and "sources: step1/" in out


# ----------------------------------------------------------------------------------------------------
# --follow


def test_follow_stops_at_the_first_alarm_of_a_run_being_written(tmp_path, capsys):
    """A trainer thread logs one step every 0.15 s to TensorBoard; the watch tails it and stops at the fault."""
    from torch.utils.tensorboard import SummaryWriter

    rows = run_metrics(40, fault_from=7)
    writer = SummaryWriter(log_dir=str(tmp_path), flush_secs=1)
    stop = threading.Event()

    def trainer():
        for step, data in enumerate(rows):
            if stop.is_set():
                break
            for key, value in data.items():
                writer.add_scalar(key, value, global_step=step)
            writer.flush()
            time.sleep(0.15)
        writer.close()

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        code = watch(str(tmp_path), "--profile", "kernel", "--follow", "--poll", "0.05", "--idle-exit", "20")
    finally:
        stop.set()
        thread.join()
    out = capsys.readouterr().out
    assert code == 1
    assert "step 6: PASS" in out and "step 7: ALARM verdict:" in out
    assert "step 8:" not in out  # it stopped at the first alarm
    assert "first alarm: step 7" in out


def test_follow_a_clean_run_until_it_marks_its_end(tmp_path, capsys):
    import mlflow
    from mlflow.tracking import MlflowClient

    rows = run_metrics(8)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in offline_env(tmp_path).items():
            patch.setenv(name, value)
        client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
        run = client.create_run("0")

        def trainer():
            for step, data in enumerate(rows):
                metrics = [mlflow.entities.Metric(k, v, 0, step) for k, v in data.items()]
                client.log_batch(run.info.run_id, metrics=metrics)
                time.sleep(0.1)
            client.set_terminated(run.info.run_id, status="FINISHED")

        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            code = watch(str(tmp_path / "mlruns"), "--profile", "kernel", "--follow", "--poll", "0.05")
        finally:
            thread.join()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS: 8 steps judged (steps 0..7)" in out
    assert "has not marked its end" not in out


def test_a_logged_step1_verdict_of_fail_alone_is_an_alarm(tmp_path, capsys):
    """A report that FAILed on a guard (coverage, aliasing) logs figures within limits and verdict/passed 0."""
    points = [(s, "step1/rollout_corr/logprob_abs_diff_max", 0.0) for s in range(3)]
    points += [(s, "step1/verdict/passed", 0.0 if s == 1 else 1.0) for s in range(3)]
    assert watch(tensorboard_run(tmp_path, points)) == 1
    out = capsys.readouterr().out
    assert "first alarm: step 1: verdict: step1/verdict/passed = 0: the step-1 report logged at this step" in out


def test_a_step_is_judged_once_its_series_are_all_in_and_a_step_logged_again_later_alarms():
    """--follow: the last step's series may still be arriving, so it waits for a later step or the run's end; a
    step logged again after it was judged (a resumed run) is an alarm then."""
    from rollout_consistency.gate.monitor import MonitorSettings
    from rollout_consistency.gate.monitor.run_logs import RunLog
    from rollout_consistency.gate.monitor.run_watch import RunWatch
    from rollout_consistency.gate.monitor.watch_series import watch_table

    maximum, mean = "rollout_corr/logprob_abs_diff_max", "rollout_corr/logprob_abs_diff_mean"
    watcher = RunWatch(MonitorSettings().replace(profile="kernel"))

    def seen(series, ended=None, final=False):
        return watcher.update(watch_table(RunLog("run", "tensorboard", series, ended)), final=final)

    partial = seen({maximum: ((0, 1e-5), (1, 1e-5)), mean: ((0, 1e-6),)})  # step 1's mean not written yet
    assert [s.step for s in partial.steps] == [0]
    whole = seen({maximum: ((0, 1e-5), (1, 1e-5)), mean: ((0, 1e-6), (1, 1e-6))}, ended="exit 0")
    assert [s.step for s in whole.steps] == [0, 1] and whole.passed
    again = seen({maximum: ((0, 1e-5), (1, 1e-5), (0, 2e-5)), mean: ((0, 1e-6), (1, 1e-6))}, final=True)
    assert not again.passed
    assert [(a.step, a.message) for a in again.late_alarms] == [
        (0, "rollout_corr/logprob_abs_diff_max logged twice at step 0 (1e-05, then 2e-05)")
    ]
