# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A report's figures where trainers already look: TensorBoard, wandb and MLflow, through their own APIs.

::

    report.log_to("tensorboard:runs/step1")      # a writer of its own in that directory, closed after
    report.log_to(writer, step=global_step)       # the trainer's SummaryWriter, wandb run or MLflow run
    tracking.log(tracker_scalars(report), step)   # any other logger that takes a dict of floats (verl's Tracking)

What is logged, under ``prefix`` (default ``"step1/"``, so the trainer's own ``actor/...`` series are never
overwritten; ``prefix=""`` puts the figures in them):

* the gated figures and the mismatch statistics, overall, as scalars named by `LOGGED_NAMES`: a name of the
  field (verl-omni's diffusion actor ``actor/...``, verl's rollout correction ``rollout_corr/...``) only where
  the figure is that definition on the same tables, ``consistency/...`` otherwise;
* the verdict: ``verdict/passed`` (1 PASS, 0 FAIL), ``verdict/failed_checks`` (how many), ``verdict/check/<name>``
  (1 or 0 per check; a guard not checked has none), and the terminal table as text;
* the per-timestep rows: TensorBoard and MLflow get one series per figure, ``timestep/<name>``, whose step is
  the row's index in denoising order (0 = the first stored step), plus ``timestep/t`` (the timestep value);
  wandb gets them as a table, ``per_timestep`` (a wandb step must grow, so a series over the timestep index
  would move the trainer's run forward);
* the plot, as an image (TensorBoard, wandb) or an artifact (MLflow, beside the report's JSON and table).

The tracker packages are optional extras (``tensorboard``, ``wandb``, ``mlflow``), imported only when logging;
`parse_tracker` refuses a missing one with a line that names the extra, before anything is computed.
Importing this module imports none of them.
"""

from __future__ import annotations

import html
import importlib.util
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .metrics import METRIC_NAMES
from .mismatch import ADVANTAGE_NAMES, MISMATCH_NAMES

__all__ = [
    "DEFAULT_PREFIX",
    "LOGGED_NAMES",
    "TRACKERS",
    "LoggerError",
    "TrackerSpec",
    "check_target",
    "log_report",
    "log_scalars",
    "parse_tracker",
    "tracker_rows",
    "tracker_scalars",
]

#: Put in front of every logged name unless the caller gives another (``""`` for none).
DEFAULT_PREFIX = "step1/"

_VERL_OMNI_ACTOR = "verl-omni's diffusion actor (flow_grpo loss)"
_OURS = "this checker's own"

#: Every figure a report logs, ``<view>.<figure>`` -> (logged name, whose definition the figure is). A field's
#: name only where our figure is that definition on the same tables; docs/checker.md ("Logging to your
#: tracker") cites this table.
LOGGED_NAMES: Mapping[str, tuple[str, str]] = {
    "metrics.ratio_mean": ("actor/ratio_mean", _VERL_OMNI_ACTOR),
    # verl-omni's flow_grpo loss logs torch's ratio.std() (ddof 1) as actor/ratio_std; ours is ddof 0.
    "metrics.ratio_std": (
        "consistency/ratio_std",
        _OURS + " (ddof 0; verl-omni's flow_grpo actor/ratio_std is ddof 1)",
    ),
    "metrics.ppo_kl": ("actor/ppo_kl", _VERL_OMNI_ACTOR),
    "metrics.pg_clipfrac": ("actor/pg_clipfrac", _VERL_OMNI_ACTOR),
    "metrics.pg_clipfrac_higher": ("actor/pg_clipfrac_higher", _VERL_OMNI_ACTOR),
    "metrics.pg_clipfrac_lower": ("actor/pg_clipfrac_lower", _VERL_OMNI_ACTOR),
    "metrics.approx_kl": ("actor/approx_kl", "verl-omni's diffusion actor (flow_dppo loss); Flow-GRPO's approx_kl"),
    # A mean of per-cell means; verl-omni's rollout_corr/logprob_abs_diff_mean pools the entries.
    "metrics.mean_abs_dlogp": ("consistency/mean_abs_dlogp", _OURS + " (per-cell means, averaged)"),
    "metrics.max_abs_dlogp": ("consistency/max_abs_dlogp", _OURS + " (gated)"),
    "mismatch.k3_kl": ("rollout_corr/k3_kl", "verl's rollout correction"),
    # verl's own figures (judging.mismatch computes them with verl's formulas): logged under verl's names.
    "mismatch.kl": ("rollout_corr/kl", "verl's rollout correction"),
    "mismatch.chi2_token": ("rollout_corr/chi2_token", "verl's rollout correction"),
    "mismatch.chi2_seq": ("rollout_corr/chi2_seq", "verl's rollout correction"),
    "mismatch.ppl_ratio": ("rollout_corr/ppl_ratio", "verl's rollout correction"),
    "mismatch.log_ppl_diff": ("rollout_corr/log_ppl_diff", "verl's rollout correction"),
    "mismatch.log_ppl_abs_diff": ("rollout_corr/log_ppl_abs_diff", "verl's rollout correction"),
    # verl's chi2_token is mean(w²) − 1; ours is mean((w − 1)²).
    "mismatch.chi2": ("consistency/chi2", _OURS + " (verl's chi2_token is mean(w²) − 1)"),
    # verl's rollout_is_eff_sample_size truncates the weights at rollout_is_threshold first.
    "mismatch.ess": ("consistency/ess", _OURS + " (verl's rollout_is_eff_sample_size truncates the weights)"),
    "mismatch.p99_abs_dlogp": ("consistency/p99_abs_dlogp", _OURS),
    "mismatch.max_abs_dlogp": ("rollout_corr/logprob_abs_diff_max", "verl-omni's rollout correction"),
    # verl's training/rollout_actor_probs_pearson_corr correlates probabilities, not log-probs.
    "mismatch.pearson_logp": ("consistency/pearson_logp", _OURS + " (verl correlates probabilities)"),
    "mismatch.bias": ("consistency/bias", _OURS),
    "mismatch.bias_ci_low": ("consistency/bias_ci_low", _OURS),
    "mismatch.bias_ci_high": ("consistency/bias_ci_high", _OURS),
    # LLM verl logs these as actor/pg_clipfrac and actor/pg_clipfrac_lower: names the gated figures hold here.
    "mismatch.pg_clipfrac_adv": ("consistency/pg_clipfrac_adv", "LLM verl's actor/pg_clipfrac"),
    "mismatch.pg_clipfrac_dual": ("consistency/pg_clipfrac_dual", "LLM verl's actor/pg_clipfrac_lower"),
}

#: tracker -> (the package it imports, the extra that installs it).
TRACKERS: Mapping[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
_SPEC_FORMS = "tensorboard:DIR, wandb[:PROJECT] or mlflow[:TRACKING_URI]"


class LoggerError(ValueError):
    """A tracker that cannot be logged to (unknown, its package missing, a bad target); names the fix."""


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker named by text: ``tensorboard:DIR``, ``wandb[:PROJECT]``, ``mlflow[:TRACKING_URI]``.

    Logging to one opens a writer or run of its own and closes it after (`log_report`).
    """

    kind: str
    where: str | None = None

    def __str__(self) -> str:
        return self.kind if self.where is None else f"{self.kind}:{self.where}"


def parse_tracker(text: str) -> TrackerSpec:
    """The `TrackerSpec` of ``text``; `LoggerError` for an unknown tracker, a missing directory or package.

    Cheap: it looks the package up without importing it, so callers run it before any work.
    """
    kind, _, where = str(text).partition(":")
    kind = kind.strip().lower()
    if kind not in TRACKERS:
        raise LoggerError(f"unknown tracker {text!r}; name one of {_SPEC_FORMS}.")
    if kind == "tensorboard":
        if not where:
            raise LoggerError("tensorboard needs the directory to write its event files to: tensorboard:DIR.")
        if os.path.exists(where) and not os.path.isdir(where):
            raise LoggerError(f"tensorboard:{where} is not a directory; name a directory for the event files.")
    _require_package(kind)
    return TrackerSpec(kind, where or None)


def check_target(target: Any) -> TrackerSpec | str:
    """What `log_report` will log to: a `TrackerSpec` for text, else the kind of a live writer or run.

    Raises `LoggerError` for text `parse_tracker` refuses, and for an object that is none of a TensorBoard
    ``SummaryWriter``, a wandb run or an MLflow run.
    """
    if isinstance(target, TrackerSpec):
        return target
    if isinstance(target, (str, os.PathLike)):
        return parse_tracker(os.fspath(target))
    kind = _kind_of(target)
    if kind is None:
        raise LoggerError(
            f"cannot log to a {type(target).__name__}; give {_SPEC_FORMS}, a torch.utils.tensorboard "
            f"SummaryWriter, a wandb run (wandb.run) or an MLflow run (mlflow.active_run())."
        )
    return kind


def _require_package(kind: str) -> None:
    package, extra = TRACKERS[kind]
    if importlib.util.find_spec(package) is None:
        raise LoggerError(
            f"logging to {kind} needs the {package} package, which is not installed: "
            f"pip install 'rollout-consistency[{extra}]' (or pip install {package})."
        )


def _kind_of(target: Any) -> str | None:
    package = type(target).__module__.split(".")[0]
    if package == "wandb" and callable(getattr(target, "log", None)):
        return "wandb"
    if package == "mlflow" and getattr(getattr(target, "info", None), "run_id", None):
        return "mlflow"
    if all(callable(getattr(target, name, None)) for name in ("add_scalar", "add_text", "add_image", "flush")):
        return "tensorboard"
    return None


# ----------------------------------------------------------------------------------------------------
# What is logged
def _logged_name(view: str, figure: str) -> str:
    # A figure added to the report later is still logged, under this checker's own family, until it is named.
    return LOGGED_NAMES.get(f"{view}.{figure}", (f"consistency/{figure}", _OURS))[0]


def _figures(metric_values: Any, mismatch_values: Any) -> dict[str, float]:
    figures: dict[str, float] = {}
    if metric_values is not None:
        figures.update({_logged_name("metrics", n): float(metric_values.get(n)) for n in METRIC_NAMES})
    if mismatch_values is not None:
        for name in MISMATCH_NAMES + ADVANTAGE_NAMES:
            value = getattr(mismatch_values, name, None)
            if value is not None:
                figures[_logged_name("mismatch", name)] = float(value)
    return figures


def tracker_scalars(report: Any, *, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The report's overall figures and its verdict as ``{logged name: float}`` (see the module docstring).

    For a logger that takes a dict of floats at a step (verl's ``Tracking.log(data, step)``, Lightning's
    ``log_metrics``, accelerate's ``Accelerator.log``). NaN and inf stay as they are.
    """
    m, stats = report.metrics, report.mismatch
    scalars = _figures(None if m is None else m.overall, None if stats is None else stats.overall)
    checks = report.verdict.checks
    scalars["verdict/passed"] = 1.0 if report.passed else 0.0
    scalars["verdict/failed_checks"] = float(sum(1 for c in checks if not c.passed))
    scalars.update({f"verdict/check/{c.name}": 1.0 if c.passed else 0.0 for c in checks})
    return {prefix + name: value for name, value in scalars.items()}


def tracker_rows(report: Any) -> list[dict[str, Any]]:
    """One row per timestep (per window position when the report has no timesteps), in denoising order.

    Each row: ``index`` (0, 1, ...), ``position`` and ``timestep`` (``None`` where not one value), then the
    gated figures and the mismatch statistics at that step under their logged names (no prefix).
    """
    rows: dict[tuple[str, float], dict[str, Any]] = {}
    m, stats = report.metrics, report.mismatch
    views = [] if m is None else [(s, s.values, None) for s in (m.by_timestep or m.by_position)]
    views += [] if stats is None else [(s, None, s.values) for s in stats.by_timestep]
    for step, metric_values, mismatch_values in views:
        key = ("t", step.timestep) if step.timestep is not None else ("position", float(step.position))
        row = rows.setdefault(key, {"position": step.position, "timestep": step.timestep})
        row.update(_figures(metric_values, mismatch_values))
    timed = all(key[0] == "t" for key in rows)
    ordered = sorted(rows.items(), key=lambda item: -item[0][1] if timed else item[0][1])
    return [{"index": index, **row} for index, (_, row) in enumerate(ordered)]


# ----------------------------------------------------------------------------------------------------
# Logging
def log_report(
    report: Any,
    target: Any,
    *,
    step: int | None = None,
    prefix: str | None = None,
    plot: bool = True,
) -> dict[str, float]:
    """Log `report` to a tracker: its figures, verdict, per-timestep rows, table and plot.

    Args:
        report (`Report`): a finished check or gate.
        target: ``"tensorboard:DIR"``, ``"wandb"`` / ``"wandb:PROJECT"``, ``"mlflow"`` / ``"mlflow:TRACKING_URI"``
            (a writer or run of its own, closed after; a wandb or MLflow run ends as failed when the check
            FAILed), or the trainer's own ``SummaryWriter``, wandb run or MLflow run (left open; a writer is
            flushed).
        step (`int`, *optional*): the step the overall figures go to. ``None``: 0 for TensorBoard and MLflow;
            for a wandb run, its current step, without committing it (the trainer's next ``log`` does).
        prefix (`str`, *optional*): put in front of every name (default `DEFAULT_PREFIX`; ``""`` for none).
        plot (`bool`): also render and log the plot.

    Returns:
        the scalars logged at ``step`` (`tracker_scalars`).

    Raises:
        LoggerError: a target `check_target` refuses, or a wandb ``step`` below the run's current step (wandb
            would drop the figures with only a warning).
    """
    checked = check_target(target)
    prefix = DEFAULT_PREFIX if prefix is None else prefix
    scalars = tracker_scalars(report, prefix=prefix)
    with tempfile.TemporaryDirectory(prefix="rc-plot-") as directory:
        png = None
        if plot:
            png = os.path.join(directory, "plot.png")
            report.write_plot(png)
        content = _Content(report, scalars, tracker_rows(report), prefix, png)
        if isinstance(checked, TrackerSpec):
            _OWN_RUNS[checked.kind](content, checked.where, 0 if step is None else step)
        else:
            _INTO[checked](content, target, step)
    return scalars


@dataclass(frozen=True)
class _Content:
    report: Any
    scalars: dict[str, float]
    rows: list[dict[str, Any]]
    prefix: str
    png: str | None

    def series(self) -> list[tuple[str, int, float]]:
        """(name, step, value) of the per-timestep series, the step being the row's index."""
        points = []
        for row in self.rows:
            if row["timestep"] is not None:
                points.append((f"{self.prefix}timestep/t", row["index"], float(row["timestep"])))
            points += [
                (f"{self.prefix}timestep/{name}", row["index"], value)
                for name, value in row.items()
                if name not in ("index", "position", "timestep")
            ]
        return points

    def table_text(self) -> str:
        return self.report.format_table()


# -- TensorBoard --------------------------------------------------------------------------------------
def _into_tensorboard(content: _Content, writer: Any, step: int | None) -> None:
    at = 0 if step is None else step
    for name, value in content.scalars.items():
        writer.add_scalar(name, value, global_step=at)
    for name, index, value in content.series():
        writer.add_scalar(name, value, global_step=index)
    # Markdown: an indented block keeps the table's columns.
    text = "\n".join("    " + line for line in content.table_text().split("\n"))
    writer.add_text(f"{content.prefix}report", text, global_step=at)
    if content.png is not None:
        writer.add_image(f"{content.prefix}plot", _rgb(content.png), global_step=at, dataformats="HWC")
    writer.flush()


def _own_tensorboard(content: _Content, where: str | None, step: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=where)
    try:
        _into_tensorboard(content, writer, step)
    finally:
        writer.close()


def _rgb(png: str) -> Any:
    """The PNG as an (H, W, 3) uint8 array (matplotlib reads it; the report already depends on it)."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(png)  # float in [0, 1], RGBA
    return (np.clip(pixels[..., :3], 0.0, 1.0) * 255.0).round().astype(np.uint8)


# -- wandb --------------------------------------------------------------------------------------------
def _into_wandb(content: _Content, run: Any, step: int | None) -> None:
    import wandb

    current = getattr(run, "step", None)
    if step is not None and isinstance(current, int) and step < current:
        raise LoggerError(
            f"the wandb run is at step {current} and drops figures logged at an earlier step ({step}); log at "
            f"step >= {current}, or step=None to add them to the run's current step."
        )
    data: dict[str, Any] = dict(content.scalars)
    columns = ["index", "position", "timestep", *_row_names(content.rows)]
    data[f"{content.prefix}per_timestep"] = wandb.Table(
        columns=columns, data=[[row.get(c) for c in columns] for row in content.rows]
    )
    data[f"{content.prefix}checks"] = wandb.Table(
        columns=["check", "kind", "passed", "value", "limit", "message"], data=_check_rows(content.report)
    )
    data[f"{content.prefix}report"] = wandb.Html("<pre>" + html.escape(content.table_text()) + "</pre>")
    if content.png is not None:
        data[f"{content.prefix}plot"] = wandb.Image(content.png, caption=f"step-1 {content.report.status}")
    if step is None:
        run.log(data, commit=False)  # joins the trainer's current step; its next log() commits it
    else:
        run.log(data, step=step)


def _own_wandb(content: _Content, where: str | None, step: int) -> None:
    import wandb

    # create_new: never returns (and so never finishes) a run the caller already has open in this process.
    run = wandb.init(
        project=where,
        job_type="rollout-consistency",
        config={"rollout_consistency": content.report.to_dict()["config"]},  # strict JSON already
        reinit="create_new",
    )
    try:
        _into_wandb(content, run, step)
    except BaseException:
        run.finish(exit_code=2)
        raise
    run.finish(exit_code=0 if content.report.passed else 1)


def _row_names(rows: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(n for n in row if n not in ("index", "position", "timestep")))
    return list(names)


def _check_rows(report: Any) -> list[list[Any]]:
    rows = [[c.name, c.kind, c.passed, c.value, c.limit, c.message] for c in report.verdict.checks]
    not_checked: Mapping[str, str] = getattr(report, "not_checked", {})
    rows += [[name, "guard", None, None, None, f"not checked: {why}"] for name, why in not_checked.items()]
    return rows


# -- MLflow -------------------------------------------------------------------------------------------
#: MLflow's limit on the metrics of one log_batch call.
_MLFLOW_BATCH = 1000


def _into_mlflow(content: _Content, run: Any, step: int | None) -> None:
    from mlflow.tracking import MlflowClient

    _log_mlflow(content, MlflowClient(), run.info.run_id, 0 if step is None else step)


def _log_mlflow(content: _Content, client: Any, run_id: str, step: int) -> None:
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    metrics = [Metric(name, value, stamp, step) for name, value in content.scalars.items()]
    metrics += [Metric(name, value, stamp, index) for name, index, value in content.series()]
    for start in range(0, len(metrics), _MLFLOW_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + _MLFLOW_BATCH])
    report = content.report
    client.set_tag(run_id, f"{content.prefix}status", report.status)
    client.set_tag(
        run_id, f"{content.prefix}failed_checks", ",".join(c.name for c in report.verdict.checks if not c.passed)
    )
    folder = content.prefix.strip("/") or "rollout_consistency"
    client.log_text(run_id, content.table_text() + "\n", f"{folder}/report.txt")
    client.log_text(run_id, report.to_json() + "\n", f"{folder}/report.json")
    if content.png is not None:
        client.log_artifact(run_id, content.png, folder)


def _own_mlflow(content: _Content, where: str | None, step: int) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=where)  # None: MLflow's own setting (MLFLOW_TRACKING_URI)
    run = client.create_run(_mlflow_experiment(client), run_name=f"rollout-consistency step-1 {content.report.status}")
    try:
        _log_mlflow(content, client, run.info.run_id, step)
    except BaseException:
        client.set_terminated(run.info.run_id, status="KILLED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED" if content.report.passed else "FAILED")


def _mlflow_experiment(client: Any) -> str:
    """The experiment MLflow's own settings name (MLFLOW_EXPERIMENT_NAME / _ID), else its default one."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)
    return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")


# -- any tracker, scalars only -----------------------------------------------------------------------
def log_scalars(target: Any, scalars: Mapping[str, float], step: int) -> None:
    """Log a dict of floats at `step` to a live tracker: a TensorBoard ``SummaryWriter`` (``add_scalar``), a wandb
    run (``log(data, step=step)``), an MLflow run (``log_batch``), or any object with ``log(data, step=...)``
    (verl's ``Tracking``, accelerate's ``Accelerator``). The run monitor logs each step's figures with it.

    Raises:
        LoggerError: an object that is none of these; whatever the tracker raises passes through.
    """
    kind = _kind_of(target)
    if kind == "tensorboard":
        for name, value in scalars.items():
            target.add_scalar(name, value, global_step=step)
        return
    if kind == "mlflow":
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        stamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), stamp, step) for name, value in scalars.items()]
        client = MlflowClient()
        for start in range(0, len(metrics), _MLFLOW_BATCH):
            client.log_batch(target.info.run_id, metrics=metrics[start : start + _MLFLOW_BATCH])
        return
    if callable(getattr(target, "log", None)):  # wandb runs, verl's Tracking, accelerate's Accelerator
        target.log(dict(scalars), step=step)
        return
    raise LoggerError(
        f"cannot log scalars to a {type(target).__name__}; give a torch.utils.tensorboard SummaryWriter, a wandb "
        f"run, an MLflow run, or an object with log(data, step=...)."
    )


_INTO = {"tensorboard": _into_tensorboard, "wandb": _into_wandb, "mlflow": _into_mlflow}
_OWN_RUNS = {"tensorboard": _own_tensorboard, "wandb": _own_wandb, "mlflow": _own_mlflow}
