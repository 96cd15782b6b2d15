"""The run monitor's hooks in loops written the way each project writes them (accelerate with accumulation, a plain
torch loop, verl-omni's batch, flow_grpo's samples dict in tests/test_monitor_loop.py), its alarm policies, trackers,
dumps, the NaN capture, the CI fixture, and bad input failing closed."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_consistency.gate.monitor import (
    MonitorAlarm,
    MonitorError,
    MonitorSettings,
    MonitorWarning,
    RunMonitor,
)
from rollout_consistency.training.nan_capture import NanCapture

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "examples" / "flow_grpo_monitored.py"
_SPEC = importlib.util.spec_from_file_location("flow_grpo_monitored", _PATH)
loop = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("flow_grpo_monitored", loop)
_SPEC.loader.exec_module(loop)

N, T, D = 8, 4, 16
TIMESTEPS = torch.linspace(1.0, 0.25, T)
EXACT = MonitorSettings(warmup_steps=2)


class Policy(torch.nn.Module):
    """Elementwise only: a row's log-prob does not depend on its batch-mates, so both sides agree bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(D, generator=generator))
        self.shift = torch.nn.Parameter(0.1 * torch.randn(D, generator=generator))

    def log_prob(self, x, t, x_next, *, bf16=False):
        h = x.bfloat16().float() if bf16 else x
        mean = torch.tanh(h * self.scale + self.shift * t[:, None])
        return (-((x_next - mean) ** 2) / 0.5 - math.log(0.5)).mean(dim=1)


