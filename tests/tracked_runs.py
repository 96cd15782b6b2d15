"""Training runs written by the real trackers, as verl's ``Tracking`` adapters log a trainer's metrics dict at
``global_steps`` — TensorBoard through torch's ``SummaryWriter.add_scalar`` per key, wandb through
``wandb.log(data, step=step)`` (offline), MLflow through ``log_batch`` at the step on a ``file:`` store — with
verl-omni's per-global-batch consistency metrics computed from their definitions on seeded log-prob tables.
Shared by tests/test_watch_run_logs.py and tests/test_watch_cli.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

TIMESTEPS = (1000.0, 750.0, 500.0, 250.0)


def verl_omni_metrics(old: np.ndarray, rollout: np.ndarray, timesteps: np.ndarray) -> dict[str, float]:
    """verl-omni's per-global-batch consistency metrics (float32 torch, as the trainer holds the tables): mean and
    max |old − rollout| over every entry, the mean per timestep value (named ``ts_{t:.4g}``), verl's kl and
    k3_kl."""
    old_t, rollout_t, ts = torch.tensor(old), torch.tensor(rollout), torch.tensor(timesteps)
    diff = (old_t - rollout_t).abs()
    log_ratio = old_t - rollout_t
    metrics = {
        "rollout_corr/kl": (rollout_t - old_t).mean().item(),
        "rollout_corr/k3_kl": (torch.exp(log_ratio) - log_ratio - 1).mean().item(),
        "rollout_corr/logprob_abs_diff_mean": diff.mean().item(),
        "rollout_corr/logprob_abs_diff_max": diff.max().item(),
    }
    for t in torch.unique(ts):
        metrics[f"rollout_corr/logprob_abs_diff/ts_{t.item():.4g}"] = diff[ts == t].mean().item()
    return metrics


def run_metrics(steps: int = 6, fault_from: int | None = None, seed: int = 0) -> list[dict[str, float]]:
    """One metrics dict per global batch: bf16-noise gaps (|Δ| ~ 1e-5); from `fault_from` on, the last
    timestep's trainer log-probs move by 5e-3 (a schedule mismatch at late steps)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        rollout = rng.normal(-1.0, 0.1, (8, len(TIMESTEPS))).astype(np.float32)
        old = (rollout + rng.normal(0.0, 1e-5, rollout.shape)).astype(np.float32)
        if fault_from is not None and step >= fault_from:
            old[:, -1] += 5e-3
        timesteps = np.tile(np.array(TIMESTEPS, dtype=np.float32), (8, 1))
        rows.append(verl_omni_metrics(old, rollout, timesteps))
    return rows


def offline_env(directory) -> dict[str, str]:
    env = {name: str(directory) for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_ERROR_REPORTING="false",
        MLFLOW_ALLOW_FILE_STORE="true",
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
    )
    return env


def write_runs(directory, rows: list[dict[str, float]], steps: list[int] | None = None) -> dict[str, str]:
    """The rows logged at `steps` (default 0, 1, ...) to a TensorBoard folder, a wandb offline run and an MLflow
    file store under `directory`, as verl's Tracking adapters log them. Returns format -> the path to watch."""
    import mlflow
    import wandb
    from mlflow.tracking import MlflowClient
    from torch.utils.tensorboard import SummaryWriter

    steps = list(range(len(rows))) if steps is None else steps
    with pytest.MonkeyPatch.context() as patch:
        for name, value in offline_env(directory).items():
            patch.setenv(name, value)
        wandb.teardown()  # wandb read the environment at this process's first run: read these settings again
        writer = SummaryWriter(log_dir=str(directory / "tensorboard"))
        # A config record over two LevelDB blocks (64 KiB): the log then holds records split into chunks.
        run = wandb.init(project="watch", dir=str(directory), reinit="create_new", config={"notes": "x" * 70000})
        client = MlflowClient(tracking_uri=f"file:{directory / 'mlruns'}")
        mlflow_run = client.create_run("0")
        for step, data in zip(steps, rows, strict=True):
            for key, value in data.items():
                writer.add_scalar(key, value, global_step=step)
            if step >= run.step:  # wandb drops (with a warning) a step below its current one
                run.log(data, step=step)
            client.log_batch(
                mlflow_run.info.run_id,
                metrics=[mlflow.entities.Metric(k, v, 0, step) for k, v in data.items()],
            )
        writer.close()
        run.finish()
        client.set_terminated(mlflow_run.info.run_id, status="FINISHED")
    return {
        "tensorboard": str(directory / "tensorboard"),
        "wandb": str(directory / "wandb"),
        "mlflow": str(directory / "mlruns"),
    }
