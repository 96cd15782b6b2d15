# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The working table of one comparison and its views, vectorised: no Python loop over entries or cells.

[`Entries`] is what a metric's ``values`` function reads: ``Δlogp = trainer − rollout`` of every (sample, step)
entry as one ``(B, W)`` float64 table (the only float64 copy of the inputs), its ``ratio = exp(Δlogp)``, and the
clip ranges. [`Layout`] knows which entries are compared and how they group — micro-batch cells per window
position, the exact timestep values, the samples — and pools a per-entry table into every view at once
([`Layout.pool`]).

Summation order is part of the contract: every figure is the same float64 number the reference loop (a
trainer's ``for step: for micro-batch: log(mean(...))``) gives, bit for bit:

* a cell's sum adds its entries one at a time in (sample, step) order, starting from 0.0;
* a view's figure adds its cells' values one at a time (micro-batch order; the overall figure in (micro-batch,
  position) order), starting from 0.0, and divides by the number of cells;
* a sample's figure adds its steps in order.

NumPy adds row by row when it reduces an axis that is not the contiguous one (`column_sums`), and
``np.add.accumulate`` is sequential by definition; both are used only where that order is the one above
(tests/test_judging_bits.py holds `column_sums`, `cell_sums`, `row_sums` and `sequential_sum` to a plain Python
loop, bit for bit: `test_column_sums_add_rows_one_at_a_time` and its neighbours).

Before any of that, a user's tables are read here, once for every reader (`compute_metrics`, `gate`, the recorder,
the dump, the monitor): `host_array` (a torch tensor to NumPy; bf16/fp16 refused), `float_table` (an ``(N, T)``
float32/float64 table) and `flag_table` (a bool or 0/1 mask), each raising the caller's own error class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "POOLS",
    "Entries",
    "Indicator",
    "Layout",
    "Pooled",
    "cell_sums",
    "column_sums",
    "flag_table",
    "float_table",
    "host_array",
    "sequential_sum",
]

#: How a per-entry quantity becomes a figure: the unweighted mean over cells of each cell's mean, the same
#: with each cell's population standard deviation, or the maximum over entries.
POOLS: tuple[str, ...] = ("mean", "std", "max")
#: Rows per block of the per-sample sums (a block of every column stays in cache).
_ROW_BLOCK = 8192
#: Elements per block of a sequential sum (bounded scratch memory).
_FLAT_BLOCK = 1 << 16


class Entries:
    """The entries a metric reads, as ``(B, W)`` float64 tables (entries that are not compared hold ``Δ = 0``).

    Attributes:
        delta: ``Δlogp = logp_trainer − logp_rollout`` (float64: exact for float32 inputs).
        clip_ratio_low, clip_ratio_high: the PPO clip ranges ε_low, ε_high.
    """

    def __init__(self, delta: np.ndarray, clip_ratio_low: float, clip_ratio_high: float) -> None:
        self.delta = delta
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self._ratio: np.ndarray | None = None
        self._flags: dict[str, np.ndarray] = {}  # boolean tables of the ratio, kept for the whole comparison
        self._read = False

    @property
    def ratio(self) -> np.ndarray:
        """``exp(Δlogp)``, computed once and kept while consecutive metrics read it (`settle`)."""
        self._read = True
        if self._ratio is None:
            with np.errstate(over="ignore", invalid="ignore"):
                self._ratio = np.exp(self.delta)
            if not self._flags:  # with the ratio at hand: a clip metric later needs no ratio of its own
                with np.errstate(invalid="ignore"):
                    self._flags["higher"] = np.subtract(self._ratio, 1.0) > self.clip_ratio_high
                    self._flags["lower"] = np.subtract(1.0, self._ratio) > self.clip_ratio_low
                self._flags["undefined"] = np.isnan(self._ratio)
        return self._ratio

    def settle(self) -> None:
        """After a metric: a ratio that metric did not read is dropped (one table less while the next runs)."""
        if not self._read:
            self._ratio = None
        self._read = False

    def _flag(self, name: str) -> np.ndarray:
        if not self._flags:
            self.ratio  # noqa: B018 (computes the flags)
        return self._flags[name]

    @property
    def clipped_higher(self) -> np.ndarray:
        """``ratio − 1 > ε_high`` (bool): clipped on the higher side (False where the ratio is NaN)."""
        return self._flag("higher")

    @property
    def clipped_lower(self) -> np.ndarray:
        """``1 − ratio > ε_low`` (bool): clipped on the lower side (False where the ratio is NaN)."""
        return self._flag("lower")

    def flagged(self, condition: np.ndarray) -> Indicator:
        """`condition` as a metric's values: 1.0 where it holds, 0.0 where not, NaN where the ratio is NaN (a NaN is
        never "not clipped"); pooled without a float table where no entry is flagged or undefined."""
        return Indicator(condition, self._flag("undefined"))

    def indicator(self, condition: np.ndarray) -> np.ndarray:
        """`flagged` as a float64 table."""
        return self.flagged(condition).table()