def rollout(policy: Policy, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    latents, log_probs = [torch.randn(N, D, generator=generator)], []
    with torch.no_grad():
        for j in range(T):
            t = TIMESTEPS[j].expand(N)
            x_next = torch.tanh(latents[-1] * policy.scale + policy.shift * t[:, None])
            x_next = x_next + 0.5 * torch.randn(N, D, generator=generator)
            log_probs.append(policy.log_prob(latents[-1], t, x_next))
            latents.append(x_next)
    return {
        "latents": torch.stack(latents, 1),
        "log_probs": torch.stack(log_probs, 1),
        "timesteps": TIMESTEPS.expand(N, T),
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Loops of a few ms a step: torch's thread pool on a shared 2-core machine costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        yield


# ------------------------------------------------------------------------------------------------
def test_accelerate_accumulation_judges_the_cells_before_each_steps_first_real_update():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import GradientAccumulationPlugin

    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    )
    policy = Policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    monitor = RunMonitor(EXACT, optimizer=optimizer)
    entries = []
    for step in range(4):
        samples = rollout(policy, seed=step)
        monitor.begin_step(step)
        for rows in torch.arange(N).split(2):  # four micro-batches; accumulation 2: real updates after 2 and 4
            with accelerator.accumulate(policy):
                for j in range(T):
                    t = samples["timesteps"][rows, j]
                    log_prob = policy.log_prob(samples["latents"][rows, j], t, samples["latents"][rows, j + 1])
                    monitor.record(samples["log_probs"][rows, j], log_prob, timesteps=t, sample_ids=rows)
                    accelerator.backward(-(torch.exp(log_prob - samples["log_probs"][rows, j])).mean())
                optimizer.step()
                optimizer.zero_grad()
        entries.append((monitor.last_verdict.step, monitor.last_figures.entries, monitor.last_figures.samples))
    summary = monitor.close()
    assert summary.passed and summary.steps_judged == 4, summary.format()
    # AcceleratedOptimizer.step() skips the inner step until the gradients sync: both micro-batches before the first
    # real update (4 samples x 4 steps) are each step's first recompute; the two after it are not.
    assert entries == [(s, 16, 4) for s in range(4)]


def test_a_plain_torch_loop_with_a_bf16_bug_from_step_3_alarms_at_step_3():
    policy = Policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    monitor = RunMonitor(EXACT, optimizer=optimizer)
    with _quiet():
        for step in range(6):
            samples = rollout(policy, seed=step)
            monitor.begin_step(step)
            for rows in torch.arange(N).split(4):
                for j in range(T):
                    t = samples["timesteps"][rows, j]
                    x, x_next = samples["latents"][rows, j], samples["latents"][rows, j + 1]
                    log_prob = policy.log_prob(x, t, x_next, bf16=step >= 3)
                    monitor.record(samples["log_probs"][rows, j], log_prob, timesteps=t)
                    (-log_prob.mean()).backward()
                optimizer.step()  # an update after each micro-batch: only the first is the step's first recompute
                optimizer.zero_grad()
    summary = monitor.close()
    assert [a.step for a in summary.alarms if a.kind == "verdict"] == [3, 4, 5]
    assert monitor.alarm_records[0].step == 3 and monitor.alarm_records[0].causes
    assert monitor.last_figures.entries == 4 * T  # one micro-batch of 4 samples x 4 steps, no sample ids


def _verl_batch(seed: int, engine, trainer) -> dict:
    """verl-omni's batch: the rollout's ``rollout_log_probs`` and the actor's ``old_log_probs`` (compute_log_prob
    before update_policy), with ``timesteps``."""
    sched = loop.scheduler()
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randn(loop.GROUPS, loop.D, generator=generator).repeat_interleave(loop.GROUP_SIZE, 0)
    samples = loop.rollout(engine, sched, prompts, generator, loop.NOISE_LEVEL)
    with torch.no_grad():
        old = torch.stack([loop.compute_log_prob(trainer, sched, samples, j) for j in range(loop.STEPS)], 1)
    return {"rollout_log_probs": samples["log_probs"], "old_log_probs": old, "timesteps": samples["timesteps"]}


def test_verl_omni_batch_is_observed_whole_and_bypass_mode_is_refused():
    engine, trainer = loop.VelocityModel(0), loop.VelocityModel(0)
    monitor = RunMonitor(EXACT.replace(profile="implementation"))
    for step in range(3):
        batch = _verl_batch(step, engine, trainer)
        verdict = monitor.observe(
            step, batch["rollout_log_probs"], batch["old_log_probs"], timesteps=batch["timesteps"]
        )
        assert verdict.passed, verdict
    figures = monitor.last_figures.scalars()
    assert "monitor/rollout_corr/logprob_abs_diff_mean" in figures
    assert "monitor/rollout_corr/logprob_abs_diff/ts_1000" in figures
    batch = _verl_batch(3, engine, trainer)
    batch["old_log_probs"] = batch["rollout_log_probs"]  # verl-omni's bypass mode
    with pytest.raises(MonitorError, match="bypass mode"):
        monitor.observe(3, batch["rollout_log_probs"], batch["old_log_probs"])
    assert monitor.close().passed


# ------------------------------------------------------------------------------------------------
def _bad_step(monitor: RunMonitor, step: int, optimizer, policy: Policy) -> None:
    samples = rollout(policy, seed=step)
    monitor.begin_step(step)
    for j in range(T):
        t = samples["timesteps"][:, j]
        log_prob = policy.log_prob(samples["latents"][:, j], t, samples["latents"][:, j + 1], bf16=step >= 1)
        monitor.record(samples["log_probs"][:, j], log_prob, timesteps=t)
        (-log_prob.mean()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_policy_raise_stops_the_update_and_stop_asks_the_loop_to_end():
    policy = Policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    monitor = RunMonitor(EXACT, optimizer=optimizer, on_alarm="raise")
    _bad_step(monitor, 0, optimizer, policy)
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(MonitorAlarm, match="step 1") as raised:
        _bad_step(monitor, 1, optimizer, policy)
    assert raised.value.record.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))  # not updated
    monitor.close()

    stopper = RunMonitor(EXACT, optimizer=optimizer, on_alarm="stop")
    with _quiet():
        _bad_step(stopper, 0, optimizer, policy)
        assert not stopper.should_stop
        _bad_step(stopper, 1, optimizer, policy)
    assert stopper.should_stop
    stopper.close()

    logger = RunMonitor(EXACT, optimizer=optimizer)
    _bad_step(logger, 0, optimizer, policy)
    with pytest.warns(MonitorWarning, match="step 1: verdict"):
        _bad_step(logger, 1, optimizer, policy)
    logger.close()


class _BrokenTracker:
    """A tracker whose disk is full (verl's Tracking shape: ``log(data, step=...)``)."""

    def log(self, data, step):
        raise OSError("No space left on device")


