"""A run's logged series read back from files the real trackers wrote (`gate.monitor.run_logs`), and the watched
figures step by step (`gate.monitor.watch_series`). The runs are logged the way verl's ``Tracking`` adapters log
a trainer's metrics dict, with verl-omni's consistency metrics (tests/tracked_runs.py)."""

from __future__ import annotations

import glob
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tracked_runs import run_metrics, write_runs

from rollout_consistency.gate.monitor.run_logs import RunLogError, open_run, read_run
from rollout_consistency.gate.monitor.watch_series import watch_table, watched


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("runs")
    rows = run_metrics()
    return rows, write_runs(directory, rows)


def same_value(stored: float, value: float, kind: str) -> bool:
    expected = float(np.float32(value)) if kind == "tensorboard" else value  # TensorBoard stores float32
    return stored == expected or (math.isnan(stored) and math.isnan(expected))


# ----------------------------------------------------------------------------------------------------
# Reading each format


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_each_trackers_files_read_back_every_point_at_its_step(runs, kind):
    rows, paths = runs
    log = read_run(paths[kind])
    assert log.kind == kind
    assert set(log.series) == set(rows[0])
    for name in rows[0]:
        points = log.series[name]
        assert [step for step, _ in points] == list(range(len(rows)))
        assert all(same_value(value, row[name], kind) for (_, value), row in zip(points, rows, strict=True)), name
    assert log.ended == {"tensorboard": None, "wandb": "exit 0", "mlflow": "FINISHED"}[kind]


def test_a_run_is_found_under_the_folder_the_trainer_logged_to(runs, tmp_path):
    _, paths = runs
    (wandb_run,) = glob.glob(os.path.join(paths["wandb"], "offline-run-*"))
    (wandb_file,) = glob.glob(os.path.join(wandb_run, "run-*.wandb"))
    (mlflow_run,) = glob.glob(os.path.join(paths["mlflow"], "0", "*", "meta.yaml"))
    for path, kind in (
        (wandb_run, "wandb"),
        (wandb_file, "wandb"),
        (os.path.dirname(mlflow_run), "mlflow"),
        (os.path.join(paths["mlflow"], "0"), "mlflow"),
        ("file:" + paths["mlflow"], "mlflow"),
        (glob.glob(os.path.join(paths["tensorboard"], "events.out.tfevents.*"))[0], "tensorboard"),
    ):
        assert open_run(path).kind == kind, path
    with pytest.raises(RunLogError, match=r"holds 3 runs .* name one of them"):
        open_run(os.path.dirname(paths["tensorboard"]))  # the folder holding all three
    assert open_run(os.path.dirname(paths["tensorboard"]), kind="mlflow").kind == "mlflow"
    with pytest.raises(RunLogError, match="no such file or folder"):
        open_run(tmp_path / "absent")
    with pytest.raises(RunLogError, match="holds no TensorBoard event files, a wandb"):
        open_run(tmp_path)
    with pytest.raises(RunLogError, match="unknown run format 'csv'"):
        open_run(paths["mlflow"], kind="csv")
    fake = tmp_path / "wandb" / "offline-run-x" / "run-x.wandb"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"not a wandb transaction log")
    with pytest.raises(RunLogError, match="is not a wandb transaction log"):
        read_run(fake)


def test_two_runs_in_one_folder_are_refused_naming_them(runs, tmp_path):
    _, paths = runs
    shutil.copytree(paths["mlflow"], tmp_path / "mlruns")
    (run,) = glob.glob(str(tmp_path / "mlruns" / "0" / "*" / "meta.yaml"))
    shutil.copytree(os.path.dirname(run), tmp_path / "mlruns" / "0" / "second")
    with pytest.raises(RunLogError, match=r"holds 2 runs \(.*second.*\); name one of them"):
        open_run(tmp_path / "mlruns")


# ----------------------------------------------------------------------------------------------------
# Reading a run still being written (--follow)


