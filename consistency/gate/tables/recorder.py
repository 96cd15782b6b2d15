# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`Step1Recorder`: record the first update of the user's own training loop and gate it.

A few lines in the trainer, where it recomputes log-probs at its first update::

    recorder = Step1Recorder(optimizer, dump="step1_logprobs.safetensors")
    ...
            log_prob = compute_log_prob(...)                      # the trainer's recomputation, (B,)
            recorder.record(sample_ids, step, old_log_prob, log_prob)
    ...
    optimizer.step()    # the first step ends the recording: gathered, written, gated
    assert recorder.report.passed, recorder.report.format_table()

Each call records one ``(sample, step)`` cell per row, in any order: shuffled samples, permuted timesteps
(Flow-GRPO permutes both per epoch: pass each row's *original* step index), per-timestep micro-batches and
gradient accumulation all work, because cells are keyed by (sample id, step), never by call order. The
recording ends at the first ``optimizer.step()`` (a step pre-hook: everything recorded so far was scored by
the weights the rollout used); later calls are ignored. ``finish()`` ends it by hand (a loop with no
optimizer, or a context manager's exit).

At the end, with ``torch.distributed`` initialised, every rank's cells are gathered (``all_gather_object``;
sample ids must be global), so every rank holds the same tables. The recorded samples become rows (sorted by
id) and the recorded steps columns; rank 0 writes the dump (`rollout_consistency.gate.tables.dump`) when asked, and every
rank gates the tables (`rollout_consistency.gate.gate`) into ``recorder.report``.

Fails closed with a `RecorderError` naming the cell: a (sample, step) recorded twice (also across ranks), a
recorded sample lacking a recorded step (or a step of ``range(num_steps)``), an expected sample never
recorded, mismatched shapes, a NaN/inf log-prob, a per-sample value (prompt group, window start,
advantage) that changes between calls, or nothing recorded at all.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


class RecorderError(ValueError):
    """The recording cannot make a complete, valid pair of tables; the message names the cell and the fix."""


class Step1GateFailed(AssertionError):
    """Raised at the first optimizer step when ``raise_on_fail=True`` and the gate FAILs (the table is the message)."""


@dataclass(frozen=True)
class _Cell:
    old: float
    new: float
    timestep: float | None


class Step1Recorder:
    """Records (sample id, step, rollout log-prob, trainer log-prob) until the first optimizer step.

    Args:
        optimizer (`torch.optim.Optimizer`, *optional*): its first ``step()`` ends the recording (a step
            pre-hook, removed afterwards). Without one, call `finish` yourself.
        dump (`str` or path, *optional*): write the tables here (rank 0 only) as a log-prob dump.
        gate (`bool`): gate the tables in process into ``report`` (default ``True``).
        num_steps (`int`, *optional*): every recorded sample must have steps ``0 .. num_steps-1``; without it,
            every recorded sample must have every step recorded for any sample.
        expected_samples (`int` or iterable of ids, *optional*): samples that must be recorded (an int ``N``
            means ids ``0 .. N-1``).
        raise_on_fail (`bool`): raise `Step1GateFailed` from the optimizer step when the gate FAILs, before
            the weights change.
        log_to (*optional*): also log the report (rank 0 only) to this tracker, or to each of a list: the
            trainer's own ``SummaryWriter``, wandb run or MLflow run (at its current step), or
            ``"tensorboard:DIR"`` / ``"wandb"`` / ``"mlflow"`` (`Report.log_to`). Checked here, before any
            recording: an unknown tracker or a missing package raises `LoggerError`.
        **gate_settings: `rollout_consistency.gate.gate` keywords (``profile``, ``clip_ratio``, ...).
    """

    def __init__(
        self,
        optimizer: Any = None,
        *,
        dump: str | os.PathLike[str] | None = None,
        gate: bool = True,
        num_steps: int | None = None,
        expected_samples: int | Iterable[int] | None = None,
        raise_on_fail: bool = False,
        log_to: Any = None,
        **gate_settings: Any,
    ) -> None:
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
            raise RecorderError(f"num_steps must be a positive int, got {num_steps!r}.")
        self._dump = dump
        self._gate = gate
        self._num_steps = num_steps
        if isinstance(expected_samples, int):
            expected_samples = range(expected_samples)
        self._expected = None if expected_samples is None else sorted({int(i) for i in expected_samples})
        self._raise_on_fail = raise_on_fail
        if log_to is not None and not gate:
            raise RecorderError("log_to logs the gate's report; it needs gate=True.")
        self._log_to = _log_targets(log_to)
        self._gate_settings = gate_settings
        self._cells: dict[tuple[int, int], _Cell] = {}
        self._per_sample: dict[str, dict[int, float]] = {"prompt_groups": {}, "window_starts": {}, "advantages": {}}
        self._done = False
        self.report: Any = None
        self.tables: dict[str, np.ndarray] | None = None
        self._hook = None
        if optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(self._on_first_step)

    @property
    def done(self) -> bool:
        """Whether the recording has ended (later `record` calls are ignored)."""
        return self._done

    def __enter__(self) -> Step1Recorder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None and not self._done:
            self.finish()
        self._remove_hook()

    # ------------------------------------------------------------------------------------------------
    def record(
        self,
        sample_ids: Any,
        step: Any,
        old_log_probs: Any,
        log_probs: Any,
        *,
        timesteps: Any = None,
        prompt_groups: Any = None,
        window_starts: Any = None,
        advantages: Any = None,
    ) -> None:
        """Record one micro-batch at one step (or at a step per row).

        Args:
            sample_ids (`(B,)` int): global id of each row's sample.
            step (`int` or `(B,)` int): each row's step index in its own trajectory (the original index,
                before any per-epoch timestep permutation).
            old_log_probs (`(B,)` float32): the rollout's stored log-probs of these cells.
            log_probs (`(B,)` float32): the trainer's recomputation (a graph-carrying tensor is fine: it is
                detached here).
            timesteps (`float` or `(B,)`, *optional*): the timestep value of each cell.
            prompt_groups, window_starts (`(B,)` int), advantages (`(B,)` float), *optional*: per-sample
                values; the same sample must always get the same value.
        """
        if self._done:
            return  # after the first optimizer step the trainer scores updated weights: not step 1 any more
        ids = _ints(sample_ids, "sample_ids")
        n = ids.size
        steps = _ints(step, "step", n)
        old = _floats(old_log_probs, "old_log_probs", n)
        new = _floats(log_probs, "log_probs", n)
        ts = None if timesteps is None else _floats(timesteps, "timesteps", n, allow_wide=True)
        if (steps < 0).any():
            raise RecorderError(f"step must be >= 0, got {steps.tolist()}.")
        for name, values in (("old_log_probs", old), ("log_probs", new)):
            bad = np.nonzero(~np.isfinite(values))[0]
            if bad.size:
                i = int(bad[0])
                raise RecorderError(
                    f"{name} is {values[i]} at sample {int(ids[i])} step {int(steps[i])}: a non-finite log-prob "
                    f"fails the step-1 check; find where it turns NaN (rollout_consistency.NanCapture)."
                )
        for i in range(n):
            key = (int(ids[i]), int(steps[i]))
            if key in self._cells:
                raise RecorderError(
                    f"sample {key[0]} step {key[1]} recorded twice before the first optimizer step; each (sample, "
                    f"step) cell is scored once per update (are sample ids global and step the original index?)."
                )
            self._cells[key] = _Cell(float(old[i]), float(new[i]), None if ts is None else float(ts[i]))
        for name, value in (("prompt_groups", prompt_groups), ("window_starts", window_starts)):
            if value is not None:
                self._remember(name, ids, _ints(value, name, n))
        if advantages is not None:
            values = _floats(advantages, "advantages", n, allow_wide=True)
            if not np.isfinite(values).all():
                raise RecorderError("advantages holds NaN or inf; pass the advantage each sample is trained with.")
            self._remember("advantages", ids, values)

    def finish(self) -> Any:
        """End the recording: gather across ranks, check completeness, write the dump, gate. Idempotent.

        Returns:
            the `GateReport` (``None`` with ``gate=False``).
        """
        if self._done:
            return self.report
        self._done = True
        self._remove_hook()
        cells, per_sample = _gather(self._cells, self._per_sample)
        self.tables = _tables(cells, per_sample, self._num_steps, self._expected)
        if self._dump is not None and _rank() == 0:
            from .dump import write_dump

            write_dump(self._dump, **self.tables, metadata={"producer": "rollout_consistency.gate.Step1Recorder"})
        if self._gate:
            from .api import gate

            self.report = gate(**self.tables, source="Step1Recorder", **self._gate_settings)
            if _rank() == 0:
                for target in self._log_to:  # before a FAIL raises: a failing report is the one to see
                    self.report.log_to(target)
            if self._raise_on_fail and not self.report.passed:
                raise Step1GateFailed("step-1 gate FAILED at the first optimizer step\n" + self.report.format_table())
        return self.report

    # ------------------------------------------------------------------------------------------------
    def _on_first_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.finish()  # a step pre-hook must return None (or new arguments)

    def _remember(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        seen = self._per_sample[name]
        for sid, value in zip(ids.tolist(), values.tolist(), strict=True):
            if sid in seen and seen[sid] != value:
                raise RecorderError(
                    f"sample {sid}: {name} was {seen[sid]} and is now {value}; it is one value per sample."
                )
            seen[sid] = value

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# ----------------------------------------------------------------------------------------------------
def _log_targets(log_to: Any) -> list[Any]:
    from rollout_consistency.gate.judging.loggers import check_target

    targets = [] if log_to is None else list(log_to) if isinstance(log_to, (list, tuple)) else [log_to]
    for target in targets:
        check_target(target)
    return targets


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            raise RecorderError(
                f"a {value.dtype} log-prob has already lost the digits the step-1 check compares; compute the "
                f"log-prob in float32 (cast the model output to float32 before the scheduler's log-prob)."
            )
        value = value.numpy()
    return np.asarray(value)


def _ints(value: Any, name: str, n: int | None = None) -> np.ndarray:
    array = _numpy(value)
    if array.ndim == 0 and n is not None:
        array = np.full(n, array)
    if array.ndim != 1 or (n is not None and array.shape[0] != n):
        expected = "(B,)" if n is None else f"({n},) like sample_ids"
        raise RecorderError(f"{name} has shape {array.shape}, expected {expected}.")
    if array.dtype.kind not in "iu":
        raise RecorderError(f"{name} must hold integers, got dtype {array.dtype}.")
    return array.astype(np.int64)


def _floats(value: Any, name: str, n: int, *, allow_wide: bool = False) -> np.ndarray:
    array = _numpy(value)
    if array.ndim == 0 and allow_wide:
        array = np.full(n, array)
    if array.shape != (n,):
        raise RecorderError(
            f"{name} has shape {array.shape}, expected ({n},) like sample_ids (one value per row; squeeze or "
            f"reduce it to one log-prob per sample first)."
        )
    if array.dtype == np.float32 or (allow_wide and array.dtype.kind in "fiu"):
        return array.astype(np.float64) if allow_wide else array
    raise RecorderError(f"{name} has dtype {array.dtype}; record float32 log-probs, as the rollout stored them.")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(
    cells: dict[tuple[int, int], _Cell], per_sample: dict[str, dict[int, float]]
) -> tuple[dict[tuple[int, int], _Cell], dict[str, dict[int, float]]]:
    """Every rank's cells on every rank (``all_gather_object``), duplicates across ranks refused."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return cells, per_sample
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (cells, per_sample))
    merged: dict[tuple[int, int], _Cell] = {}
    merged_per_sample: dict[str, dict[int, float]] = {name: {} for name in per_sample}
    for rank, (rank_cells, rank_per_sample) in enumerate(gathered):
        for key, cell in rank_cells.items():
            if key in merged:
                raise RecorderError(
                    f"sample {key[0]} step {key[1]} recorded on two ranks (again on rank {rank}); sample ids must "
                    f"be global (e.g. rank * samples_per_rank + local index)."
                )
            merged[key] = cell
        for name, values in rank_per_sample.items():
            for sid, value in values.items():
                if merged_per_sample[name].get(sid, value) != value:
                    raise RecorderError(f"sample {sid}: ranks disagree on its {name}.")
                merged_per_sample[name][sid] = value
    return merged, merged_per_sample


def _tables(
    cells: dict[tuple[int, int], _Cell],
    per_sample: dict[str, dict[int, float]],
    num_steps: int | None,
    expected: list[int] | None,
) -> dict[str, np.ndarray]:
    if not cells:
        raise RecorderError(
            "nothing was recorded before the first optimizer step; call recorder.record(...) where the trainer "
            "recomputes log-probs, before optimizer.step()."
        )
    samples = sorted({sid for sid, _ in cells})
    steps = list(range(num_steps)) if num_steps is not None else sorted({step for _, step in cells})
    if num_steps is not None:
        beyond = sorted(key for key in cells if key[1] >= num_steps)
        if beyond:
            raise RecorderError(f"sample {beyond[0][0]} step {beyond[0][1]} is beyond num_steps={num_steps}.")
    if expected is not None:
        absent = sorted(set(expected) - set(samples))
        if absent:
            raise RecorderError(
                f"{len(absent)} expected sample(s) never recorded before the first optimizer step: {absent[:6]}; "
                f"record every sample of the first update (or lower expected_samples)."
            )
    missing = [(sid, step) for sid in samples for step in steps if (sid, step) not in cells]
    if missing:
        shown = ", ".join(f"sample {s} step {t}" for s, t in missing[:6])
        raise RecorderError(
            f"{len(missing)} (sample, step) cell(s) missing before the first optimizer step ({shown}); record every "
            f"step of each recorded sample, or end the recording before a partly-scored sample."
        )
    row = {sid: i for i, sid in enumerate(samples)}
    col = {step: j for j, step in enumerate(steps)}
    shape = (len(samples), len(steps))
    old = np.empty(shape, dtype=np.float32)
    new = np.empty(shape, dtype=np.float32)
    stamped = [cell.timestep is not None for cell in cells.values()]
    if any(stamped) and not all(stamped):
        raise RecorderError("timesteps were given for some cells only; pass them on every record() call or none.")
    ts = np.empty(shape, dtype=np.float32) if all(stamped) else None
    for (sid, step), cell in cells.items():
        i, j = row[sid], col[step]
        old[i, j], new[i, j] = cell.old, cell.new
        if ts is not None:
            ts[i, j] = cell.timestep
    tables: dict[str, np.ndarray] = {
        "rollout_log_probs": old,
        "trainer_log_probs": new,
        "sample_ids": np.asarray(samples, dtype=np.int64),
    }
    if ts is not None:
        tables["timesteps"] = ts
    for name, values in per_sample.items():
        if not values:
            continue
        lacking = [sid for sid in samples if sid not in values]
        if lacking:
            raise RecorderError(f"{name} given for some samples but not for {lacking[:6]}; pass it on every call.")
        dtype = np.float32 if name == "advantages" else np.int64
        tables[name] = np.asarray([values[sid] for sid in samples], dtype=dtype)
    assert all(math.isfinite(v) for v in old.ravel().tolist() + new.ravel().tolist())  # checked at record()
    return tables