def test_trackers_get_every_step_and_a_failing_one_only_warns(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = np.random.default_rng(0)
    rollout_lp = rng.normal(-1.0, 0.1, (8, 4)).astype(np.float32)
    monitor = RunMonitor(EXACT, log_to=[f"tensorboard:{tmp_path / 'tb'}", _BrokenTracker()])
    with pytest.warns(MonitorWarning, match=r"No space left on device\); training goes on") as caught:
        for step in range(3):
            monitor.observe(step, rollout_lp, rollout_lp.copy())
    assert len([w for w in caught if "logging step" in str(w.message)]) == 3
    assert monitor.close().passed
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    series = events.Scalars("monitor/rollout_corr/logprob_abs_diff_mean")
    assert [e.step for e in series] == [0, 1, 2] and all(e.value == 0 for e in series)
    assert [e.value for e in events.Scalars("monitor/verdict/passed")] == [1.0, 1.0, 1.0]


def test_a_dump_that_cannot_be_written_is_reported(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    rollout_lp = np.zeros((4, 2), np.float32) - 1
    monitor = RunMonitor(EXACT, dump_dir=blocker)
    with pytest.warns(MonitorWarning, match="could not be dumped"):
        monitor.observe(0, rollout_lp, rollout_lp + 1e-3)
    record = monitor.alarm_records[0]
    assert record.dump is None and "could not be dumped" in record.dump_error
    assert "could not be dumped" in record.format()


def test_a_nan_step_alarms_and_names_the_nan_capture(tmp_path):
    policy = Policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    capture = NanCapture(policy, optimizer, tmp_path / "captures")
    monitor = RunMonitor(EXACT, nan_capture=capture)
    rollout_lp = np.full((4, 2), -1.0, np.float32)
    with pytest.warns(MonitorWarning, match="nonfinite"):
        monitor.observe(0, rollout_lp, np.full((4, 2), np.nan, np.float32))  # an all-NaN step
    record = monitor.alarm_records[0]
    assert record.alarms[0].kind == "nonfinite" and "8 NaN/inf" in record.alarms[0].message
    assert "captures" in record.notes[0]
    assert not monitor.close().passed


# ------------------------------------------------------------------------------------------------
def test_bad_input_fails_closed():
    rng = np.random.default_rng(1)
    table = rng.normal(-1.0, 0.1, (4, 3)).astype(np.float32)
    assert not RunMonitor(EXACT).close().passed  # a monitor that saw no step
    monitor = RunMonitor(EXACT)
    monitor.observe(0, table, table.copy())
    with pytest.raises(MonitorError, match="repeated"):
        monitor.observe(0, table, table.copy())
    with pytest.warns(MonitorWarning, match="shape"):
        verdict = monitor.observe(1, table[:, :2].copy(), table[:, :2].copy())  # the window changed mid-run
    assert not verdict.passed and verdict.alarms[0].kind == "shape"
    with pytest.warns(MonitorWarning, match="gap"):
        monitor.observe(5, table, table.copy())  # steps 2..4 never judged
    with pytest.raises(MonitorError, match="shape"):
        monitor.observe(6, table, table[:, :2].copy())
    assert not monitor.close().passed

    recorder = RunMonitor(EXACT)
    with pytest.raises(MonitorError, match="begin_step"):
        recorder.record(table[:, 0], table[:, 0])
    recorder.begin_step(0)
    with pytest.raises(MonitorError, match="nothing recorded"):
        recorder.end_step()
    recorder.begin_step(1)
    with pytest.raises(MonitorError, match="same memory"):
        recorder.record(table[:, 0], table[:, 0])  # one column on both sides: nothing would be compared
    column = torch.from_numpy(table[:, 1].copy())
    with pytest.raises(MonitorError, match="same memory"):
        recorder.record(column, column.numpy())  # a tensor and its NumPy view, copied apart before judging
    recorder.record(table[:, 0], table[:, 0].copy(), sample_ids=np.arange(4))
    with pytest.raises(MonitorError, match="some record"):
        recorder.record(table[:, 1], table[:, 1].copy())
    with pytest.raises(MonitorError, match="float32"):
        recorder.record(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(MonitorError, match="steps must increase"):
        recorder.begin_step(0)


def test_memory_stays_bounded_over_many_failing_steps():
    rollout_lp = np.full((2, 2), -1.0, np.float32)
    monitor = RunMonitor(EXACT.replace(max_alarms_kept=5))
    with _quiet():
        for step in range(60):
            monitor.observe(step, rollout_lp, rollout_lp + 1e-3)
    summary = monitor.close()
    assert summary.alarm_counts["verdict"] == 60 and len(summary.alarms) == 5 and len(monitor.alarm_records) == 5


# ------------------------------------------------------------------------------------------------
CI_TESTS = f"""
import importlib.util, sys
import pytest
spec = importlib.util.spec_from_file_location("flow_grpo_monitored", {str(_PATH)!r})
loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loop)

def tiny_loop(make_monitor, steps, bug=None):
    import torch
    trainer = loop.VelocityModel(0)
    engine = loop.VelocityModel(0)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=3e-3)
    monitor = make_monitor(optimizer=optimizer)
    sched = loop.scheduler()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randn(loop.GROUPS, loop.D, generator=generator).repeat_interleave(loop.GROUP_SIZE, 0)
    for step in range(steps):
        samples = loop.rollout(engine, sched, prompts, generator, 0.6 if bug and step >= 2 else loop.NOISE_LEVEL)
        monitor.begin_step(step)
        loop.train(trainer, sched, optimizer, samples, generator, monitor)
        engine.load_state_dict(trainer.state_dict())

def test_smoke(run_monitor):
    summaries = run_monitor(tiny_loop, steps=4, profile="implementation")
    assert summaries[0].steps_judged == 4

def test_smoke_bug(run_monitor):
    run_monitor(lambda make, steps: tiny_loop(make, steps, bug=True), steps=4, profile="implementation")

def test_too_few_steps(run_monitor):
    run_monitor(lambda make, steps: tiny_loop(make, 2), steps=4, profile="implementation")

def test_no_monitor(run_monitor):
    run_monitor(lambda make, steps: None, steps=4)

@pytest.mark.run_monitor(tiny_loop, steps=3, profile="implementation")
def test_marked(run_monitor_summary):
    assert run_monitor_summary[0].passed
"""


def test_ci_fixture_and_marker_fail_on_any_alarm(pytester):
    pytester.makepyfile(test_smoke=CI_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore::UserWarning")
    outcomes = {
        r.nodeid.split("::")[-1]: r.outcome
        for r in result.reprec.getreports("pytest_runtest_logreport")
        if r.when == "call"
    }
    assert outcomes == {
        "test_smoke": "passed",
        "test_smoke_bug": "failed",
        "test_too_few_steps": "failed",
        "test_no_monitor": "failed",
        "test_marked": "passed",
    }, result.stdout.str()[-3000:]
    text = result.stdout.str()
    assert "run monitor FAILED" in text and "judged 2 of the 4 steps" in text and "never called make_monitor" in text


def test_a_dump_changed_after_it_was_written_is_refused(tmp_path):
    from rollout_consistency.gate.tables.dump import DumpFormatError, read_dump

    rollout_lp = np.full((4, 2), -1.0, np.float32)
    monitor = RunMonitor(EXACT, dump_dir=tmp_path)
    with pytest.warns(MonitorWarning):
        monitor.observe(0, rollout_lp, rollout_lp + 1e-3)
    path = Path(monitor.alarm_records[0].dump)
    assert not read_dump(path).gate().passed
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(DumpFormatError, match="checksum"):
        read_dump(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a CUDA tensor's host copies are what hid it")
def test_one_cuda_table_on_both_sides_is_refused_before_it_is_copied_to_the_host():
    table = torch.full((4, 3), -1.0, device="cuda")
    monitor = RunMonitor(EXACT)
    with pytest.raises(MonitorError, match="same memory"):
        monitor.observe(0, table, table)  # verl-omni's bypass mode on the GPU: each .cpu() is a fresh copy
    monitor.begin_step(1)
    with pytest.raises(MonitorError, match="same memory"):
        monitor.record(table[:, 0], table[:, 0])
