# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`ExactSum`: the exact sum of float64 values, as one integer, so that sums merged from shards in any order equal
the sum over the whole batch bit for bit.

Every finite float64 is an integer multiple of 2^-1074; a sum of them is an integer at the scale ``2**-SHIFT``.
`ExactSum.of` adds a whole array exactly without a Python loop over its entries: each value is split into its
53-bit integer mantissa and its exponent (``np.frexp``), the mantissa into two halves of 27 and 26 bits, and the
halves are summed per exponent with ``np.bincount`` — float64 sums of integers below 2^53, hence exact — then
shifted into one Python ``int``. `value` and `mean` round once, correctly (Python's ``int / int``).

Infinite values are kept aside (``special``): +inf plus finite is +inf; a NaN, or +inf with -inf, is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: value = numerator / 2**SHIFT: room for the smallest subnormal's 53-bit mantissa (2^-1074 = 2^(-1021-53)).
SHIFT = 1128
#: Exponents np.frexp gives for finite nonzero float64 (subnormals included), and one bucket per exponent.
_EXP_MIN, _EXP_MAX = -1073, 1024
_EXPONENTS = _EXP_MAX - _EXP_MIN + 1
#: Entries per bincount: 2**25 halves of at most 2**27 each stay below 2**52, exact in float64.
_CHUNK = 1 << 25
#: Below this many values a Python loop over `float.as_integer_ratio` is faster than the vectorised split.
_SMALL = 256
#: Buckets (groups x exponents in use) above which the group sums go through np.unique instead of a dense bincount.
_DENSE_BUCKETS = 1 << 22


@dataclass(frozen=True)
class ExactSum:
    """An exact sum of float64 values: ``numerator / 2**SHIFT``, plus ``special`` (0.0, inf, -inf or NaN) for the
    non-finite values added. ``a + b`` is exact and commutative, so shards merge in any order."""

    numerator: int = 0
    special: float = 0.0

    @classmethod
    def of(cls, values: np.ndarray) -> ExactSum:
        """The exact sum of a float64 array (any shape)."""
        return cls.grouped(np.asarray(values, dtype=np.float64).ravel(), None, 1)[0]

    @classmethod
    def each(cls, vectors: list[np.ndarray]) -> list[ExactSum]:
        """The exact sum of each 1-D float64 array of `vectors`, in one pass (one call's overhead for all)."""
        sizes = [v.size for v in vectors]
        groups = np.repeat(np.arange(len(vectors), dtype=np.int64), sizes)
        values = np.concatenate(vectors) if vectors else np.zeros(0)
        return cls.grouped(values, groups, len(vectors))

    @classmethod
    def grouped(cls, values: np.ndarray, groups: np.ndarray | None, count: int) -> list[ExactSum]:
        """The exact sum of `values` (1-D float64) in each of `count` groups; `groups` (1-D int, same length) holds
        each value's group in ``0..count-1`` (None: one group)."""
        values = np.asarray(values, dtype=np.float64)
        if values.size <= _SMALL:
            return _small_sums(values, groups, count)
        finite = np.isfinite(values)
        specials = [0.0] * count
        if not finite.all():
            bad = ~finite
            for group, value in zip(
                (np.zeros(int(bad.sum()), np.int64) if groups is None else groups[bad]).tolist(),
                values[bad].tolist(),
                strict=True,
            ):
                specials[group] = specials[group] + value  # inf + -inf is NaN, as the true sum is undefined
            values = values[finite]
            groups = None if groups is None else groups[finite]
        numerators = [0] * count
        for start in range(0, values.size, _CHUNK):
            chunk = values[start : start + _CHUNK]
            part = None if groups is None else groups[start : start + _CHUNK]
            for group, exponent, total in _bucket_sums(chunk, part, count):
                numerators[group] += total << (exponent - 53 + SHIFT)
        return [cls(n, s) for n, s in zip(numerators, specials, strict=True)]

    def __add__(self, other: ExactSum) -> ExactSum:
        if not isinstance(other, ExactSum):
            return NotImplemented
        return ExactSum(self.numerator + other.numerator, self.special + other.special)

    def __sub__(self, other: ExactSum) -> ExactSum:
        if not isinstance(other, ExactSum):
            return NotImplemented
        return ExactSum(self.numerator - other.numerator, self.special - other.special)

    @property
    def value(self) -> float:
        """The sum, rounded once to float64 (±inf beyond its range)."""
        return self.mean(1)

    def mean(self, count: int) -> float:
        """The sum divided by `count`, rounded once (NaN for count 0)."""
        if count <= 0:
            return math.nan
        if self.special != 0.0:
            return self.special  # inf stays inf whatever the count; NaN stays NaN
        try:
            return self.numerator / (count << SHIFT)
        except OverflowError:
            return math.copysign(math.inf, self.numerator)

    def to_text(self) -> str:
        """A JSON-safe form (the integer in hex; `from_text` reads it back)."""
        return f"{self.numerator:#x}" + ("" if self.special == 0.0 else f"|{self.special!r}")

    @classmethod
    def from_text(cls, text: str) -> ExactSum:
        number, _, special = str(text).partition("|")
        return cls(int(number, 16), float(special) if special else 0.0)


def _small_sums(values: np.ndarray, groups: np.ndarray | None, count: int) -> list[ExactSum]:
    """`ExactSum.grouped` for a few values: each value's exact ratio (a power-of-2 denominator), added in Python
    ints at the group's largest denominator (a few dozen bits, not SHIFT's thousand), then shifted once."""
    items = values.tolist()
    keys = [0] * len(items) if groups is None else groups.tolist()
    ratios: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    specials = [0.0] * count
    for key, value in zip(keys, items, strict=True):
        if math.isfinite(value):
            ratios[key].append(value.as_integer_ratio())
        else:
            specials[key] = specials[key] + value
    sums = []
    for found, special in zip(ratios, specials, strict=True):
        if not found:
            sums.append(ExactSum(0, special))
            continue
        scale = max(d for _, d in found).bit_length() - 1  # every denominator is 2**k, k <= scale
        total = sum(n << (scale - d.bit_length() + 1) for n, d in found)
        sums.append(ExactSum(total << (SHIFT - scale), special))
    return sums


def _bucket_sums(values: np.ndarray, groups: np.ndarray | None, count: int) -> list[tuple[int, int, int]]:
    """(group, exponent, exact integer sum of the mantissas) for every nonzero bucket of finite `values`."""
    if values.size == 0:
        return []
    mantissa, exponent = np.frexp(values)
    integer = np.ldexp(mantissa, 53).astype(np.int64)  # exact: |integer| < 2**53
    high = integer >> 27  # floor division: high * 2**27 + low == integer, 0 <= low < 2**27
    low = integer - (high << 27)
    del mantissa, integer
    low_exp = int(exponent.min())
    span = int(exponent.max()) - low_exp + 1
    key = exponent.astype(np.int64) - low_exp
    del exponent
    if groups is not None:
        key += groups.astype(np.int64) * span
    buckets = count * span
    if buckets <= _DENSE_BUCKETS:
        used = None
        highs = np.bincount(key, weights=high.astype(np.float64), minlength=buckets)
        lows = np.bincount(key, weights=low.astype(np.float64), minlength=buckets)
        nonzero = np.flatnonzero((highs != 0) | (lows != 0))
    else:  # many groups and exponents: only the buckets in use
        used, key = np.unique(key, return_inverse=True)
        highs = np.bincount(key, weights=high.astype(np.float64))
        lows = np.bincount(key, weights=low.astype(np.float64))
        nonzero = np.flatnonzero((highs != 0) | (lows != 0))
    found = []
    for index in nonzero.tolist():
        bucket = index if used is None else int(used[index])
        group, offset = divmod(bucket, span)
        total = (int(highs[index]) << 27) + int(lows[index])
        found.append((group, offset + low_exp, total))
    return found


__all__ = ["SHIFT", "ExactSum"]