@dataclass(frozen=True)
class Indicator:
    """A metric's values that are 1.0 where `condition` holds, 0.0 where not, NaN where `undefined` (both ``(B, W)``
    bool). `Layout.pool` sums a block of them only where one entry is flagged or undefined: elsewhere every sum is
    0.0, as the float table's would be."""

    condition: np.ndarray
    undefined: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.condition.shape

    def table(self, rows: slice = slice(None)) -> np.ndarray:
        out = self.condition[rows].astype(np.float64)
        out[self.undefined[rows]] = np.nan
        return out

    def any(self, rows: slice, valid: np.ndarray | None) -> bool:
        """Whether an entry of `rows` that is compared is flagged or undefined."""
        flagged = self.condition[rows] | self.undefined[rows]
        return bool(flagged.any() if valid is None else (flagged & valid[rows]).any())


@dataclass(frozen=True)
class Pooled:
    """One quantity pooled into every view.

    Attributes:
        overall: the figure over all cells.
        positions: one figure per window position that has an entry (`Layout.positions` order).
        timesteps: one figure per timestep value (`Layout.timestep_values` order: large t first).
        samples: one figure per sample (NaN for a sample without entries).
    """

    overall: float
    positions: np.ndarray
    timesteps: np.ndarray
    samples: np.ndarray


