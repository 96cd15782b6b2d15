# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`TableSettings`]: how `gate()` judges a pair of tables, as one frozen object checked when it is built.

Named for what it judges, the user's tables, so that "gate" names the function, the command and the package only.
`GateSettings` is the same class under its earlier name, kept because it is public API (documented in docs/ci.md).

Everything but the tables themselves: the tolerance profile and the dtype it scales with, the PPO clip ranges,
the trainer's micro-batch, per-metric limit overrides, and where the tables came from. `gate(rollout, trainer,
settings)` takes one; `gate(rollout, trainer, profile="kernel", ...)` builds one from the keywords.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_consistency.gate.judging.tolerances import (
    KERNEL_DTYPE_SCALE,
    PROFILES,
    Tolerance,
    ToleranceError,
    resolve_tolerance,
    table_profiles,
)

__all__ = ["GateInputError", "GateSettings", "TableSettings"]


class GateInputError(ValueError):
    """An input to `gate` cannot be used (wrong shape, dtype or value); the message names the fix."""


@dataclass(frozen=True)
class TableSettings:
    """How `rollout_consistency.gate.gate` judges the tables.

    Args:
        profile (`str`): ``"exact"`` (default: bit for bit), ``"implementation"`` (the same maths in other
            code: float32 rounding) or ``"kernel"`` (two engines whose attention kernels differ);
            ``"calibrated"`` needs the checker's second trainer pass and is refused here.
        compute_dtype (`str`): the narrowest dtype either side's forward runs in (``"bfloat16"``,
            ``"float16"`` or ``"float32"``); the ``kernel`` limits are 8x tighter for the latter two.
        clip_ratio, clip_ratio_low, clip_ratio_high (`float`): PPO clip range(s) ε.
        clip_ratio_c (`float`): verl's dual-clip constant, for ``pg_clipfrac_dual``.
        micro_batch_size (`int`, *optional*): your trainer's micro-batch, for the per-cell aggregation of the
            gated figures (``None``: one micro-batch).
        thresholds (`dict`, *optional*): per-metric limit overrides (``None`` = report without gating).
        source, notes: where the tables came from, and notes for the report.
        expected_samples (`int` or ids, *optional*): the samples the rollout produced — a count, or their ids
            (compared with the tables' ``sample_ids``). Fewer rows is a ``complete`` FAIL naming how many (and
            which) were not gated, and why (`ungated_reason`). The in-loop recorder passes it.
        ungated_reason (`str`): why rows can be missing, for that FAIL's message.
        not_checked (`dict`, *optional*): further guards the caller's tables cannot support, with why (the
            recorder without ``expected_samples``: ``{"complete": ...}``); reported as not checked.

    Raises:
        GateInputError: an unknown or the ``calibrated`` profile, an unknown metric in `thresholds`, an unknown
            `compute_dtype`, a `clip_ratio_c` that is not a finite number > 1, or `expected_samples` that is
            neither a count >= 0 nor integer ids.
    """

    profile: str = "exact"
    compute_dtype: str = "bfloat16"
    clip_ratio: float = 1e-4
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    micro_batch_size: int | None = None
    thresholds: Mapping[str, float | None] | None = None
    source: str = "tables"
    notes: tuple[str, ...] = ()
    expected_samples: int | tuple[int, ...] | None = None
    ungated_reason: str = "the tables have no row for them"
    not_checked: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "expected_samples", _expected_samples(self.expected_samples))
        usable = table_profiles()  # the profiles that need no floor measured in the same run
        if self.profile not in PROFILES:
            raise GateInputError(f"unknown profile {self.profile!r}; use {_either(usable)}.")
        if self.profile not in usable:
            raise GateInputError(
                f"profile {self.profile!r} needs the checker's second trainer pass; for tables use {_either(usable)}, "
                "or set limits with thresholds={...}."
            )
        if self.compute_dtype not in KERNEL_DTYPE_SCALE:  # whatever the profile: a typo is not a dtype
            raise GateInputError(
                f"compute_dtype {self.compute_dtype!r}: expected one of {', '.join(KERNEL_DTYPE_SCALE)}."
            )
        self.tolerance  # noqa: B018 - the thresholds, checked by resolving them once
        if not (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1):
            raise GateInputError(f"clip_ratio_c must be a finite number > 1, got {self.clip_ratio_c!r}.")

    @property
    def tolerance(self) -> Tolerance:
        """The profile's limits with the `thresholds` applied."""
        try:
            return resolve_tolerance(self.profile, self.thresholds, compute_dtype=self.compute_dtype)
        except ToleranceError as error:
            raise GateInputError(str(error)) from error

    @property
    def clip_range(self) -> tuple[float, float]:
        """The (lower, upper) PPO clip ranges: each `clip_ratio` unless set on its own."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high

    def replace(self, **changes: Any) -> TableSettings:
        """A copy with `changes` applied (checked again); an unknown name is a TypeError naming the fields."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(
                f"gate() got unknown setting(s) {', '.join(map(repr, unknown))}; the settings are TableSettings' "
                f"fields: {', '.join(names)}."
            )
        return dataclasses.replace(self, **changes)


def _expected_samples(value: Any) -> int | tuple[int, ...] | None:
    """A count >= 0 or a tuple of integer ids (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise GateInputError(f"expected_samples must be a count or sample ids, got {value!r}.")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise GateInputError(f"expected_samples must be >= 0, got {value}.")
        return int(value)
    try:
        ids = tuple(value.tolist() if hasattr(value, "tolist") else value)
    except TypeError as error:
        raise GateInputError(f"expected_samples must be a count or sample ids, got {value!r}.") from error
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise GateInputError("expected_samples ids must be integers (the sample_ids of the rows).")
    return tuple(int(i) for i in ids)


def _either(names: Sequence[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


#: The earlier name of `TableSettings` (public API, the same class): existing code that imports it keeps working.
GateSettings = TableSettings
