# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Step-1 consistency metrics: rollout log-probs against the trainer's recomputation of them.

Each metric is one `Metric` entry of the `METRICS` registry: its per-entry values, how cells pool them, how
profiles limit it (its scale), how reports show it. The built-in definitions are the ones GRPO trainers log (verl
conventions; Flow-GRPO's approx_kl), with ``Δlogp = logp_trainer − logp_rollout``:

==================== ==============================================================
``ratio_mean``       mean of ``ratio = exp(Δlogp)``
``ratio_std``        population standard deviation (ddof 0) of ``ratio``
``ppo_kl``           mean of ``−Δlogp`` (= logp_rollout − logp_trainer)
``pg_clipfrac``      fraction with ``ratio > 1 + ε_high`` or ``ratio < 1 − ε_low``
``pg_clipfrac_higher`` fraction with ``ratio − 1 > ε_high``
``pg_clipfrac_lower``  fraction with ``1 − ratio > ε_low``
``approx_kl``        ``½ · mean(Δlogp²)`` (Flow-GRPO)
``mean_abs_dlogp``   mean of ``|Δlogp|``
``max_abs_dlogp``    max of ``|Δlogp|``
==================== ==============================================================

Aggregation — how the numbers match a trainer's logs
----------------------------------------------------
A trainer computes each metric on one *cell*: the samples of one micro-batch at one window step (its
inner loop runs over timesteps and micro-batches), appends the cell's value to a list, and logs the
unweighted mean of that list. This module does the same: samples are cut, in their global order, into
micro-batches of ``micro_batch_size`` (the last one may be shorter; ``None`` = the whole batch in one
micro-batch); every ``(micro-batch, window position)`` cell with at least one valid entry gives one value
per metric (``ratio_std`` is the standard deviation inside the cell); a figure is the unweighted mean of
its cells. ``max_abs_dlogp`` is the maximum over entries, not a mean of maxima.

Data parallelism: a trainer on R ranks that splits the batch into equal contiguous shards and micro-batches
of the same size within each rank, then averages over ranks, computes exactly these figures when every
rank holds the same number of micro-batches. The figures depend only on the global sample order, never on
how the samples were distributed to compute them.

Views: ``overall`` (all cells); ``by_position`` (window position ``j``, cells ``(micro-batch, j)``);
``by_timestep`` (exact timestep value, cells ``(micro-batch, timestep)``; equals ``by_position`` when all
samples share one window); ``by_sample`` (plain statistics over one sample's steps, ``ratio_std`` across
those steps).

Computation: one float64 working table, ``Δlogp``, for the whole batch; each metric's values are computed on it
at once and pooled into every view by `rollout_consistency.gate.judging.views` (no Python loop over entries or
cells), adding in the order the loop above adds — the figures are that loop's, bit for bit.

Guarantees:
    * Inputs must be float32 (or float64); their difference is taken in float64, so ``Δlogp`` is exact and
      nothing is rounded to float32 again.
    * Non-finite log-probs are never averaged away: they are listed in ``nonfinite`` and they propagate
      (NaN or ±inf) into every figure they enter — a clip indicator of a NaN ratio is NaN, not 0.
    * Steps present on one side only are listed in ``missing`` and left out of the figures; a sample with
      no step at all is listed in ``empty_samples``. The verdict fails on all three.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np

from rollout_consistency.base.registry import Registry, markdown_table

from .views import POOLS, Entries, Indicator, Layout, Pooled, flag_table, float_table

Side = Literal["rollout", "trainer"]

#: How a profile limits a metric (`rollout_consistency.gate.judging.tolerances`): a signed ``bias`` gated by its
#: distance from agreement, a ``spread`` (mean-type size of the differences), its ``rms`` form (quadratic), the
#: ``max`` of one entry, or a ``fraction`` of entries (reported, not gated, by the tolerant profiles).
SCALES: tuple[str, ...] = ("bias", "spread", "rms", "max", "fraction")


class MetricsInputError(ValueError):
    """The two log-prob tables cannot be compared (shape, dtype or mask mismatch)."""


@dataclass(frozen=True)
class Metric:
    """One gated figure: what it computes, how profiles limit it, how reports show it.

    Attributes:
        name: its key in reports (JSON ``metrics``, JUnit testcase name, table row) and in ``thresholds``.
        definition: one line for the docs table (docs/checker.md is held to it by a test).
        values: the per-entry quantity, from [`Entries`] (``delta``, ``ratio``, the clip ranges): an elementwise
            function of each entry alone, as a float64 table or an [`Indicator`] (``entries.flagged(condition)``);
            `pool` turns it into a figure per view. Consecutive metrics with the same function share one table.
        pool: ``"mean"`` (the mean over cells of each cell's mean, as trainers log it), ``"std"`` (the mean over
            cells of each cell's population standard deviation) or ``"max"`` (over entries).
        scale: how profiles set its limit (`SCALES`).
        agreement: the value at perfect agreement when the limit bounds ``|value − agreement|`` (``ratio_mean``:
            1, ``ppo_kl``: 0); None when the limit bounds the value itself.
        column: the terminal table's column header (default: `name`).
        table_format, message_format: format specs of a finite value in the table and in a FAIL's reason.
        aliases: what other trainers call it (a threshold under such a name is refused naming this one).
    """

    name: str
    definition: str
    values: Callable[[Entries], np.ndarray | Indicator]
    pool: str = "mean"
    scale: str = "spread"
    agreement: float | None = None
    column: str = ""
    table_format: str = ".3e"
    message_format: str = ".3g"
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"metric name {self.name!r} must be an identifier (it is a JSON key and a flag value).")
        if self.pool not in POOLS:
            raise ValueError(f"metric {self.name!r}: pool {self.pool!r}, expected one of {', '.join(POOLS)}.")
        if self.scale not in SCALES:
            raise ValueError(f"metric {self.name!r}: scale {self.scale!r}, expected one of {', '.join(SCALES)}.")
        if not self.column:
            object.__setattr__(self, "column", self.name)

    def deviation(self, value: float) -> float:
        """Distance of `value` from perfect agreement (NaN stays NaN)."""
        return value if self.agreement is None else abs(value - self.agreement)

    def format(self, value: float | None, spec: str | None = None) -> str:
        """`value` as the table shows it (``spec``: another format for finite values)."""
        if value is None:
            return "-"
        if math.isnan(value):
            return "nan"
        # Fixed-point formats only below a million: a ratio of exp(500) would print 200 digits.
        if math.isfinite(value) and abs(value) < 1e6 and (spec or self.table_format) != ".3e":
            return f"{value:{spec or self.table_format}}"
        return f"{value:.3e}" if value != 0 else "0"

    def limit_text(self, limit: float | None) -> str:
        """``<= 1e-4``, ``|x| <= 1e-4`` or ``|x-1| <= 1e-4`` (``(not gated)`` without a limit)."""
        if limit is None:
            return "(not gated)"
        if self.agreement is None:
            return f"<= {limit:.3g}"
        return f"|x{'' if self.agreement == 0 else f'-{self.agreement:g}'}| <= {limit:.3g}"

    def deviation_text(self, deviation: float) -> str:
        """``|ratio_mean - 1| = 2.5e-05`` (metrics gated by their distance from agreement)."""
        offset = "" if not self.agreement else f" - {self.agreement:g}"
        return f"|{self.name}{offset}| = {deviation:.3g}"


