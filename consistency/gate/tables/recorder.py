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
recording ends at the first step that really updates the weights (a step pre-hook on the innermost torch
optimizer: everything recorded so far was scored by the weights the rollout used); later calls are ignored.
``finish()`` ends it by hand (a loop with no optimizer, or a context manager's exit).

**The optimizer users hold.** The recorder looks through the wrappers for the torch optimizer whose ``step``
updates the weights, following ``.optimizer`` / ``.optim`` / ``.scheduler``: accelerate's
``AcceleratedOptimizer`` (whose ``step()`` under ``accelerator.accumulate`` skips the inner step until the
gradients sync: the first *real* update ends the recording), a ``torch.optim.lr_scheduler`` (or accelerate's
``AcceleratedScheduler``), DeepSpeed's engine and ZeRO optimizer (``.optimizer``, by duck typing: DeepSpeed is
not a dependency), ``ZeroRedundancyOptimizer`` (``.optim``). A ``GradScaler`` step skipped for inf/NaN
gradients updates nothing, so the recording goes on.

**Coverage.** ``expected_samples`` (a count ``N`` — ids ``0..N-1`` — or the ids) says which samples the
rollout produced. With it the ``complete`` guard checks that every one was gated, and the report names those
that were not (a loop that updates after each micro-batch scores the others with updated weights: they cannot
be step-1 gated); without it ``complete`` is *not checked*. The report's ``run["coverage"]`` and notes say how
many samples and steps were recorded, and the dump carries the same so ``gate DUMP`` reaches the same verdict.

At the end, with ``torch.distributed`` initialised, every rank's cells are gathered (``all_gather_object``;
sample ids must be global), so every rank holds the same tables. The recorded samples become rows (sorted by
id) and the recorded steps columns; rank 0 writes the dump (`rollout_consistency.gate.tables.dump`) when asked, and every
rank gates the tables (`rollout_consistency.gate.gate`) into ``recorder.report``.

