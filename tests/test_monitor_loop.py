"""The run monitor on a tiny flow_grpo-style GRPO loop (CPU, 50 steps): clean runs raise no alarm over 10 seeds; a
bug switched on at step k alarms at step k with sensible causes; a slow drift alarms before the mismatch reaches
the clip range. The loop is scripts/examples/flow_grpo_monitored.py; the figures are in docs/monitor.md."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rollout_consistency.gate import TableSettings
from rollout_consistency.gate.monitor import MonitorSettings
from rollout_consistency.gate.tables.dump import read_dump

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "examples" / "flow_grpo_monitored.py"
_SPEC = importlib.util.spec_from_file_location("flow_grpo_monitored", _PATH)
loop = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("flow_grpo_monitored", loop)
_SPEC.loader.exec_module(loop)

SETTINGS = MonitorSettings(gate=TableSettings(profile="implementation", clip_ratio=loop.CLIP_RANGE))
BUG_STEP = 25


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A few-ms loop: torch's thread pool on a shared 2-core machine costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(**options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitor warns on each alarm (on_alarm="log"); the results say it all
        return loop.run_loop(SETTINGS.replace(dump_dir=options.pop("dump_dir", None)), **options)


def test_clean_runs_raise_no_alarm_over_ten_seeds():
    for seed in range(10):
        result = _run(seed=seed, steps=50)
        summary = result.monitor.summary()
        assert summary.passed and summary.steps_judged == 50, (seed, summary.format())
        assert summary.floor is not None and summary.floor.steps == tuple(range(20))  # the first K = 20 steps


@pytest.fixture(scope="module")
def bug_runs(tmp_path_factory):
    dumps = tmp_path_factory.mktemp("monitor-dumps")
    return {
        bug: _run(seed=1, steps=BUG_STEP + 5, bug=bug, bug_step=BUG_STEP, dump_dir=dumps / bug)
        for bug in ("sync-drops-layer", "ema-bf16", "noise-schedule")
    }


@pytest.mark.parametrize(
    ("bug", "kind", "expected_causes"),
    [
        ("sync-drops-layer", "sync", ("different-weights",)),
        ("ema-bf16", "verdict", ("different-weights", "forward-precision")),
        ("noise-schedule", "verdict", ("noise-level-mismatch",)),
    ],
)
def test_a_bug_switched_on_at_step_k_alarms_at_step_k_naming_it(bug_runs, bug, kind, expected_causes):
    result = bug_runs[bug]
    assert result.first_alarm() == BUG_STEP
    record = result.monitor.alarm_records[0]
    assert record.step == BUG_STEP
    assert kind in [a.kind for a in record.alarms]
    assert set(expected_causes) <= set(record.causes), record.causes
    if kind == "sync":
        assert record.causes[0] == "different-weights"
        assert "weight sync" in record.format()
    # The step's tables were dumped, checksummed; the gate reaches the same FAIL from the dump.
    assert record.dump is not None and record.gate_status == "FAIL"
    dump = read_dump(record.dump)
    assert dump.metadata["step"] == str(BUG_STEP) and "tables_sha256" in dump.metadata
    assert not dump.gate(profile="implementation").passed


def test_a_slow_drift_alarms_before_the_mismatch_reaches_the_clip_range():
    result = _run(seed=2, steps=70, bug="drift", bug_step=25)
    reached = loop.steps_to_clip(result)
    first = result.first_alarm()
    assert reached is not None and first is not None
    assert 25 <= first < reached, (first, reached)
    assert result.first_alarm(("drift",)) == first  # the drift alarm, before any verdict fails
    assert first < (result.first_alarm(("verdict",)) or reached)