def test_wandb_log_read_while_written_never_loses_or_splits_a_record(runs, tmp_path):
    """The transaction log copied in growing prefixes, cut anywhere (mid-record, mid-block): each poll reads
    whole records only, and the last one holds exactly what one read of the whole file holds."""
    _, paths = runs
    (source,) = glob.glob(os.path.join(paths["wandb"], "offline-run-*", "run-*.wandb"))
    data = Path(source).read_bytes()
    assert len(data) > 2 * 32768  # records split across blocks
    whole = read_run(source)
    target = tmp_path / "run-live.wandb"
    target.write_bytes(b"")
    reader = open_run(target)
    cuts = sorted({3, 7, 8, 100, 32767, 32768, 32775, 40000, 65536 + 3, len(data) // 2, len(data) - 5, len(data)})
    written = 0
    for cut in cuts:
        with open(target, "ab") as handle:
            handle.write(data[written:cut])
        written = cut
        log = reader.poll()
        for name, points in log.series.items():
            assert points == whole.series[name][: len(points)], (cut, name)  # a prefix: nothing split or lost
    assert log.series == whole.series and log.ended == "exit 0"


def test_mlflow_and_tensorboard_read_while_written(runs, tmp_path):
    _, paths = runs
    (run,) = glob.glob(os.path.join(paths["mlflow"], "0", "*", "meta.yaml"))
    source = os.path.join(os.path.dirname(run), "metrics", "rollout_corr", "logprob_abs_diff_max")
    text = Path(source).read_bytes()
    live = tmp_path / "mlruns" / "0" / "r"
    (live / "metrics" / "rollout_corr").mkdir(parents=True)
    (live / "meta.yaml").write_text("run_id: r\nstatus: 1\n")
    target = live / "metrics" / "rollout_corr" / "logprob_abs_diff_max"
    target.write_bytes(text[: text.index(b"\n") + 5])  # one line and the start of the next
    reader = open_run(tmp_path / "mlruns")
    first = reader.poll()
    assert len(first.series["rollout_corr/logprob_abs_diff_max"]) == 1 and first.ended is None
    target.write_bytes(text)
    (live / "meta.yaml").write_text("run_id: r\nstatus: 3\n")
    last = reader.poll()
    assert (
        last.series["rollout_corr/logprob_abs_diff_max"]
        == read_run(source.rsplit("/metrics/", 1)[0]).series["rollout_corr/logprob_abs_diff_max"]
    )
    assert last.ended == "FINISHED"

    (events,) = glob.glob(os.path.join(paths["tensorboard"], "events.out.tfevents.*"))
    data = Path(events).read_bytes()
    folder = tmp_path / "tb"
    folder.mkdir()
    target = folder / os.path.basename(events)
    target.write_bytes(data[: len(data) // 2 + 3])  # cut inside a record
    reader = open_run(folder)
    half = reader.poll().series
    target.write_bytes(data)
    whole = reader.poll().series
    assert whole == read_run(events).series
    assert all(points == whole[name][: len(points)] for name, points in half.items())
    assert sum(map(len, half.values())) < sum(map(len, whole.values()))


# ----------------------------------------------------------------------------------------------------
# Watched names and what is wrong with a log


def test_watched_names_theirs_and_ours():
    assert watched("rollout_corr/logprob_abs_diff_max").figure == "rollout_corr/logprob_abs_diff_max"
    assert watched("step1/rollout_corr/k3_kl").prefix == "step1/"  # a step-1 report logged at each step
    assert watched("monitor/max_abs_dlogp").figure == "max_abs_dlogp"
    assert watched("ours/entries", prefix="ours/").figure == "entries"
    one = watched("rollout_corr/logprob_abs_diff/ts_750")
    assert (one.figure, one.prefix, one.timestep) == ("mean_abs_dlogp", "", 750.0)
    assert watched("rollout_corr/logprob_abs_diff/ts_1.234e+04").timestep == 12340.0
    assert watched("monitor/max_abs_dlogp_per_ts/ts_500").timestep == 500.0
    assert watched("step1/verdict/passed").figure == "verdict"
    for name in (
        "actor/rollout_corr/logprob_abs_diff_max",  # bypass mode: against the policy being updated
        "actor/ppo_kl",  # verl-omni's loss figure, measured during the update
        "step1/timestep/rollout_corr/logprob_abs_diff_max",  # a report's row, not a training step
        "rollout_corr/logprob_abs_diff_maxx",
        "myrollout_corr/kl",
        "max_abs_dlogp",  # ours only under the monitor's prefix
        "other/max_abs_dlogp",
    ):
        assert watched(name) is None, name


def test_repeated_out_of_order_nan_and_gaps_are_problems_of_their_step(tmp_path):
    """TensorBoard keeps whatever the trainer wrote: a resumed run logs steps again, a NaN is kept, a key
    skipped at one step leaves a gap. Each is a problem of the step it happened at, never dropped."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    for step, mean, maximum in ((0, 1e-5, 1e-4), (1, 1e-5, 1e-4), (2, 1e-5, None), (3, math.nan, 1e-4)):
        writer.add_scalar("rollout_corr/logprob_abs_diff_mean", mean, step)
        if maximum is not None:
            writer.add_scalar("rollout_corr/logprob_abs_diff_max", maximum, step)
    writer.add_scalar("rollout_corr/logprob_abs_diff_mean", 2e-5, 1)  # resumed from step 1's checkpoint
    writer.add_scalar("actor/rollout_corr/logprob_abs_diff_max", 0.5, 4)  # bypass mode's: not watched
    writer.close()
    table = watch_table(read_run(tmp_path))
    assert [row.step for row in table.rows] == [0, 1, 2, 3]
    problems = {row.step: row.problems for row in table.rows}
    assert problems[0] == ()
    assert problems[1] == ("rollout_corr/logprob_abs_diff_mean logged twice at step 1 (1e-05, then 2e-05)",)
    assert problems[2] == (
        "rollout_corr/logprob_abs_diff_max is missing at step 2 (a gap: it was logged from step 0 on)",
    )
    assert problems[3] == ("rollout_corr/logprob_abs_diff_mean is nan at step 3",)
    assert set(table.ignored) == {"actor/rollout_corr/logprob_abs_diff_max"}