Fails closed with a `RecorderError` naming the cell: ``old_log_probs`` and ``log_probs`` that are one tensor or
share memory (nothing would be compared: verl's bypass mode), a (sample, step) recorded twice (also across ranks), a
recorded sample lacking a recorded step (or a step of ``range(num_steps)``), mismatched shapes, a NaN/inf
log-prob or timestep, a negative window start, a per-sample value (prompt group, window start, advantage)
that changes between calls, or nothing recorded at all — so every dump it writes is one ``gate`` accepts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.aliasing import ALIASED_FIX, shares_memory
from rollout_consistency.gate.judging.loggers import check_target
from rollout_consistency.gate.judging.views import host_array

from .api import gate
from .coverage import COVERAGE_KEY, settings_with_coverage
from .dump import write_dump


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
        optimizer (*optional*): the optimizer your loop steps — a ``torch.optim.Optimizer``, accelerate's
            ``AcceleratedOptimizer``, a DeepSpeed engine or ZeRO optimizer, an lr scheduler: the first step of
            the torch optimizer inside that really updates the weights ends the recording (a step pre-hook,
            removed afterwards). Without one, call `finish` yourself.
        dump (`str` or path, *optional*): write the tables here (rank 0 only) as a log-prob dump.
        gate (`bool`): gate the tables in process into ``report`` (default ``True``).
        num_steps (`int`, *optional*): every recorded sample must have steps ``0 .. num_steps-1``; without it,
            every recorded sample must have every step recorded for any sample.
        expected_samples (`int` or iterable of ids, *optional*): the samples the rollout produced (an int ``N``
            means ids ``0 .. N-1``): the ``complete`` guard FAILs naming those not recorded before the first
            update; without it ``complete`` is not checked.
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
        self._hooked = ""
        if optimizer is not None:
            inner, self._hooked = innermost_optimizer(optimizer)
            self._hook = inner.register_step_pre_hook(self._on_first_step)

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
        if shares_memory(old_log_probs, log_probs):  # the cells keep values only: refused here, or never seen
            raise RecorderError(
                f"old_log_probs and log_probs are one tensor (or share memory) at step {sorted(set(steps.tolist()))[:4]}: nothing "
                f"would be compared; {ALIASED_FIX}."
            )
        ts = None if timesteps is None else _floats(timesteps, "timesteps", n, allow_wide=True)
        if (steps < 0).any():
            raise RecorderError(f"step must be >= 0, got {steps.tolist()}.")
        if ts is not None and not np.isfinite(ts).all():
            i = int(np.nonzero(~np.isfinite(ts))[0][0])
            raise RecorderError(
                f"timesteps is {ts[i]} at sample {int(ids[i])} step {int(steps[i])}; pass the scheduler's timestep "
                f"of each stored step."
            )
        for name, values in (("old_log_probs", old), ("log_probs", new)):
            bad = np.nonzero(~np.isfinite(values))[0]
            if bad.size:
                i = int(bad[0])
                raise RecorderError(
                    f"{name} is {values[i]} at sample {int(ids[i])} step {int(steps[i])}: a non-finite log-prob "
                    f"fails the step-1 check; find where it turns NaN (rollout_consistency.NanCapture)."
                )
        per_sample: dict[str, np.ndarray] = {}
        for name, value in (("prompt_groups", prompt_groups), ("window_starts", window_starts)):
            if value is not None:
                per_sample[name] = _ints(value, name, n)
        if "window_starts" in per_sample and (per_sample["window_starts"] < 0).any():
            raise RecorderError(
                f"window_starts must be >= 0 (the first SDE step), got {per_sample['window_starts'].tolist()}."
            )
        if advantages is not None:
            per_sample["advantages"] = _floats(advantages, "advantages", n, allow_wide=True)
            if not np.isfinite(per_sample["advantages"]).all():
                raise RecorderError("advantages holds NaN or inf; pass the advantage each sample is trained with.")
        keys = [(int(ids[i]), int(steps[i])) for i in range(n)]
        twice = next((key for i, key in enumerate(keys) if key in self._cells or key in keys[:i]), None)
        if twice is not None:
            raise RecorderError(
                f"sample {twice[0]} step {twice[1]} recorded twice before the first optimizer step; each (sample, "
                f"step) cell is scored once per update (are sample ids global and step the original index?)."
            )
        for name, values in per_sample.items():
            self._remember(name, ids, values, check_only=True)
        # Everything checked: a call that raises records nothing.
        for i, key in enumerate(keys):
            self._cells[key] = _Cell(float(old[i]), float(new[i]), None if ts is None else float(ts[i]))
        for name, values in per_sample.items():
            self._remember(name, ids, values)

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
        self.tables = _tables(cells, per_sample, self._num_steps)
        coverage = self._coverage()
        if self._dump is not None and _rank() == 0:
            metadata = {"producer": "rollout_consistency.gate.Step1Recorder", COVERAGE_KEY: json.dumps(coverage)}
            write_dump(self._dump, **self.tables, metadata=metadata)
        if self._gate:
            overrides = dict(self._gate_settings)
            base = overrides.pop("settings", None)
            overrides.setdefault("source", "Step1Recorder")
            self.report = gate(**self.tables, settings=settings_with_coverage(coverage, base, overrides))
            self.report.run["coverage"] = coverage
            if _rank() == 0:
                for target in self._log_to:  # before a FAIL raises: a failing report is the one to see
                    self.report.log_to(target)
            if self._raise_on_fail and not self.report.passed:
                raise Step1GateFailed("step-1 gate FAILED at the first optimizer step\n" + self.report.format_table())
        return self.report

    def _coverage(self) -> dict[str, Any]:
        """What was recorded against what the rollout produced (`rollout_consistency.gate.tables.coverage`)."""
        assert self.tables is not None
        recorded = self.tables["sample_ids"].tolist()
        coverage: dict[str, Any] = {
            "recorded_samples": len(recorded),
            "recorded_steps": int(self.tables["rollout_log_probs"].shape[1]),
            "ended_by": f"the first step of {self._hooked}" if self._hooked else "finish()",
            "expected_samples": None,
            "not_gated": None,
        }
        if self._expected is not None:
            coverage["expected_samples"] = len(self._expected)
            coverage["not_gated"] = sorted(set(self._expected) - set(recorded))
            coverage["expected_ids"] = (
                None if self._expected == list(range(len(self._expected))) else list(self._expected)
            )
        return coverage

    # ------------------------------------------------------------------------------------------------
    def _on_first_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.finish()  # a step pre-hook must return None (or new arguments)

    def _remember(self, name: str, ids: np.ndarray, values: np.ndarray, *, check_only: bool = False) -> None:
        seen = self._per_sample[name]
        given: dict[int, float] = {}
        for sid, value in zip(ids.tolist(), values.tolist(), strict=True):
            before = seen.get(sid, given.get(sid, value))
            if before != value:
                raise RecorderError(
                    f"sample {sid}: {name} was {before} and is now {value}; it is one value per sample."
                )
            given[sid] = value
        if not check_only:
            seen.update(given)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# ----------------------------------------------------------------------------------------------------
def _log_targets(log_to: Any) -> list[Any]:
    targets = [] if log_to is None else list(log_to) if isinstance(log_to, (list, tuple)) else [log_to]
    for target in targets:
        check_target(target)
    return targets


def _ints(value: Any, name: str, n: int | None = None) -> np.ndarray:
    array = host_array(value, name, RecorderError)
    if array.ndim == 0 and n is not None:
        array = np.full(n, array)
    if array.ndim != 1 or (n is not None and array.shape[0] != n):
        expected = "(B,)" if n is None else f"({n},) like sample_ids"
        raise RecorderError(f"{name} has shape {array.shape}, expected {expected}.")
    if array.dtype.kind not in "iu":
        raise RecorderError(f"{name} must hold integers, got dtype {array.dtype}.")
    return array.astype(np.int64)


def _floats(value: Any, name: str, n: int, *, allow_wide: bool = False) -> np.ndarray:
    array = host_array(value, name, RecorderError)
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
    cells: dict[tuple[int, int], _Cell], per_sample: dict[str, dict[int, float]], num_steps: int | None
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


# ----------------------------------------------------------------------------------------------------
#: Attributes through which wrappers hold the optimizer (accelerate, lr schedulers, DeepSpeed, ZeRO).
_INNER = ("optimizer", "optim", "scheduler")


def innermost_optimizer(optimizer: Any) -> tuple[Any, str]:
    """(the torch optimizer whose ``step`` updates the weights, a description of the path to it) inside what a
    training loop holds: `optimizer` itself, or the one found through ``.optimizer`` / ``.optim`` /
    ``.scheduler`` (accelerate's AcceleratedOptimizer and AcceleratedScheduler, lr schedulers, DeepSpeed's
    engine and ZeRO optimizer, ZeroRedundancyOptimizer).

    Raises:
        RecorderError: no torch optimizer that accepts step hooks was found (the message lists the path).
    """
    path, current = [], optimizer
    for _ in range(8):  # wrappers nest two or three deep; a cycle must not loop
        path.append(type(current).__name__)
        inner = next(
            (getattr(current, name) for name in _INNER if getattr(current, name, None) not in (None, current)), None
        )
        if inner is None or isinstance(inner, (list, tuple, dict)):
            break
        current = inner
    if not hasattr(current, "_optimizer_step_pre_hooks") or not hasattr(current, "register_step_pre_hook"):
        raise RecorderError(
            f"Step1Recorder: no torch optimizer found inside {' -> '.join(path)} (looked through .optimizer, "
            f".optim, .scheduler); pass the torch.optim.Optimizer that updates the weights, or call "
            f"recorder.finish() yourself before the first update."
        )
    described = path[-1] + (f" (inside {' inside '.join(reversed(path[:-1]))})" if len(path) > 1 else "")
    return current, described


def digest_ids(rows: Any) -> np.ndarray:
    """Sample ids for a loop that keeps none: a 63-bit BLAKE2b digest of each row's bytes, ``(B,)`` int64.

    Pass a sample's *whole* stored trajectory, e.g. flow_grpo's ``sample["latents"]`` ``(B, T, ...)``, once per
    micro-batch: its rows differ between samples by their SDE noise. The first step's latents alone do not
    when a prompt group shares its initial noise (DanceGRPO's ``--init_same_noise``): two samples then get one
    id and the recorder refuses the second as recorded twice. The digest of a row is the same wherever the
    trainer holds it (shuffled, on another device), because the stored float32 bytes are. Cost: one host copy
    and one hash of the rows (docs/ci.md, "Sample ids"); an id added before the shuffle costs nothing.
    """
    if hasattr(rows, "detach"):
        rows = rows.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(np.asarray(rows))
    if array.ndim < 1 or array.shape[0] == 0:
        raise RecorderError(f"digest_ids needs a batch of rows (B, ...), got shape {array.shape}.")
    flat = array.reshape(array.shape[0], -1)
    return np.asarray(
        [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1 for row in flat],
        dtype=np.int64,
    )
