# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`RunMonitor`: the step-1 gate at every training step of the user's own loop.

In a GRPO step the trainer recomputes the rollout's log-probs before its first update (verl-omni's
``old_log_probs``, flow_grpo's first ``log_prob`` of each step): that pair is a step-1 check at every step, free of
extra forwards. After the step's first update the ratio leaves 1 by design, so only that first recompute is judged.
Two ways in:

* **whole tables** (verl-omni's batch): ``monitor.observe(step, batch["rollout_log_probs"],
  batch["old_log_probs"], timesteps=batch["timesteps"])`` once per step;
* **cells** (flow_grpo's loop, accelerate or plain torch): ``monitor.begin_step(step)`` after the rollout, then
  ``monitor.record(sample["log_probs"][:, j], log_prob, timesteps=sample["timesteps"][:, j])`` wherever the trainer
  computes a log-prob; the first real update of the optimizer handed to the monitor ends the step (a step pre-hook
  on the torch optimizer inside accelerate's ``AcceleratedOptimizer``, an lr scheduler, DeepSpeed: an
  accumulation step that updates nothing does not), and later records of the step are ignored. Without an
  optimizer, ``monitor.end_step()`` ends it. Without ``sample_ids`` each recorded entry counts as one sample in
  the per-sample figures (``chi2_seq``, ``bias``, the ``ppl`` family).

Each step: the figures (`StepStats`, ours and verl's names), the verdict and alarms (`StepJudge`), the figures
logged to the trackers given (a tracker that fails to write is a warning; training goes on). On an alarm: the
figures-only doctor on the step's tables (`rollout_consistency.gate.gate`), the tables dumped as a checksummed
log-prob dump (``settings.dump_dir``, for ``rollout-consistency gate DUMP`` / ``doctor``; a dump that fails to
write is reported in the alarm's record and as a warning), and the policy ``settings.on_alarm``: ``log`` (a
`MonitorWarning`), ``raise`` (`MonitorAlarm`, from the optimizer step before the update when the hook ended the
step), ``stop`` (``monitor.should_stop`` turns True). Memory is bounded: one step's cells or tables at a time, the
judge's bounded state, the first ``max_alarms_kept`` alarm records.

Under torch.distributed with ``settings.distributed`` (each rank holds a shard of the global batch), each step's
statistics are reduced across the ranks (`reduce_step_stats`: one ``all_gather``) before the verdict. Every rank
then holds the global figures and the same verdict, alarms and summary; rank 0 alone logs to the trackers, runs the
doctor (on its own shard: the global tables are in no one process) and warns; every rank writes its own shard's
dump (``monitor-stepNNNNNNNN-rankR.safetensors``) and applies ``raise`` / ``stop``, so the ranks stop together
rather than leave one waiting at the next collective. Every rank must call the monitor at every step.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.aliasing import shares_memory
from rollout_consistency.gate.judging.loggers import LoggerError, log_scalars, parse_tracker
from rollout_consistency.gate.judging.views import host_array
from rollout_consistency.gate.tables.api import gate
from rollout_consistency.gate.tables.dump import write_dump
from rollout_consistency.gate.tables.recorder import innermost_optimizer

from .distributed import reduce_step_stats
from .figures import StepFigures, StepStats, StepStatsError
from .judge import Alarm, JudgeSummary, StepJudge, StepVerdict
from .settings import MonitorError, MonitorSettings

__all__ = ["AlarmRecord", "MonitorAlarm", "MonitorWarning", "RunMonitor"]


class MonitorWarning(UserWarning):
    """An alarm under ``on_alarm="log"``, a tracker that failed to write, or a dump that failed to write."""


@dataclass(frozen=True)
class AlarmRecord:
    """What the monitor did about one alarmed step.

    Attributes:
        step: the training step. alarms: its alarms.
        causes: the figures-only doctor's likely causes, ranked (cause ids, e.g. ``bf16-latents``).
        diagnosis: the doctor's full entries (``cause``, ``summary``, ``evidence``, ``fix``, ``confidence``).
        gate_status: the step-1 gate's verdict on the step's tables (``PASS``/``FAIL``; None without tables).
        dump: the dump written, or None. dump_error: why the dump could not be written (None if it was, or was not
            asked for). notes: anything else (the NaN capture's file).
    """

    step: int
    alarms: tuple[Alarm, ...]
    causes: tuple[str, ...] = ()
    diagnosis: tuple[Mapping[str, Any], ...] = ()
    gate_status: str | None = None
    dump: str | None = None
    dump_error: str | None = None
    notes: tuple[str, ...] = ()

    def format(self) -> str:
        lines = [f"run monitor: step {self.step}: {', '.join(a.kind for a in self.alarms)}"]
        lines += [f"  {a.kind}: {a.message}" for a in self.alarms]
        if self.causes:
            lines.append(f"  likely causes (figures-only doctor): {', '.join(self.causes[:5])}")
        if self.dump:
            lines.append(f"  tables dumped to {self.dump} (rollout-consistency gate {self.dump})")
        if self.dump_error:
            lines.append(f"  the tables could not be dumped: {self.dump_error}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "alarms": [a.to_dict() for a in self.alarms],
            "causes": list(self.causes),
            "diagnosis": [dict(d) for d in self.diagnosis],
            "gate_status": self.gate_status,
            "dump": self.dump,
            "dump_error": self.dump_error,
            "notes": list(self.notes),
        }


class MonitorAlarm(RuntimeError):
    """Raised on an alarm under ``on_alarm="raise"``; ``record`` is its `AlarmRecord`."""

    def __init__(self, record: AlarmRecord) -> None:
        super().__init__(record.format())
        self.record = record


@dataclass(frozen=True)
class _Tables:
    rollout: np.ndarray
    trainer: np.ndarray
    timesteps: np.ndarray | None
    mask: np.ndarray | None
    sample_ids: np.ndarray | None


class RunMonitor:
    """Judges every training step of your loop (module docstring).

    Args:
        settings ([`MonitorSettings`], *optional*): profile, drift alarm, policy, dumps; default
            `MonitorSettings()`.
        optimizer (*optional*): for `record`: the optimizer your loop steps (torch, accelerate's
            ``AcceleratedOptimizer``, an lr scheduler, DeepSpeed); its first real update in a step ends the step.
        log_to (*optional*): a tracker or a list of them — a ``SummaryWriter``, a wandb run, an MLflow run, any
            object with ``log(data, step=...)`` (verl's ``Tracking``, accelerate's ``Accelerator``), or
            ``"tensorboard:DIR"`` (a writer of the monitor's own, closed by `close`).
        nan_capture (`NanCapture`, *optional*): the run's NaN capture; a ``nonfinite`` alarm names its file (or
            the directory it will capture to).
        process_group (*optional*): with ``distributed=True``, the torch.distributed group whose ranks hold the
            shards (default: the initialised default group).
        **overrides: `MonitorSettings` or `TableSettings` fields (``profile="kernel"``, ``on_alarm="raise"``).
    """

    def __init__(
        self,
        settings: MonitorSettings | None = None,
        *,
        optimizer: Any = None,
        log_to: Any = None,
        nan_capture: Any = None,
        process_group: Any = None,
        **overrides: Any,
    ) -> None:
        settings = MonitorSettings() if settings is None else settings
        self.settings = settings.replace(**overrides) if overrides else settings
        if process_group is not None and not self.settings.distributed:
            raise MonitorError("process_group given without distributed=True: pass distributed=True to reduce.")
        self._group = process_group
        self._rank: int | None = None  # this rank in the group, once a step was reduced
        self.judge = StepJudge(self.settings)
        self.should_stop = False
        self.last_verdict: StepVerdict | None = None
        self.last_figures: StepFigures | None = None
        self.alarm_records: list[AlarmRecord] = []
        self._nan_capture = nan_capture
        self._targets = _targets(log_to)
        self._own_writers: dict[str, Any] = {}
        self._width: int | None = None
        self._dumps = 0
        self._open: int | None = None
        self._closed = False
        self._cells: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        self._hook = None
        if optimizer is not None:
            inner, _ = innermost_optimizer(optimizer)
            self._hook = inner.register_step_pre_hook(self._on_update)

    # ------------------------------------------------------------------------------------------------
    def observe(
        self,
        step: int,
        rollout_log_probs: Any,
        trainer_log_probs: Any,
        *,
        timesteps: Any = None,
        mask: Any = None,
        sample_ids: Any = None,
    ) -> StepVerdict:
        """Judge one step from its whole tables.

        Args:
            step (`int`): the training step (increasing).
            rollout_log_probs (`(N, T)` float32): the rollout's stored log-probs (verl-omni ``rollout_log_probs``).
            trainer_log_probs (`(N, T)` float32): the trainer's first recompute before the step's update
                (verl-omni ``old_log_probs``); not the same array (bypass mode is refused).
            timesteps (`(N, T)`, *optional*), mask (`(N, T)` bool, *optional*), sample_ids (`(N,)` int, *optional*).

        Raises:
            MonitorError: tables the figures refuse (`StepStatsError`'s message), or a step out of order.
            MonitorAlarm: an alarm under ``on_alarm="raise"``.
        """
        if shares_memory(rollout_log_probs, trainer_log_probs):  # asked before the host copies below hide it
            raise MonitorError(
                f"step {step}: rollout_log_probs and trainer_log_probs are the same memory (verl-omni's bypass mode "
                f"copies rollout_log_probs into old_log_probs): pass the trainer's own recompute."
            )
        tables = _Tables(
            host_array(rollout_log_probs, "rollout_log_probs", MonitorError),
            host_array(trainer_log_probs, "trainer_log_probs", MonitorError),
            None if timesteps is None else host_array(timesteps, "timesteps", MonitorError),
            None if mask is None else host_array(mask, "mask", MonitorError),
            None if sample_ids is None else host_array(sample_ids, "sample_ids", MonitorError),
        )
        return self._step(step, tables)

    def begin_step(self, step: int) -> None:
        """Start recording step `step` (after its rollout, before the trainer's recompute). A step still open is
        ended first (its records were never followed by an update)."""
        if self._open is not None and not self._closed:
            self.end_step()
        if self.judge.last_step is not None and step <= self.judge.last_step:
            raise MonitorError(f"begin_step({step}) after step {self.judge.last_step}: steps must increase.")
        self._open, self._closed, self._cells = step, False, []

    def record(self, old_log_probs: Any, log_probs: Any, *, timesteps: Any = None, sample_ids: Any = None) -> None:
        """Record the trainer's log-probs of some cells of the open step: `(B,)` each (or any matching shape).

        Args:
            old_log_probs: the rollout's stored log-probs of these cells (flow_grpo ``sample["log_probs"][:, j]``).
            log_probs: the trainer's recompute (a graph-carrying tensor is fine: it is detached).
            timesteps (*optional*): each cell's timestep value (``sample["timesteps"][:, j]``).
            sample_ids (*optional*): each cell's sample id; give them on every call of a step or on none.

        Ignored after the step's first update (the trainer then scores updated weights).

        Raises:
            MonitorError: no open step (call `begin_step`), the two tables one buffer, shapes that differ, ids on
                some calls only.
        """
        if self._open is None:
            raise MonitorError("record() before begin_step(step): call monitor.begin_step(step) after each rollout.")
        if self._closed:
            return
        if shares_memory(old_log_probs, log_probs):  # asked before any copy: a copy would hide it
            raise MonitorError(
                "old_log_probs and log_probs are the same memory: a table compared with itself proves nothing; "
                "record the trainer's own recompute (verl-omni's bypass mode sets old_log_probs := rollout_log_probs)."
            )
        old = _cells(old_log_probs, "old_log_probs")
        new = _cells(log_probs, "log_probs")
        n = _size(old)
        if _size(new) != n:
            raise MonitorError(f"old_log_probs has {n} cells but log_probs has {_size(new)}.")
        ts = None if timesteps is None else _cells(timesteps, "timesteps", size=n)
        ids = None if sample_ids is None else _cells(sample_ids, "sample_ids", size=n, integer=True)
        if self._cells and (self._cells[0][3] is None) != (ids is None):
            raise MonitorError("sample_ids given on some record() calls of a step and not on others; give them on all.")
        if self._cells and (self._cells[0][2] is None) != (ts is None):
            raise MonitorError("timesteps given on some record() calls of a step and not on others; give them on all.")
        self._cells.append((old, new, ts, ids))

    def end_step(self) -> StepVerdict | None:
        """End the open step by hand and judge it (the optimizer's hook does it at the first update)."""
        if self._open is None or self._closed:
            return None
        self._closed = True
        cells, self._cells = self._cells, []
        if not cells:
            raise MonitorError(
                f"step {self._open} ended with nothing recorded: call monitor.record(...) where the trainer "
                f"recomputes the rollout's log-probs, before the update."
            )
        return self._step(self._open, _tables_of(cells))

    def mark_sync(self) -> None:
        """The next judged step is the first after a weight sync (a resume, an engine reload): a failure there is
        a ``sync`` alarm naming the sync."""
        self.judge.mark_sync()

    def summary(self) -> JudgeSummary:
        """The run so far; ``passed`` only when a step was judged and no alarm fired."""
        return self.judge.summary()

    def close(self) -> JudgeSummary:
        """End an open step, remove the optimizer hook, close the monitor's own writers; the run's summary."""
        try:
            if self._open is not None and not self._closed and self._cells:
                self.end_step()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            for writer in self._own_writers.values():
                writer.close()
            self._own_writers = {}
        return self.summary()

    def __enter__(self) -> RunMonitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # the loop failed: release what the monitor holds, judge nothing more
            self._cells = []
            self._closed = True
            self.close()

    # ------------------------------------------------------------------------------------------------
    def _on_update(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._open is not None and not self._closed and self._cells:
            self.end_step()

    def _step(self, step: int, tables: _Tables) -> StepVerdict:
        gate_settings = self.settings.gate
        low, high = gate_settings.clip_range
        try:
            stats = StepStats.from_tables(
                tables.rollout,
                tables.trainer,
                timesteps=tables.timesteps,
                mask=tables.mask,
                clip_ratio_low=low,
                clip_ratio_high=high,
            )
        except StepStatsError as error:
            raise MonitorError(f"step {step}: {error}") from error
        if self.settings.distributed:
            stats = self._reduce(step, stats, tables.rollout.shape)
        if tables.sample_ids is not None and tables.sample_ids.shape != (tables.rollout.shape[0],):
            raise MonitorError(
                f"step {step}: sample_ids has shape {tables.sample_ids.shape}, expected ({tables.rollout.shape[0]},)."
            )
        extra: tuple[Alarm, ...] = ()
        width = tables.rollout.shape[1]
        if self._width is None:
            self._width = width
        elif width != self._width:
            extra = (
                Alarm(
                    "shape",
                    step,
                    f"the tables have {width} steps per sample, the first judged step had {self._width}: the SDE "
                    f"window or the recorded steps changed mid-run",
                    figure="steps_per_sample",
                    value=float(width),
                    limit=float(self._width),
                ),
            )
        figures = stats.figures()
        verdict = self.judge.judge(step, figures, extra_alarms=extra)
        self.last_verdict, self.last_figures = verdict, figures
        self._log(step, figures, verdict)
        if verdict.alarms:
            self._alarm(step, verdict, tables)
        return verdict

    def _log(self, step: int, figures: StepFigures, verdict: StepVerdict) -> None:
        if not self._targets or self._rank:
            return
        prefix = self.settings.prefix
        scalars = figures.scalars(prefix)
        scalars[f"{prefix}verdict/passed"] = 1.0 if verdict.passed else 0.0
        scalars[f"{prefix}alarms"] = float(len(verdict.alarms))
        for alarm in verdict.alarms:
            scalars[f"{prefix}alarm/{alarm.kind}"] = 1.0
        if verdict.cusum is not None:
            scalars[f"{prefix}drift/cusum"] = verdict.cusum
        for target in self._targets:
            try:
                log_scalars(self._writer(target), scalars, step)
            except Exception as error:  # a tracker must never end the training run
                warnings.warn(
                    f"run monitor: logging step {step} to {target!r} failed ({type(error).__name__}: {error}); "
                    f"training goes on.",
                    MonitorWarning,
                    stacklevel=3,
                )

    def _writer(self, target: Any) -> Any:
        if not isinstance(target, str):
            return target
        if target not in self._own_writers:
            from torch.utils.tensorboard import SummaryWriter

            self._own_writers[target] = SummaryWriter(log_dir=target.partition(":")[2])
        return self._own_writers[target]

    def _reduce(self, step: int, stats: StepStats, shape: tuple[int, ...]) -> StepStats:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise MonitorError(
                "distributed=True but torch.distributed has no process group: call "
                "torch.distributed.init_process_group(...) before the first step, or leave distributed off."
            )
        self._rank = dist.get_rank(self._group)
        return reduce_step_stats(
            stats,
            step=step,
            shape=shape,
            max_timesteps=self.settings.max_timesteps,
            timeout_s=self.settings.reduce_timeout_s,
            group=self._group,
        )

    def _alarm(self, step: int, verdict: StepVerdict, tables: _Tables) -> None:
        kept = len(self.alarm_records) < self.settings.max_alarms_kept
        lead = not self._rank  # rank 0, or one process
        # The doctor runs for the alarms kept in full: a run that fails every step costs it max_alarms_kept times.
        causes, diagnosis, status = self._doctor(tables) if kept and lead else ((), (), None)
        if any(a.kind == "sync" for a in verdict.alarms):
            # The step follows a weight sync the loop announced: weights that did not reach the rollout come first.
            causes = ("different-weights", *(c for c in causes if c != "different-weights"))
        dump, dump_error = self._dump(step, verdict, tables)
        notes = []
        if self._rank is not None:
            notes.append(
                "the figures and verdict are the global batch's; the doctor ran on rank 0's shard, and every rank "
                "dumped its own shard (monitor-step*-rank*.safetensors)"
            )
        if self._nan_capture is not None and any(a.kind == "nonfinite" for a in verdict.alarms):
            captured = getattr(self._nan_capture, "captured_path", None)
            where = getattr(self._nan_capture, "directory", "?")
            notes.append(
                f"NaN capture: {captured}"
                if captured
                else f"NaN capture is armed: the first step with non-finite gradients is captured to {where}"
            )
        record = AlarmRecord(step, verdict.alarms, causes, diagnosis, status, dump, dump_error, tuple(notes))
        if kept:
            self.alarm_records.append(record)
        if dump_error is not None:
            warnings.warn(f"run monitor: step {step}: {dump_error}", MonitorWarning, stacklevel=3)
        # Every rank holds the same verdict: raise and stop act on all of them, so none waits alone at a collective.
        policy = self.settings.on_alarm
        if policy == "raise":
            raise MonitorAlarm(record)
        if policy == "stop":
            self.should_stop = True
        if lead:
            warnings.warn(record.format(), MonitorWarning, stacklevel=3)

    def _doctor(self, tables: _Tables) -> tuple[tuple[str, ...], tuple[Mapping[str, Any], ...], str | None]:
        if tables.rollout.shape != tables.trainer.shape or tables.rollout.size == 0:
            return (), (), None
        rollout, trainer = _padded(tables)
        ids = tables.sample_ids
        if ids is not None and np.unique(ids).size != ids.size:
            ids = None
        try:
            report = gate(
                rollout,
                trainer,
                self.settings.gate.replace(source="RunMonitor"),
                timesteps=tables.timesteps if tables.mask is None else None,
                sample_ids=ids,
            )
        except (ValueError, TypeError) as error:
            return (), ({"cause": "undetermined", "summary": f"the doctor could not run: {error}"},), None
        return tuple(d["cause"] for d in report.diagnosis), report.diagnosis, report.status

    def _dump(self, step: int, verdict: StepVerdict, tables: _Tables) -> tuple[str | None, str | None]:
        directory = self.settings.dump_dir
        if directory is None or self._dumps >= self.settings.max_dumps:
            return None, None
        rank = "" if self._rank is None else f"-rank{self._rank}"
        path = Path(directory) / f"monitor-step{step:08d}{rank}.safetensors"
        rollout, trainer = _padded(tables)
        ids = tables.sample_ids
        try:
            write_dump(
                path,
                rollout,
                trainer,
                timesteps=tables.timesteps if tables.mask is None else None,
                sample_ids=ids if ids is not None and np.unique(ids).size == ids.size else None,
                metadata={
                    "producer": "rollout_consistency.gate.monitor.RunMonitor",
                    "step": str(step),
                    "alarms": json.dumps([a.kind for a in verdict.alarms]),
                },
            )
        except (OSError, ValueError) as error:
            return None, f"the tables could not be dumped to {path}: {error}"
        self._dumps += 1
        return str(path), None


# ----------------------------------------------------------------------------------------------------
def _targets(log_to: Any) -> list[Any]:
    if log_to is None:
        return []
    targets = list(log_to) if isinstance(log_to, (list, tuple)) else [log_to]
    for target in targets:
        if isinstance(target, (str, os.PathLike)):
            spec = parse_tracker(os.fspath(target))
            if spec.kind != "tensorboard":
                raise LoggerError(
                    f"the run monitor logs every step into a run you hold: pass your wandb or MLflow run object, "
                    f"not {str(spec)!r} (only 'tensorboard:DIR' opens a writer of the monitor's own)."
                )
    return [os.fspath(t) if isinstance(t, os.PathLike) else t for t in targets]


def _cells(value: Any, name: str, *, size: int | None = None, integer: bool = False) -> Any:
    """A flat copy of one record() argument, kept as given (a torch tensor stays one: the step's cells are joined
    and converted once, at its end); dtypes are checked here."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        flat = value.detach().reshape(-1)
        dtype = str(flat.dtype).removeprefix("torch.")
        if integer:
            if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == _torch_bool(flat):
                raise MonitorError(f"{name} must hold integers, got dtype {dtype}.")
        elif dtype not in ("float32", "float64"):
            raise MonitorError(
                f"{name} is {dtype}; record float32 log-probs (and timesteps): low precision has "
                f"already lost the digits compared here."
            )
        out = flat.cpu().clone() if flat.device.type == "cpu" else flat.cpu()
    else:
        out = np.array(value).reshape(-1)
        if integer and out.dtype.kind not in "iu":
            raise MonitorError(f"{name} must hold integers, got dtype {out.dtype}.")
        if not integer and out.dtype not in (np.float32, np.float64):
            raise MonitorError(f"{name} has dtype {out.dtype}; record float32 log-probs (and timesteps).")
    if size is not None and _size(out) != size:
        raise MonitorError(f"{name} has {_size(out)} values, expected {size} (one per recorded cell).")
    return out


def _torch_bool(tensor: Any) -> Any:
    import torch

    return torch.bool


def _size(value: Any) -> int:
    return int(value.numel()) if hasattr(value, "numel") and callable(value.numel) else int(value.size)


def _joined(parts: list[Any]) -> np.ndarray:
    if hasattr(parts[0], "detach"):
        import torch

        return torch.cat(parts).numpy()
    return np.concatenate([host_array(p, "a recorded table", MonitorError) for p in parts])


def _tables_of(cells: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]]) -> _Tables:
    """One step's records as tables: a row per sample id (entries in call order, padded and masked), or a row per
    entry without ids."""
    old = _joined([c[0] for c in cells])
    new = _joined([c[1] for c in cells])
    dtype = np.result_type(old.dtype, new.dtype)
    old, new = old.astype(dtype, copy=False), new.astype(dtype, copy=False)
    ts = None if cells[0][2] is None else _joined([c[2] for c in cells]).astype(np.float32)
    if cells[0][3] is None:
        return _Tables(old[:, None], new[:, None], None if ts is None else ts[:, None], None, None)
    ids = _joined([c[3] for c in cells]).astype(np.int64)
    unique, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.searchsorted(inverse[order], np.arange(unique.size))
    column = np.empty(ids.size, dtype=np.int64)
    column[order] = np.arange(ids.size) - starts[inverse[order]]
    width = int(column.max()) + 1
    shape = (unique.size, width)
    rollout, trainer = np.zeros(shape, dtype), np.zeros(shape, dtype)
    mask = np.zeros(shape, dtype=bool)
    rollout[inverse, column], trainer[inverse, column], mask[inverse, column] = old, new, True
    steps = None
    if ts is not None:
        steps = np.zeros(shape, np.float32)
        steps[inverse, column] = ts
    return _Tables(rollout, trainer, steps, None if mask.all() else mask, unique)


def _padded(tables: _Tables) -> tuple[np.ndarray, np.ndarray]:
    """Both tables with masked-out entries set equal (0): the gate has no mask, and equal entries add no Δ."""
    rollout, trainer = tables.rollout, tables.trainer
    if tables.mask is None:
        return rollout, trainer
    rollout, trainer = rollout.copy(), trainer.copy()
    rollout[~tables.mask] = 0.0
    trainer[~tables.mask] = 0.0
    return rollout, trainer