class Layout:
    """Which entries are compared and how they group into cells and views.

    Args:
        valid (`(B, W)` bool or None): entries compared (None: all).
        shape: ``(B, W)``.
        micro_batch_size: the trainer's micro-batch (samples, in global order, cut into runs of this size).
        timesteps (`(B, W)` float or None): the exact timestep value of each entry (``by_timestep``).
    """

    def __init__(
        self, valid: np.ndarray | None, shape: tuple[int, int], micro_batch_size: int, timesteps: np.ndarray | None
    ) -> None:
        batch, width = shape
        self.shape = shape
        self.valid = None if valid is None or valid.all() else valid
        self.micro = max(1, min(micro_batch_size, max(batch, 1)))
        self.full_micro = batch // self.micro  # micro-batches of exactly `micro` rows; one shorter may follow
        self.cells_rows = self.full_micro + (batch % self.micro > 0)
        if self.valid is None:
            self.sample_counts = np.full(batch, width, dtype=np.int64)
            self.column_counts = np.full(width, batch, dtype=np.int64)
            self._cells_per_position = np.full(width, self.cells_rows, dtype=np.int64)
        else:
            self.sample_counts = self.valid.sum(axis=1)
            self.column_counts = self.valid.sum(axis=0)
            self._cells_per_position = np.zeros(width, dtype=np.int64)  # cells with an entry, per position
            for rows in _row_blocks(batch, self.micro):
                self._cells_per_position += (self._block_counts(rows) > 0).sum(axis=0)
        self._cells = int(self._cells_per_position.sum())
        self.count = int(self.sample_counts.sum())
        self.positions = np.flatnonzero(self.column_counts)
        self._timesteps = None if timesteps is None else _TimestepGroups(timesteps, self)

    # -- labels ------------------------------------------------------------------------------------
    @property
    def timestep_values(self) -> np.ndarray:
        """The distinct timestep values with an entry, large t first (empty without timesteps)."""
        return np.zeros(0) if self._timesteps is None else self._timesteps.values

    def position_timesteps(self) -> list[float | None]:
        """Per position in `positions`: its timestep value when every entry there has the same one, else None."""
        if self._timesteps is None:
            return [None] * len(self.positions)
        return self._timesteps.position_labels(self.positions)

    def timestep_positions(self) -> list[int | None]:
        """Per value in `timestep_values`: its window position when every entry with it sits there, else None."""
        return [] if self._timesteps is None else self._timesteps.value_positions()

    def timestep_counts(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64) if self._timesteps is None else self._timesteps.counts

    # -- pooling -----------------------------------------------------------------------------------
    def pool(self, how: str, values: np.ndarray | Indicator) -> Pooled:
        """Pool the per-entry table `values` (``(B, W)``, float64) into every view (`POOLS` says how)."""
        return self.pool_all((how,), values)[0]

    def pool_all(self, hows: Sequence[str], values: np.ndarray | Indicator) -> list[Pooled]:
        """`pool` for each of `hows` from one table: the mean and the standard deviation share the cells' means."""
        if not isinstance(values, Indicator):
            values = np.ascontiguousarray(values, dtype=np.float64)
        if values.shape != self.shape:
            raise ValueError(f"a metric's per-entry values have shape {values.shape}, expected {self.shape}.")
        for how in hows:
            if how not in POOLS:
                raise ValueError(f"unknown pool {how!r}; expected one of {', '.join(POOLS)}.")
        if self.count == 0:
            empty = np.zeros(0)
            nan_timesteps = np.full(len(self.timestep_values), math.nan)
            return [Pooled(math.nan, empty, nan_timesteps, np.full(self.shape[0], math.nan)) for _ in hows]
        pooled: dict[str, Pooled] = {}
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # NaN and inf propagate on purpose
            if "mean" in hows or "std" in hows:
                pooled.update(self._pool_cells(values, spread="std" in hows))
            if "max" in hows:
                pooled["max"] = self._pool_max(values.table() if isinstance(values, Indicator) else values)
        return [pooled[how] for how in hows]

    def _pool_cells(self, values: np.ndarray | Indicator, *, spread: bool) -> dict[str, Pooled]:
        """The cells' means (and, with `spread`, their population standard deviations) into the position, overall
        and sample views, one block of whole micro-batches at a time: no table the size of the inputs beyond
        `values`."""
        batch, width = values.shape
        hows = ("mean", "std") if spread else ("mean",)
        positions = {how: np.zeros(width) for how in hows}  # each position's cell values so far, in micro-batch order
        overall = dict.fromkeys(hows, 0.0)  # every cell value so far, added in (micro-batch, position) order from 0.0
        samples = {how: np.empty(batch) for how in hows}
        for rows in _row_blocks(batch, self.micro):
            counts = self._block_counts(rows)
            whole = (rows.stop - rows.start) // self.micro
            sample_counts = self.sample_counts[rows]
            if isinstance(values, Indicator) and not values.any(rows, self.valid):
                block = None  # every entry 0.0: every sum is 0.0
                sums, row_total = np.zeros((counts.shape[0], width)), np.zeros(rows.stop - rows.start)
            else:
                block = _float_block(values, rows)
                if self.valid is not None:
                    block = np.where(self.valid[rows], block, 0.0)
                sums, row_total = cell_sums(block, self.micro, whole), row_sums(block)
            cells = {"mean": self._cell_means(sums, counts)}
            with np.errstate(invalid="ignore", divide="ignore"):
                sample_means = {"mean": row_total / sample_counts}
            if spread:
                if block is None:
                    block = _float_block(values, rows)
                deviation = _minus_cells(block, cells["mean"], self.micro)
                deviation *= deviation
                if self.valid is not None:
                    deviation[~self.valid[rows]] = 0.0
                cells["std"] = np.sqrt(self._cell_means(cell_sums(deviation, self.micro, whole), counts))
                del deviation
                deviation = block - np.where(sample_counts == 0, 0.0, sample_means["mean"])[:, None]
                deviation *= deviation
                if self.valid is not None:
                    deviation[~self.valid[rows]] = 0.0
                with np.errstate(invalid="ignore", divide="ignore"):
                    sample_means["std"] = np.sqrt(row_sums(deviation) / sample_counts)
                del deviation
            del block
            for how in hows:
                samples[how][rows] = sample_means[how] + 0.0  # a view of one cell: (0.0 + value) / 1
                positions[how] = column_sums(np.concatenate([positions[how][None, :], cells[how]]))
                overall[how] = sequential_sum(cells[how].ravel(), start=overall[how])
        pooled = {}
        by_value = None if self._timesteps is None else self._timesteps.pool(values, hows)
        for how in hows:
            with np.errstate(invalid="ignore", divide="ignore"):
                at = (positions[how] / self._cells_per_position)[self.positions]
            if self._timesteps is None:
                timesteps = np.zeros(0)
            else:
                timesteps = at[self._timesteps.order] if by_value is None else by_value[how]
            pooled[how] = Pooled(float(overall[how] / self._cells), at, timesteps, samples[how])
        return pooled

    def _pool_max(self, values: np.ndarray) -> Pooled:
        if self.valid is not None:
            values = np.where(self.valid, values, -np.inf)
        columns = np.max(values, axis=0)  # a max is exact in any order; NaN propagates
        samples = np.max(values, axis=1) if values.shape[1] else np.full(values.shape[0], -np.inf)
        timesteps = None if self._timesteps is None else self._timesteps.pool_max(values, columns)
        return Pooled(
            float(np.max(columns[self.positions])),
            columns[self.positions],
            np.zeros(0) if timesteps is None else timesteps,
            np.where(self.sample_counts > 0, samples, np.nan),
        )

    # -- the arithmetic, in the reference order ------------------------------------------------------
    def _block_counts(self, rows: slice) -> np.ndarray:
        """Entries per cell of a block of whole micro-batches: ``(cells, W)``, or ``(cells, 1)`` when all are full."""
        whole = (rows.stop - rows.start) // self.micro
        if self.valid is None:
            counts = np.full((whole + (whole * self.micro < rows.stop - rows.start), 1), self.micro, dtype=np.int64)
            if whole * self.micro < rows.stop - rows.start:
                counts[-1] = rows.stop - rows.start - whole * self.micro
            return counts
        return _integer_cell_sums(self.valid[rows].astype(np.int32), self.micro, whole)

    def _cell_means(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Each cell's sum over its count, in place (an empty cell: 0.0, it adds nothing and is not counted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            np.divide(sums, counts, out=sums)
        if self.valid is not None:
            sums[np.broadcast_to(counts == 0, sums.shape)] = 0.0
        return sums


class _TimestepGroups:
    """The ``by_timestep`` view: cells (micro-batch, exact timestep value), values large t first.

    When every window position holds one timestep value and no two positions share one (all samples share the
    window), the view is ``by_position`` relabelled, entry for entry. Otherwise (windows drawn per prompt group)
    each block of whole micro-batches sums its cells with ``np.bincount`` — which adds in entry order, as the
    reference does — and the running sums over cells are carried from block to block, in micro-batch order.
    """

    def __init__(self, timesteps: np.ndarray, layout: Layout) -> None:
        self.layout = layout
        valid = layout.valid
        width = layout.shape[1]
        columns = layout.positions
        self.column_value: np.ndarray | None = None
        if len(columns):
            first_row = np.zeros(width, dtype=np.int64) if valid is None else np.argmax(valid, axis=0)
            first = timesteps[first_row, np.arange(width)]
            same = timesteps == first[None, :]
            uniform = bool(same.all() if valid is None else (same | ~valid).all())
            values = first[columns].astype(np.float64)
            if uniform and np.unique(values).size == values.size:
                self.column_value = values
        if self.column_value is not None:
            self.order = np.argsort(-self.column_value, kind="stable")
            self.values = self.column_value[self.order]
            self.counts = layout.column_counts[columns][self.order]
            return
        self.keys, self.key_of = key_table(timesteps, valid)  # not compared: key_of == len(keys)
        size = self.keys.size
        present = np.bincount(
            (self.key_of.astype(np.int64) * width + np.arange(width)).ravel(), minlength=(size + 1) * width
        ).reshape(size + 1, width)[:size]
        self._present = present > 0  # (key, position): does an entry with that key sit there
        self.order = np.argsort(-self.keys, kind="stable")
        self.values = self.keys[self.order]
        self.counts = present.sum(axis=1)[self.order]

    def position_labels(self, positions: np.ndarray) -> list[float | None]:
        if self.column_value is not None:
            return [float(v) for v in self.column_value]
        labels: list[float | None] = []
        for position in positions:
            seen = np.flatnonzero(self._present[:, position])
            labels.append(float(self.keys[seen[0]]) if seen.size == 1 else None)
        return labels

    def value_positions(self) -> list[int | None]:
        if self.column_value is not None:
            return [int(p) for p in self.layout.positions[self.order]]
        labels: list[int | None] = []
        for key in self.order:
            where = np.flatnonzero(self._present[key])
            labels.append(int(where[0]) if where.size == 1 else None)
        return labels

    def pool(self, values: np.ndarray | Indicator, hows: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The mean (and std) pools of `values` per timestep value, from one sweep (None: `by_position` relabelled)."""
        if self.column_value is not None:
            return None
        layout, size = self.layout, self.keys.size
        totals = {how: np.zeros(size) for how in hows}  # each key's cell values so far, in micro-batch order from 0.0
        cells = np.zeros(size, dtype=np.int64)
        for rows in _row_blocks(layout.shape[0], layout.micro):
            micro = (np.arange(rows.start, rows.stop) - rows.start) // layout.micro
            keys = self.key_of[rows].astype(np.intp)
            ids = np.where(keys < size, micro[:, None] * size + keys, micro[-1] * size + size).ravel()
            block = _float_block(values, rows).ravel()
            counts = np.bincount(ids, minlength=(micro[-1] + 1) * size + 1)
            means = {"mean": _bincount_means(ids, block, counts)}
            if "std" in hows:
                deviation = block - means["mean"][ids]
                deviation *= deviation
                means["std"] = np.sqrt(_bincount_means(ids, deviation, counts))
            for how in hows:
                shaped = means[how][:-1].reshape(-1, size)
                totals[how] = column_sums(np.concatenate([totals[how][None, :], shaped]))
            cells += (counts[:-1].reshape(-1, size) > 0).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return {how: (totals[how] / cells)[self.order] for how in hows}

    def pool_max(self, values: np.ndarray, columns: np.ndarray) -> np.ndarray:
        if self.column_value is not None:
            return columns[self.layout.positions][self.order]
        maxima = np.full(self.keys.size + 1, -np.inf)
        np.maximum.at(maxima, self.key_of.ravel().astype(np.intp), values.ravel())  # a max: any order
        return maxima[:-1][self.order]


def _float_block(values: np.ndarray | Indicator, rows: slice) -> np.ndarray:
    """Rows `rows` of a metric's values as a float64 table."""
    return values.table(rows) if isinstance(values, Indicator) else values[rows]


def _bincount_means(ids: np.ndarray, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per id: its values added in entry order from 0.0, over its count (0.0 for an id without entries; the last
    id collects the entries not compared)."""
    sums = np.bincount(ids, weights=values, minlength=counts.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        sums /= counts
    sums[counts == 0] = 0.0
    sums[-1] = 0.0
    return sums


def key_table(values: np.ndarray, valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values among the compared entries (sorted), and each entry's index into them (the number of
    values where an entry is not compared), in the smallest integer type that holds it."""
    keys = np.unique(values if valid is None else values[valid])  # NaN, if any, is one key, the last
    index = np.empty(values.shape, dtype=np.int16 if keys.size < np.iinfo(np.int16).max else np.int64)
    for rows in _row_blocks(values.shape[0], 1):
        index[rows] = np.searchsorted(keys, values[rows])  # exact: every compared value is a key
    if valid is not None:
        index[~valid] = keys.size
    return keys.astype(np.float64), index


# ----------------------------------------------------------------------------------------------------
def column_sums(table: np.ndarray) -> np.ndarray:
    """Sums down each column, rows added one at a time from 0.0.

    NumPy reduces a non-contiguous axis row by row (pairwise summation only runs along the contiguous axis), so
    a C-contiguous table of two columns or more is reduced directly; one column is accumulated.
    """
    table = np.ascontiguousarray(table)
    if table.shape[0] == 0:
        return np.zeros(table.shape[1:])
    if table.ndim == 2 and table.shape[1] >= 2:
        return np.add.reduce(table, axis=0) + 0.0
    return np.add.accumulate(table, axis=0)[-1] + 0.0


def cell_sums(values: np.ndarray, micro: int, full_micro: int) -> np.ndarray:
    """``(micro-batches, W)`` sums of each micro-batch's rows, added in row order from 0.0."""
    batch, width = values.shape
    full = full_micro * micro
    sums = np.empty((full_micro + (full < batch), width))
    if full_micro:
        shaped = values[:full].reshape(full_micro, micro, width)
        if width >= 2:
            np.add.reduce(shaped, axis=1, out=sums[:full_micro])  # row by row: the reduced axis is not contiguous
        else:
            sums[:full_micro] = np.add.accumulate(shaped, axis=1)[:, -1, :]
    if full < batch:
        sums[-1] = column_sums(values[full:])
    sums += 0.0  # the reference starts from 0.0: a sum of -0.0 entries is +0.0
    return sums


def _integer_cell_sums(ones: np.ndarray, micro: int, full_micro: int) -> np.ndarray:
    batch, width = ones.shape
    full = full_micro * micro
    parts = [ones[:full].reshape(full_micro, micro, width).sum(axis=1)] if full_micro else []
    if full < batch:
        parts.append(ones[full:].sum(axis=0, keepdims=True))
    return np.concatenate(parts) if parts else np.zeros((0, width), dtype=np.int64)


def _minus_cells(block: np.ndarray, cells: np.ndarray, micro: int) -> np.ndarray:
    """Each entry of a block of whole micro-batches (the last may be shorter) minus its cell's value."""
    rows, width = block.shape
    whole = rows // micro
    out = np.empty_like(block)
    if whole:
        shape = (whole, micro, width)
        np.subtract(
            block[: whole * micro].reshape(shape), cells[:whole, None, :], out=out[: whole * micro].reshape(shape)
        )
    if whole * micro < rows:
        np.subtract(block[whole * micro :], cells[whole], out=out[whole * micro :])
    return out


def _row_blocks(rows: int, unit: int) -> list[slice]:
    """Consecutive runs of whole `unit`s of rows (the last may be shorter), about `_ROW_BLOCK` rows each."""
    step = unit * max(1, _ROW_BLOCK // unit)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def row_sums(values: np.ndarray) -> np.ndarray:
    """Each row's entries added in column order from 0.0 (column by column over blocks of rows)."""
    batch, width = values.shape
    out = np.zeros(batch)
    for start in range(0, batch, _ROW_BLOCK):
        block = values[start : start + _ROW_BLOCK]
        acc = out[start : start + _ROW_BLOCK]
        for column in range(width):
            np.add(acc, block[:, column], out=acc)
    return out


def sequential_sum(values: np.ndarray, start: float = 0.0) -> float:
    """``values`` added one at a time to `start` (in blocks, each carrying the running total)."""
    total = start
    for first in range(0, values.size, _FLAT_BLOCK):
        block = np.concatenate(([total], values[first : first + _FLAT_BLOCK]))
        total = float(np.add.accumulate(block)[-1])
    return total


def host_array(value: Any, name: str, error: type[ValueError]) -> np.ndarray:
    """`value` as a NumPy array, not copied where it need not be: a torch tensor through
    ``.detach().cpu().numpy()`` (without importing torch), anything else through ``np.asarray``.

    Raises:
        error: a bfloat16/float16 tensor (`name` says which argument): it has already lost the digits compared
            here, and widening it back would hide that.
    """
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            raise error(
                f"{name} is a {value.dtype} tensor: it has already lost the digits compared here; pass float32 "
                f"(cast the model output to float32 before the scheduler's log-prob, and never cast log-probs down)."
            )
        value = value.numpy()
    return np.asarray(value)


def flag_table(value: Any, shape: tuple[int, ...], name: str, error: type[ValueError]) -> np.ndarray:
    """`value` (which entries to use: a torch tensor or array of `shape`, bool or 0/1) as a bool NumPy array (a
    copy). Raises `error` on another shape or other values."""
    array = host_array(value, name, error)
    if array.shape != shape:
        raise error(f"{name} has shape {array.shape}, expected {shape} (one flag per entry).")
    if array.dtype != bool and not np.isin(array, (0, 1)).all():
        raise error(f"{name} must hold booleans (or 0/1).")
    return array.astype(bool)


def float_table(value: Any, name: str, error: type[ValueError]) -> np.ndarray:
    """`value` (a user's ``(N, T)`` log-prob or timestep table: torch tensor or array) as a 2-D float32/float64
    NumPy array, not copied where it need not be.

    Raises:
        error: `value` is None, not 2-D, or not float32/float64 (a bf16/fp16 table has already lost the digits
            compared here); the message names `name` and the fix.
    """
    if value is None:
        raise error(f"{name} is missing; pass an (N, T) float32 table.")
    array = host_array(value, name, error)
    if array.ndim != 2:
        raise error(f"{name} must be 2-D (samples, steps), got shape {array.shape}; reshape it to (N, T).")
    if array.dtype not in (np.float32, np.float64):
        raise error(
            f"{name} has dtype {array.dtype}; pass float32 (or float64): bf16/fp16 log-probs have already lost the "
            f"digits compared here."
        )
    return array