#: The gated figures, in report order. A new metric is one `Metric` and one `METRICS.register` call: the
#: computation, every profile's limit, the verdict, the table, JSON, JUnit and the docs table follow.
METRICS: Registry[Metric] = Registry("metric")


def _ratio(entries: Entries) -> np.ndarray:
    return entries.ratio


def _abs_delta(entries: Entries) -> np.ndarray:
    return np.abs(entries.delta)


def _half_square(delta: np.ndarray) -> np.ndarray:
    out = np.multiply(0.5, delta)  # (0.5·Δ)·Δ, in one scratch table
    out *= delta
    return out


for _metric in (
    Metric(
        "ratio_mean",
        "mean of `ratio = exp(Δlogp)`",
        _ratio,
        scale="bias",
        agreement=1.0,
        table_format=".9f",
        message_format=".9f",
    ),
    Metric("ratio_std", "population standard deviation (ddof 0) of `ratio`", _ratio, pool="std"),
    Metric(
        "ppo_kl",
        "mean of `−Δlogp` (verl's `ppo_kl = mean(old_logp − logp)`)",
        lambda e: -e.delta,
        scale="bias",
        agreement=0.0,
        aliases=("kl",),
    ),
    Metric(
        "pg_clipfrac",
        "fraction with `ratio − 1 > ε_high` or `1 − ratio > ε_low`",
        lambda e: e.flagged(e.clipped_higher | e.clipped_lower),
        scale="fraction",
        column="clipfrac",
        table_format=".4f",
        aliases=("clipfrac",),
    ),
    Metric(
        "pg_clipfrac_higher",
        "fraction with `ratio − 1 > ε_high`",
        lambda e: e.flagged(e.clipped_higher),
        scale="fraction",
        column="clip_hi",
        table_format=".4f",
        aliases=("clipfrac_gt_one", "clipfrac_higher"),
    ),
    Metric(
        "pg_clipfrac_lower",
        "fraction with `1 − ratio > ε_low`",
        lambda e: e.flagged(e.clipped_lower),
        scale="fraction",
        column="clip_lo",
        table_format=".4f",
        aliases=("clipfrac_lt_one", "clipfrac_lower"),
    ),
    Metric("approx_kl", "`½ · mean(Δlogp²)` (Flow-GRPO)", lambda e: _half_square(e.delta), scale="rms"),
    Metric("mean_abs_dlogp", "mean of `|Δlogp|`", _abs_delta, column="mean|dlogp|"),
    Metric("max_abs_dlogp", "max of `|Δlogp|`", _abs_delta, pool="max", scale="max", column="max|dlogp|"),
):
    METRICS.register(_metric)

