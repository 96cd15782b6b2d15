"""Reports in TensorBoard, wandb and MLflow (`Report.log_to`, ``--log``, ``Step1Recorder(log_to=...)``), each
read back from the tracker's own files: TensorBoard's event files, a wandb offline run's transaction log and
media files, MLflow's local file store through `MlflowClient`. No network: wandb runs offline, MLflow on a
``file:`` store under the test's temporary directory. The field's names carry the field's numbers: every
``actor/...`` and ``rollout_corr/...`` figure is checked against verl-omni's and verl's formulas."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import struct
import sys
import time

import numpy as np
import pytest
import torch

from rollout_consistency.cli import main
from rollout_consistency.gate import Step1Recorder, gate, write_dump
from rollout_consistency.gate.judging.loggers import (
    LOGGED_NAMES,
    LoggerError,
    TrackerSpec,
    check_target,
    parse_tracker,
    tracker_rows,
    tracker_scalars,
)
from rollout_consistency.gate.judging.metrics import METRIC_NAMES
from rollout_consistency.gate.judging.mismatch import ADVANTAGE_NAMES, MISMATCH_NAMES
from rollout_consistency.gate.judging.report import Report

N, T, MICRO = 6, 3, 2
TIMESTEPS = np.array([1000.0, 750.0, 500.0], dtype=np.float32)


def tables(offset: float = 2e-3):
    """Rollout log-probs and a trainer's that differ by a few 1e-3 per entry (a FAIL under every profile)."""
    rng = np.random.default_rng(3)
    rollout = rng.normal(-1.0, 0.1, (N, T)).astype(np.float32)
    trainer = (rollout + rng.normal(offset, 3e-3, (N, T))).astype(np.float32)
    return rollout, trainer


@pytest.fixture
def failing():
    rollout, trainer = tables()
    advantages = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=np.float32)
    return gate(
        rollout,
        trainer,
        timesteps=np.tile(TIMESTEPS, (N, 1)),
        advantages=advantages,
        micro_batch_size=MICRO,
        clip_ratio=1e-3,
    )


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker's files under tmp_path; nothing reaches a network."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    _forget_wandb_settings()
    return tmp_path