#: The built-in metrics' names (`METRICS` lists every registered one).
METRIC_NAMES: tuple[str, ...] = METRICS.names()


def metrics_table() -> str:
    """The docs' table of the registered metrics (docs/checker.md holds exactly this; a test checks it)."""
    return markdown_table(("metric", "definition"), [(f"`{m.name}`", m.definition) for m in METRICS.values()])


def get_metric(name: str) -> Metric:
    """The registered metric called `name` (KeyError naming the known ones)."""
    return METRICS[name]


# ----------------------------------------------------------------------------------------------------
class MetricValues:
    """The figures of one view by metric name (``values.ratio_mean``, ``values.get("ratio_mean")``), plus the number
    of ``(sample, step)`` entries they summarise. A view with no entries has every figure NaN and ``count == 0``.

    Built as ``MetricValues(ratio_mean=1.0, ..., count=8)`` or ``MetricValues({"ratio_mean": 1.0, ...}, count=8)``.
    """

    __slots__ = ("_figures", "count")
    _figures: dict[str, float]
    count: int

    def __init__(self, figures: Mapping[str, float] | None = None, /, *, count: int = 0, **named: float) -> None:
        object.__setattr__(self, "_figures", {**(figures or {}), **named})
        object.__setattr__(self, "count", int(count))

    @classmethod
    def _of(cls, figures: dict[str, float], count: int) -> MetricValues:
        """Without copying `figures` (a dict made for this object alone)."""
        values = object.__new__(cls)
        object.__setattr__(values, "_figures", figures)
        object.__setattr__(values, "count", count)
        return values

    def __getattr__(self, name: str) -> float:
        figures = object.__getattribute__(self, "_figures")
        if name in figures:
            return figures[name]
        if name in METRICS and not name.startswith("_"):
            return math.nan  # registered after these figures were computed
        raise AttributeError(f"MetricValues has no figure {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MetricValues is frozen")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MetricValues):
            return NotImplemented
        return self.count == other.count and self._figures == other._figures

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._figures.items())
        return f"MetricValues({shown}, count={self.count})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_values, (self._figures, self.count))

    def names(self) -> tuple[str, ...]:
        return tuple(self._figures)

    def get(self, metric: str) -> float:
        if metric in self._figures:
            return self._figures[metric]
        if metric in METRICS:
            return math.nan
        raise KeyError(f"Unknown metric {metric!r}; expected one of {', '.join(METRICS)}.")

    def is_finite(self) -> bool:
        return all(math.isfinite(v) for v in self._figures.values())

    def to_dict(self) -> dict[str, Any]:
        return {**self._figures, "count": self.count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricValues:
        return cls({k: float(v) for k, v in data.items() if k != "count"}, count=int(data["count"]))


def _restore_values(figures: dict[str, float], count: int) -> MetricValues:
    return MetricValues(figures, count=count)


def empty_values(names: Sequence[str] | None = None) -> MetricValues:
    """NaN figures and count 0: a view with no entries."""
    return MetricValues({name: math.nan for name in (METRICS.names() if names is None else names)}, count=0)


@dataclass(frozen=True)
class StepMetrics:
    """Figures of one window position (``by_position``) or one exact timestep value (``by_timestep``).

    ``position`` is ``None`` in ``by_timestep`` entries when samples reach that timestep at different
    window positions; ``timestep`` is ``None`` in ``by_position`` entries when the position holds several
    timestep values (or no timesteps were given).
    """

    position: int | None
    timestep: float | None
    values: MetricValues

    def label(self) -> str:
        parts = []
        if self.position is not None:
            parts.append(f"step {self.position}")
        if self.timestep is not None:
            parts.append(f"t={self.timestep:.6g}")
        return " ".join(parts) if parts else "?"


@dataclass(frozen=True)
class SampleMetrics:
    """Figures of one sample over its own window steps."""

    index: int
    values: MetricValues


#: Samples turned into Python floats at a time while iterating `by_sample`.
_ROWS_AT_ONCE = 4096


class PerSample(Sequence[SampleMetrics]):
    """``by_sample``: one `SampleMetrics` per sample, built when read (a table of a million samples costs one
    array, not a million objects).

    Code that reads every sample should read whole columns instead: `figure` (one metric of every sample, an
    array) and `counts` (each sample's number of compared steps; 0 for a sample without any, whose figures are
    NaN) — a loop over a million samples in Python costs seconds, a column a millisecond.
    """

    def __init__(self, names: Sequence[str], figures: np.ndarray, counts: np.ndarray) -> None:
        self._names = tuple(names)
        self._columns = {name: column for column, name in enumerate(self._names)}
        self._figures = figures  # (metrics, samples) float64: one contiguous column per metric
        self._counts = counts

    @classmethod
    def of(cls, items: Sequence[SampleMetrics]) -> PerSample:
        names = items[0].values.names() if items else METRICS.names()
        figures = np.array([[s.values.get(n) for n in names] for s in items], dtype=np.float64).reshape(-1, len(names))
        if any(s.index != i for i, s in enumerate(items)):
            raise ValueError("by_sample must list samples 0..N-1 in order.")
        return cls(names, figures.T.copy(), np.array([s.values.count for s in items], dtype=np.int64))

    @property
    def names(self) -> tuple[str, ...]:
        """The metrics every sample has a figure of (`figure` takes these)."""
        return self._names

    def figure(self, metric: str) -> np.ndarray:
        """`metric` of every sample, `(samples,)` float64 (NaN for a sample without entries)."""
        if metric not in self._columns:
            raise KeyError(f"no per-sample figure {metric!r}; the samples have {', '.join(self._names)}.")
        return self._figures[self._columns[metric]].copy()

    @property
    def counts(self) -> np.ndarray:
        """Each sample's number of compared steps, `(samples,)` int64."""
        return self._counts.copy()

    def __len__(self) -> int:
        return len(self._counts)

    @overload
    def __getitem__(self, index: int) -> SampleMetrics: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[SampleMetrics, ...]: ...
    def __getitem__(self, index: int | slice) -> SampleMetrics | tuple[SampleMetrics, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = range(len(self))[index]
        figures = dict(zip(self._names, self._figures[:, i].tolist(), strict=True))
        return SampleMetrics(i, MetricValues._of(figures, int(self._counts[i])))

    def __iter__(self) -> Iterator[SampleMetrics]:
        # Each sample's figures stay in the table until one is read (`_RowValues`): a loop that reads one figure
        # of every sample turns that one column into Python floats, a block of samples at a time.
        for start in range(0, len(self), _ROWS_AT_ONCE):
            block = _SampleBlock(self._names, self._columns, self._figures[:, start : start + _ROWS_AT_ONCE])
            counts = self._counts[start : start + _ROWS_AT_ONCE].tolist()
            for offset, count in enumerate(counts):
                yield SampleMetrics(start + offset, _RowValues._of_row(block, offset, count))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PerSample({len(self)} samples)"

    def to_list(self) -> list[dict[str, Any]]:
        names = self._names
        return [
            {"index": i, "values": {**dict(zip(names, row, strict=True)), "count": count}}
            for i, (row, count) in enumerate(zip(self._figures.T.tolist(), self._counts.tolist(), strict=True))
        ]


class _SampleBlock:
    """A block of samples' figures, each metric's column turned into Python floats when first read."""

    __slots__ = ("_lists", "columns", "figures", "names")

    def __init__(self, names: tuple[str, ...], columns: dict[str, int], figures: np.ndarray) -> None:
        self.names = names
        self.columns = columns
        self.figures = figures  # (metrics, samples of the block)
        self._lists: dict[int, list[float]] = {}

    def column(self, index: int) -> list[float]:
        found = self._lists.get(index)
        if found is None:
            found = self._lists[index] = self.figures[index].tolist()
        return found


class _RowValues(MetricValues):
    """One sample's `MetricValues`, reading its block's columns until a method needs the mapping."""

    __slots__ = ("_block", "_offset")

    @classmethod
    def _of_row(cls, block: _SampleBlock, offset: int, count: int) -> _RowValues:
        values = object.__new__(cls)
        object.__setattr__(values, "_block", block)
        object.__setattr__(values, "_offset", offset)
        object.__setattr__(values, "count", count)
        return values

    def __getattr__(self, name: str) -> Any:
        block = object.__getattribute__(self, "_block")
        if name == "_figures":  # the mapping, built on first use
            offset = self._offset
            figures = {name: block.column(index)[offset] for name, index in block.columns.items()}
            object.__setattr__(self, "_figures", figures)
            return figures
        index = block.columns.get(name)
        if index is not None:
            return block.column(index)[self._offset]
        return super().__getattr__(name)


@dataclass(frozen=True)
class NonFiniteEntry:
    """A log-prob that is NaN or ±inf. ``value`` is ``"nan"``, ``"inf"`` or ``"-inf"``."""

    sample: int
    position: int
    side: Side
    value: str


@dataclass(frozen=True)
class MissingStep:
    """A window step that one side has and the other lacks."""

    sample: int
    position: int
    missing_on: Side


@dataclass(frozen=True)
class ConsistencyMetrics:
    """Everything [`compute_metrics`] measured. See the module docstring for the aggregation."""

    overall: MetricValues
    by_position: tuple[StepMetrics, ...]
    by_timestep: tuple[StepMetrics, ...]
    by_sample: Sequence[SampleMetrics]
    nonfinite: tuple[NonFiniteEntry, ...]
    missing: tuple[MissingStep, ...]
    empty_samples: tuple[int, ...]
    num_samples: int
    num_positions: int
    micro_batch_size: int | None
    clip_ratio_low: float
    clip_ratio_high: float

    def to_dict(self) -> dict[str, Any]:
        def step(s: StepMetrics) -> dict[str, Any]:
            return {"position": s.position, "timestep": s.timestep, "values": s.values.to_dict()}

        by_sample = self.by_sample
        return {
            "overall": self.overall.to_dict(),
            "by_position": [step(s) for s in self.by_position],
            "by_timestep": [step(s) for s in self.by_timestep],
            "by_sample": by_sample.to_list()
            if isinstance(by_sample, PerSample)
            else [{"index": s.index, "values": s.values.to_dict()} for s in by_sample],
            "nonfinite": [vars(e).copy() for e in self.nonfinite],
            "missing": [vars(m).copy() for m in self.missing],
            "empty_samples": list(self.empty_samples),
            "num_samples": self.num_samples,
            "num_positions": self.num_positions,
            "micro_batch_size": self.micro_batch_size,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConsistencyMetrics:
        def step(d: dict[str, Any]) -> StepMetrics:
            ts = d["timestep"]
            return StepMetrics(d["position"], None if ts is None else float(ts), MetricValues.from_dict(d["values"]))

        samples = [SampleMetrics(d["index"], MetricValues.from_dict(d["values"])) for d in data["by_sample"]]
        return cls(
            overall=MetricValues.from_dict(data["overall"]),
            by_position=tuple(step(d) for d in data["by_position"]),
            by_timestep=tuple(step(d) for d in data["by_timestep"]),
            by_sample=PerSample.of(samples),
            nonfinite=tuple(NonFiniteEntry(**d) for d in data["nonfinite"]),
            missing=tuple(MissingStep(**d) for d in data["missing"]),
            empty_samples=tuple(data["empty_samples"]),
            num_samples=data["num_samples"],
            num_positions=data["num_positions"],
            micro_batch_size=data["micro_batch_size"],
            clip_ratio_low=float(data["clip_ratio_low"]),
            clip_ratio_high=float(data["clip_ratio_high"]),
        )


# ----------------------------------------------------------------------------------------------------
def compute_metrics(
    rollout_log_probs: Any,
    trainer_log_probs: Any,
    *,
    clip_ratio: float = 1e-4,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    micro_batch_size: int | None = None,
    masks: tuple[Any, Any] | None = None,
    timesteps: Any = None,
) -> ConsistencyMetrics:
    """Compare rollout and trainer log-probs of the same window steps: every registered metric, every view.

    Args:
        rollout_log_probs (`torch.Tensor` or `np.ndarray` of shape `(B, W)`, float32):
            Log-prob of each window step as the rollout stored it (``old_log_prob``).
        trainer_log_probs (`torch.Tensor` or `np.ndarray` of shape `(B, W)`, float32):
            The trainer's recomputation of the same steps (``log_prob``).
        clip_ratio (`float`): PPO clip range ε (``clip_ratio`` / Flow-GRPO ``clip_range``).
        clip_ratio_low, clip_ratio_high (`float`, *optional*): asymmetric ranges (verl
            ``clip_ratio_low``/``clip_ratio_high``); each defaults to ``clip_ratio``.
        micro_batch_size (`int`, *optional*): the trainer's micro-batch size; ``None`` = one micro-batch.
        masks (`(rollout_mask, trainer_mask)`, each `(B, W)` bool or None, *optional*): which steps each side
            has (default: all). A sample with a shorter window pads its row and clears the mask there.
        timesteps (`(B, W)` float, *optional*): exact timestep value of each step, for ``by_timestep``.

    Raises:
        MetricsInputError: shapes differ, a table is not 2-D, or a dtype is not float32/float64 (a bf16
            log-prob has already lost the digits this comparison is about).
    """
    rollout = _log_prob_table(rollout_log_probs, "rollout_log_probs")
    trainer = _log_prob_table(trainer_log_probs, "trainer_log_probs")
    if rollout.shape != trainer.shape:
        raise MetricsInputError(
            f"rollout log-probs have shape {rollout.shape} but the trainer's have {trainer.shape}: both sides "
            f"must score the same (samples, window steps); check the SDE window and batch on each side."
        )
    shape = rollout.shape
    rollout_mask, trainer_mask = (None, None) if masks is None else masks
    r_mask = _as_mask(rollout_mask, shape, "rollout_mask")
    t_mask = _as_mask(trainer_mask, shape, "trainer_mask")
    steps = None if timesteps is None else _log_prob_table(timesteps, "timesteps", expect=shape)
    low, high = clip_ranges(clip_ratio, clip_ratio_low, clip_ratio_high, MetricsInputError)
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise MetricsInputError(f"micro_batch_size must be a positive int or None, got {micro_batch_size!r}.")

    batch, width = shape
    if micro_batch_size is not None:
        micro_batch_size = min(micro_batch_size, max(batch, 1))  # a micro-batch wider than the batch is the batch
    missing = _missing(r_mask, t_mask)
    valid = None if r_mask is None and t_mask is None else _both(r_mask, t_mask, shape)
    nonfinite = _nonfinite(rollout, trainer, valid)
    rows_with_entry = np.ones(batch, dtype=bool) if valid is None else valid.any(axis=1)
    empty_samples = tuple(int(b) for b in np.flatnonzero(~rows_with_entry)) if width else tuple(range(batch))

    # The one float64 working table: Δlogp, exact for float32 inputs; 0 where an entry is not compared.
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN on purpose: flagged above, propagated
        delta = np.subtract(trainer, rollout, dtype=np.float64)
    if valid is not None:
        delta[~valid] = 0.0
    layout = Layout(valid, shape, batch if micro_batch_size is None else micro_batch_size, steps)
    entries = Entries(delta, low, high)
    metrics = METRICS.values()
    pooled = _pool_metrics(layout, metrics, entries)
    del entries, delta  # release the working table before the result objects are built
    return ConsistencyMetrics(
        overall=_values(metrics, pooled, "overall", None, layout.count),
        by_position=_steps(metrics, pooled, layout, by="positions"),
        by_timestep=_steps(metrics, pooled, layout, by="timesteps"),
        by_sample=PerSample(
            [m.name for m in metrics],
            np.stack([p.samples for p in pooled]) if pooled else np.zeros((0, batch)),
            layout.sample_counts,
        ),
        nonfinite=nonfinite,
        missing=missing,
        empty_samples=empty_samples,
        num_samples=batch,
        num_positions=width,
        micro_batch_size=micro_batch_size,
        clip_ratio_low=low,
        clip_ratio_high=high,
    )


def _pool_metrics(layout: Layout, metrics: Sequence[Metric], entries: Entries) -> list[Pooled]:
    """Every metric pooled, in order; consecutive metrics with the same ``values`` function (``ratio_mean`` and
    ``ratio_std``, ``mean_abs_dlogp`` and ``max_abs_dlogp``) are pooled from one table."""
    groups: list[list[Metric]] = []
    for metric in metrics:
        if groups and groups[-1][0].values is metric.values:
            groups[-1].append(metric)
        else:
            groups.append([metric])
    pooled: list[Pooled] = []
    for group in groups:
        with np.errstate(over="ignore", invalid="ignore"):
            values = group[0].values(entries)
        entries.settle()
        pooled += layout.pool_all([m.pool for m in group], values)
        del values
    return pooled


def _values(
    metrics: Sequence[Metric], pooled: Sequence[Pooled], view: str, index: int | None, count: int
) -> MetricValues:
    if count == 0:
        return empty_values([m.name for m in metrics])
    figures = {}
    for metric, result in zip(metrics, pooled, strict=True):
        value = result.overall if index is None else getattr(result, view)[index]
        figures[metric.name] = float(value)
    return MetricValues(figures, count=count)


def _steps(metrics: Sequence[Metric], pooled: Sequence[Pooled], layout: Layout, *, by: str) -> tuple[StepMetrics, ...]:
    if by == "positions":
        labels = zip(
            layout.positions.tolist(),
            layout.position_timesteps(),
            layout.column_counts[layout.positions].tolist(),
            strict=True,
        )
    else:
        labels = zip(
            layout.timestep_positions(), layout.timestep_values.tolist(), layout.timestep_counts().tolist(), strict=True
        )
    return tuple(
        StepMetrics(position, timestep, _values(metrics, pooled, by, i, count))
        for i, (position, timestep, count) in enumerate(labels)
    )


# ----------------------------------------------------------------------------------------------------
def clip_ranges(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None, error: type[ValueError]
) -> tuple[float, float]:
    """The PPO clip ranges ``(ε_low, ε_high)`` as floats: each `clip_ratio` unless given on its own (verl's
    ``clip_ratio_low`` / ``clip_ratio_high``). Raises `error` when one is not a finite number >= 0."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise error(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(low), float(high)


def _log_prob_table(value: Any, name: str, expect: tuple[int, ...] | None = None) -> np.ndarray:
    """`value` as a 2-D float32/float64 NumPy array (not copied, not widened: the working table widens Δ only)."""
    array = float_table(value, f"`{name}`", MetricsInputError)
    if expect is not None and array.shape != expect:
        raise MetricsInputError(f"`{name}` has shape {array.shape}, expected {expect}.")
    return array


def _as_mask(value: Any, shape: tuple[int, ...], name: str) -> np.ndarray | None:
    if value is None:
        return None
    return flag_table(value, shape, f"`{name}`", MetricsInputError)


def _both(r_mask: np.ndarray | None, t_mask: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if r_mask is None:
        return t_mask if t_mask is not None else np.ones(shape, dtype=bool)
    return r_mask if t_mask is None else r_mask & t_mask


def _missing(r_mask: np.ndarray | None, t_mask: np.ndarray | None) -> tuple[MissingStep, ...]:
    if r_mask is None and t_mask is None:
        return ()
    shape = (r_mask if r_mask is not None else t_mask).shape  # type: ignore[union-attr]
    r = np.ones(shape, dtype=bool) if r_mask is None else r_mask
    t = np.ones(shape, dtype=bool) if t_mask is None else t_mask
    found = [
        MissingStep(int(b), int(w), side)
        for side, where in (("trainer", r & ~t), ("rollout", t & ~r))
        for b, w in zip(*np.nonzero(where), strict=True)
    ]
    return tuple(sorted(found, key=lambda m: (m.sample, m.position, m.missing_on)))


def _nonfinite(rollout: np.ndarray, trainer: np.ndarray, valid: np.ndarray | None) -> tuple[NonFiniteEntry, ...]:
    found = []
    for side, table in (("rollout", rollout), ("trainer", trainer)):
        bad = ~np.isfinite(table)
        if valid is not None:
            bad &= valid
        if bad.any():
            for b, w in zip(*np.nonzero(bad), strict=True):
                found.append(NonFiniteEntry(int(b), int(w), side, _name_nonfinite(float(table[b, w]))))
    return tuple(sorted(found, key=lambda e: (e.sample, e.position, e.side)))


def _name_nonfinite(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