def _forget_wandb_settings() -> None:
    """wandb reads the environment once per process, at its first run (a docs example's, say): tear that down so
    the next run reads this test's offline settings instead of asking for an API key."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()


# ----------------------------------------------------------------------------------------------------
# Names


def field_definitions(rollout: np.ndarray, trainer: np.ndarray, clip: float, micro: int) -> dict[str, float]:
    """The field's figures, computed as their code computes them (float64 torch). The actor's per (micro-batch,
    step) cell, then averaged (verl-omni's diffusion_algos.py: FlowGRPOLoss, FlowDPPOLoss for approx_kl); the
    rollout correction pooled over the batch (verl's rollout_corr_helper.compute_offpolicy_metrics, verl-omni's
    rollout_correction.py)."""
    old, new = torch.tensor(rollout, dtype=torch.float64), torch.tensor(trainer, dtype=torch.float64)
    cells: dict[str, list[float]] = {}
    for start in range(0, old.shape[0], micro):
        for j in range(old.shape[1]):
            log_ratio = new[start : start + micro, j] - old[start : start + micro, j]
            ratio = torch.exp(log_ratio)
            for name, value in {
                "actor/ppo_kl": torch.mean(-log_ratio),
                "actor/pg_clipfrac": torch.mean((torch.abs(ratio - 1.0) > clip).float()),
                "actor/pg_clipfrac_higher": torch.mean((ratio - 1.0 > clip).float()),
                "actor/pg_clipfrac_lower": torch.mean((1.0 - ratio > clip).float()),
                "actor/ratio_mean": ratio.mean(),
                "actor/ratio_std": ratio.std(),  # FlowGRPOLoss: torch's default, ddof 1
                "actor/approx_kl": (0.5 * log_ratio.pow(2)).mean(),
            }.items():
                cells.setdefault(name, []).append(float(value))
    figures = {name: float(np.mean(values)) for name, values in cells.items()}
    log_ratio = new - old
    safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    figures.update(
        {
            "rollout_corr/kl": float(torch.mean(old - new)),
            "rollout_corr/k3_kl": float(torch.mean(torch.exp(log_ratio) - log_ratio - 1)),
            "rollout_corr/chi2_token": float(torch.mean(torch.exp(safe).square()) - 1.0),
            "rollout_corr/logprob_abs_diff_mean": float(log_ratio.abs().mean()),
            "rollout_corr/logprob_abs_diff_max": float(log_ratio.abs().max()),
            "rollout_corr/log_ppl_diff": float((old.mean(dim=-1) - new.mean(dim=-1)).mean()),
            "rollout_corr/log_ppl_abs_diff": float((old.mean(dim=-1) - new.mean(dim=-1)).abs().mean()),
            "rollout_corr/ppl_ratio": float(torch.exp(old.mean(dim=-1) - new.mean(dim=-1)).mean()),
            "rollout_corr/chi2_seq": float(torch.exp(2.0 * torch.clamp(log_ratio.sum(dim=-1), -20.0, 20.0)).mean() - 1),
        }
    )
    return figures


def test_every_figure_has_a_name_and_a_field_name_gives_the_fields_number(failing):
    named = {key.split(".", 1)[1] for key in LOGGED_NAMES if key.startswith("metrics.")}
    assert named == set(METRIC_NAMES)
    assert {key.split(".", 1)[1] for key in LOGGED_NAMES if key.startswith("mismatch.")} == set(
        MISMATCH_NAMES + ADVANTAGE_NAMES
    )
    names = [name for name, _ in LOGGED_NAMES.values()]
    assert len(set(names)) == len(names)
    assert {name.split("/")[0] for name in names} == {"actor", "rollout_corr", "consistency"}

    rollout, trainer = tables()
    reference = field_definitions(rollout, trainer, clip=1e-3, micro=MICRO)
    scalars = tracker_scalars(failing, prefix="")
    fields = {name: value for name, value in scalars.items() if name.split("/")[0] in ("actor", "rollout_corr")}
    for name, value in fields.items():
        assert name in reference, f"{name} carries a field's name: add the field's formula here"
        assert value == pytest.approx(reference[name], rel=1e-6, abs=1e-12), name
    assert len(fields) == 14  # six actor figures, eight rollout-correction figures
    # Why ours keep our own names: on these tables the field's figure of the same name differs.
    ours = tracker_scalars(failing, prefix="")
    assert ours["consistency/ratio_std"] != pytest.approx(reference["actor/ratio_std"], rel=1e-3)
    chi2_token = reference["rollout_corr/chi2_token"]
    assert ours["consistency/chi2"] != pytest.approx(chi2_token, rel=1e-3)


def test_scalars_carry_the_verdict_and_rows_follow_the_timesteps(failing):
    scalars = tracker_scalars(failing)
    assert scalars["step1/verdict/passed"] == 0.0
    failed = [c.name for c in failing.verdict.checks if not c.passed]
    assert failed and scalars["step1/verdict/failed_checks"] == len(failed)
    assert all(scalars[f"step1/verdict/check/{name}"] == 0.0 for name in failed)
    assert scalars["step1/verdict/check/finite"] == 1.0
    assert not any("workers" in name for name in scalars)  # a guard not checked has no value, never a pass
    assert scalars["step1/actor/ppo_kl"] == failing.metrics.overall.ppo_kl
    assert scalars["step1/consistency/pg_clipfrac_dual"] == failing.mismatch.overall.pg_clipfrac_dual

    rows = tracker_rows(failing)
    assert [row["timestep"] for row in rows] == [1000.0, 750.0, 500.0]  # denoising order
    assert [row["index"] for row in rows] == [0, 1, 2]
    for row, metrics, stats in zip(rows, failing.metrics.by_timestep, failing.mismatch.by_timestep, strict=True):
        assert row["actor/ppo_kl"] == metrics.values.ppo_kl
        assert row["rollout_corr/k3_kl"] == stats.values.k3_kl
    # Without timesteps the rows are the window positions, still one per step.
    rollout, trainer = tables()
    by_position = tracker_rows(gate(rollout, trainer))
    assert [(row["position"], row["timestep"]) for row in by_position] == [(0, None), (1, None), (2, None)]
    assert all(len(row) == len(rows[0]) - 2 for row in by_position)  # no advantage-dependent figures


# ----------------------------------------------------------------------------------------------------
# TensorBoard


def read_events(directory) -> object:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def same_float32(stored: float, value: float) -> bool:
    """TensorBoard stores a scalar as float32."""
    return (math.isnan(stored) and math.isnan(value)) or stored == float(np.float32(value))


def test_tensorboard_event_files_hold_the_figures_rows_table_and_plot(failing, tmp_path):
    scalars = failing.log_to(f"tensorboard:{tmp_path / 'tb'}", step=40)
    events = read_events(tmp_path / "tb")
    for name, value in scalars.items():
        (point,) = events.Scalars(name)
        assert point.step == 40 and same_float32(point.value, value), name
    for name in ("actor/ppo_kl", "rollout_corr/k3_kl", "consistency/bias"):
        series = events.Scalars(f"step1/timestep/{name}")
        assert [p.step for p in series] == [0, 1, 2]
        assert all(same_float32(p.value, row[name]) for p, row in zip(series, tracker_rows(failing), strict=True))
    assert [p.value for p in events.Scalars("step1/timestep/t")] == [1000.0, 750.0, 500.0]
    (text,) = events.Tensors("step1/report/text_summary")
    assert "step-1 gate: FAIL" in text.tensor_proto.string_val[0].decode()
    (image,) = events.Images("step1/plot")
    assert (image.step, image.width, image.height) == (40, 800, 650)
    assert image.encoded_image_string.startswith(b"\x89PNG")


def test_tensorboard_into_the_trainers_writer_at_its_step_left_open(failing, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "trainer"))
    writer.add_scalar("actor/pg_loss", 0.5, global_step=12)
    failing.log_to(writer, step=12, prefix="", plot=False)
    writer.add_scalar("actor/pg_loss", 0.4, global_step=13)  # still open: the trainer goes on
    writer.close()
    events = read_events(tmp_path / "trainer")
    assert [p.step for p in events.Scalars("actor/pg_loss")] == [12, 13]
    (point,) = events.Scalars("actor/ppo_kl")
    assert point.step == 12 and same_float32(point.value, failing.metrics.overall.ppo_kl)
    assert "plot" not in events.Tags()["images"]


# ----------------------------------------------------------------------------------------------------
# wandb


def wandb_records(run_directory) -> list:
    """The records of an offline run's transaction log (``run-<id>.wandb``): a 7-byte header, then LevelDB's
    log format (32 KiB blocks of chunks: crc32c, length, type), each record a wandb protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_directory, "run-*.wandb"))
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B"
    records, position, pending, block = [], 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_directory, wait_s: float = 30.0) -> dict[int, dict[str, object]]:
    """History rows by ``_step``, values JSON-decoded. wandb's service process writes the file; on a loaded
    machine its history record can land after `run.finish()` has returned (seen once in a full-suite run), so
    the file is read again until a history row is there or `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        rows = {}
        for record in wandb_records(run_directory):
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
                rows[row["_step"]] = row
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def wandb_value(row: dict, name: str) -> float:
    value = row[name]
    return float(value) if not isinstance(value, str) else float(value.lower())  # NaN is spelt "NaN"


def test_wandb_offline_run_holds_the_figures_tables_and_plot(failing, offline):
    scalars = failing.log_to("wandb:rollout-consistency-test")
    (run_directory,) = glob.glob(str(offline / "wandb_dir" / "wandb" / "offline-run-*"))
    history = wandb_history(run_directory)
    assert list(history) == [0]
    row = history[0]
    for name, value in scalars.items():
        assert wandb_value(row, name) == value or (math.isnan(value) and math.isnan(wandb_value(row, name))), name
    files = os.path.join(run_directory, "files")
    with open(os.path.join(files, row["step1/per_timestep/path"])) as handle:
        table = json.load(handle)
    columns = table["columns"]
    assert columns[:3] == ["index", "position", "timestep"] and "actor/ppo_kl" in columns
    assert [r[columns.index("timestep")] for r in table["data"]] == [1000.0, 750.0, 500.0]
    assert [r[columns.index("actor/ppo_kl")] for r in table["data"]] == [
        s.values.ppo_kl for s in failing.metrics.by_timestep
    ]
    with open(os.path.join(files, row["step1/checks/path"])) as handle:
        checks = json.load(handle)
    by_name = {r[0]: r for r in checks["data"]}
    assert by_name["workers"][2] is None and by_name["workers"][5].startswith("not checked")
    assert by_name["ppo_kl"][2] is False
    with open(os.path.join(files, row["step1/plot/path"]), "rb") as handle:
        assert handle.read(4) == b"\x89PNG"
    assert row["step1/report/_type"] == "html-file"
    exits = [r.exit.exit_code for r in wandb_records(run_directory) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]  # a run of our own ends as the check did: FAIL


def test_wandb_into_the_trainers_run_joins_its_step(failing, offline):
    import wandb

    run = wandb.init(project="trainer", mode="offline", dir=str(offline / "wandb_dir"), reinit="create_new")
    try:
        run.log({"actor/pg_loss": 0.5}, step=3)
        failing.log_to(run, plot=False)  # no step: the trainer's current one, committed by its next log
        run.log({"actor/pg_loss": 0.4}, step=4)
        with pytest.raises(LoggerError, match="at step 4 and drops figures logged at an earlier step"):
            failing.log_to(run, step=2, plot=False)
        failing.log_to(run, step=9, plot=False)
    finally:
        run.finish()
    history = wandb_history(run.dir.rsplit(os.sep, 1)[0])
    assert sorted(history) == [3, 4, 9]
    assert history[3]["actor/pg_loss"] == 0.5 and history[3]["step1/actor/ppo_kl"] == failing.metrics.overall.ppo_kl
    assert "step1/actor/ppo_kl" not in history[4]
    assert history[9]["step1/verdict/passed"] == 0


# ----------------------------------------------------------------------------------------------------
# MLflow


def test_mlflow_file_store_holds_the_figures_series_and_artifacts(failing, offline):
    from mlflow.tracking import MlflowClient

    scalars = failing.log_to(f"mlflow:file:{offline / 'store'}", step=5)
    client = MlflowClient(tracking_uri=f"file:{offline / 'store'}")
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FAILED"  # a run of our own ends as the check did
    for name, value in scalars.items():
        (point,) = client.get_metric_history(run.info.run_id, name)
        assert point.step == 5 and (point.value == value or (math.isnan(value) and math.isnan(point.value))), name
    series = client.get_metric_history(run.info.run_id, "step1/timestep/actor/ppo_kl")
    assert [(p.step, p.value) for p in series] == [
        (j, s.values.ppo_kl) for j, s in enumerate(failing.metrics.by_timestep)
    ]
    assert run.data.tags["step1/status"] == "FAIL"
    assert set(run.data.tags["step1/failed_checks"].split(",")) == {
        c.name for c in failing.verdict.checks if not c.passed
    }
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "step1")) == [
        "step1/plot.png",
        "step1/report.json",
        "step1/report.txt",
    ]
    local = client.download_artifacts(run.info.run_id, "step1", str(offline / "downloaded"))
    with open(os.path.join(local, "report.json")) as handle:
        assert Report.from_json(handle.read()).results_dict() == failing.results_dict()
    with open(os.path.join(local, "plot.png"), "rb") as handle:
        assert handle.read(4) == b"\x89PNG"


def test_mlflow_into_the_users_run_left_running(failing, offline):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()  # MLFLOW_TRACKING_URI, as the user's own code would have it
    run = client.create_run("0")
    failing.log_to(run, step=7, prefix="gate/", plot=False)
    stored = client.get_run(run.info.run_id)
    assert stored.info.status == "RUNNING"
    assert stored.data.metrics["gate/actor/ppo_kl"] == failing.metrics.overall.ppo_kl
    assert client.get_metric_history(run.info.run_id, "gate/verdict/passed")[0].step == 7


# ----------------------------------------------------------------------------------------------------
# Targets, missing packages, the command line and the recorder


def test_trackers_are_named_and_checked_before_use(tmp_path):
    assert parse_tracker("tensorboard:runs/x") == TrackerSpec("tensorboard", "runs/x")
    assert parse_tracker("wandb") == TrackerSpec("wandb") and str(parse_tracker("wandb:proj")) == "wandb:proj"
    assert parse_tracker("mlflow:file:/tmp/m") == TrackerSpec("mlflow", "file:/tmp/m")
    (tmp_path / "a.json").write_text("{}")
    for text, words in (
        ("neptune", "unknown tracker 'neptune'"),
        ("tensorboard", "tensorboard:DIR"),
        (f"tensorboard:{tmp_path / 'a.json'}", "is not a directory"),
    ):
        with pytest.raises(LoggerError, match=words):
            parse_tracker(text)
    with pytest.raises(LoggerError, match="cannot log to a dict"):
        check_target({"actor/ppo_kl": 0.0})


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_package_is_one_line_naming_the_extra_before_any_work(kind, tmp_path, monkeypatch, capsys, failing):
    monkeypatch.setitem(sys.modules, kind, None)  # as if not installed: find_spec None, import fails
    spec = f"{kind}:{tmp_path / 'tb'}" if kind == "tensorboard" else kind
    with pytest.raises(LoggerError, match=rf"pip install 'rollout-consistency\[{kind}\]'"):
        failing.log_to(spec)
    with pytest.raises(LoggerError, match=rf"rollout-consistency\[{kind}\]"):
        Step1Recorder(log_to=spec)  # at construction, before anything is recorded

    import rollout_consistency.gate.check as check_module

    ran = []
    monkeypatch.setattr(check_module, "run_step1_check", ran.append)
    rollout, trainer = tables()
    write_dump(tmp_path / "dump.safetensors", rollout, trainer)
    output = tmp_path / "r.json"
    for command in (["check"], ["gate", str(tmp_path / "dump.safetensors")]):
        assert main([*command, "--log", spec, "--json", str(output)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"--log: logging to {kind} needs the" in line and f"rollout-consistency[{kind}]" in line
    assert ran == [] and not output.exists() and not (tmp_path / "tb").exists()


def test_cli_logs_to_every_tracker_after_writing_the_reports(failing, offline, monkeypatch, capsys):
    rollout, trainer = tables()
    write_dump(offline / "dump.safetensors", rollout, trainer, timesteps=np.tile(TIMESTEPS, (N, 1)))
    tb, store = offline / "tb", f"file:{offline / 'store'}"
    logs = ["--log", f"tensorboard:{tb}", "--log", f"mlflow:{store}"]
    code = main(["gate", str(offline / "dump.safetensors"), "--json", str(offline / "r.json"), *logs])
    assert code == 1  # FAIL, as the report says
    stderr = capsys.readouterr().err
    assert f"logged to tensorboard:{tb}" in stderr and f"logged to mlflow:{store}" in stderr
    events = read_events(tb)
    assert (
        events.Scalars("step1/verdict/passed")[0].value == 0.0 and events.Scalars("step1/verdict/passed")[0].step == 0
    )

    # `check` logs at the checked training step (global_step); the check itself is stood in for here.
    import rollout_consistency.gate.check as check_module

    monkeypatch.setattr(
        check_module, "run_step1_check", lambda config: dataclasses.replace(failing, config={"global_step": 7})
    )
    assert main(["check", "--log", f"tensorboard:{offline / 'tb-check'}"]) == 1
    assert read_events(offline / "tb-check").Scalars("step1/actor/ppo_kl")[0].step == 7


def test_cli_a_tracker_that_fails_after_the_check_is_exit_2_with_the_reports_kept(offline, capsys):
    rollout, _ = tables()
    write_dump(offline / "dump.safetensors", rollout, rollout.copy())
    blocked = offline / "blocked"
    blocked.write_text("a file where MLflow wants its store")
    code = main(
        [
            "gate",
            str(offline / "dump.safetensors"),
            "--json",
            str(offline / "r.json"),
            "--log",
            f"mlflow:file:{blocked}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the report was printed and written, but logging failed: mlflow:file:" in err
    assert json.loads((offline / "r.json").read_text())["status"] == "PASS"


def test_recorder_logs_its_report_before_a_fail_raises(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    rollout, trainer = tables()
    scale = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([scale], lr=0.1)
    writer = SummaryWriter(log_dir=str(tmp_path / "trainer"))
    recorder = Step1Recorder(optimizer, log_to=writer, raise_on_fail=True, micro_batch_size=MICRO)
    for j in range(T):
        recorder.record(torch.arange(N), j, torch.from_numpy(rollout[:, j]), torch.from_numpy(trainer[:, j]))
    (scale * 1.0).sum().backward()
    with pytest.raises(AssertionError, match="step-1 gate FAILED"):
        optimizer.step()
    writer.close()
    events = read_events(tmp_path / "trainer")
    (point,) = events.Scalars("step1/verdict/passed")
    assert point.value == 0.0 and point.step == 0
    assert same_float32(events.Scalars("step1/actor/ppo_kl")[0].value, recorder.report.metrics.overall.ppo_kl)
    with pytest.raises(Exception, match="needs gate=True"):
        Step1Recorder(gate=False, log_to=writer)


def test_the_docs_table_is_the_code_table():
    """docs/checker.md ("Logging to your tracker") lists every figure under the name `LOGGED_NAMES` gives it."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "checker.md").read_text()
    section = page.split("## Logging to your tracker", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (mismatch )?`(\w+)` \| `([\w/]+)` \|", section, flags=re.M)
    documented = {f"{'mismatch' if view else 'metrics'}.{figure}": name for view, figure, name in rows}
    assert documented == {key: name for key, (name, _) in LOGGED_NAMES.items()}
