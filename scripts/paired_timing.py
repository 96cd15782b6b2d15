# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Ratios of two timed variants, measured as interleaved pairs so that a shared machine's load cancels.

Each pair times both variants back to back, in alternating order (A B, B A, A B, ...), and yields one
ratio B / A. Load that comes and goes (other processes on a shared VM, frequency changes) hits both halves
of a pair alike, so the ratios scatter far less than the times; the figure is the median pair ratio, with
the spread of all pairs and of the middle half. Used by scripts/bench_*.py.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedRatio:
    """Ratios B / A of interleaved pairs, and the times (seconds) they came from."""

    ratios: tuple[float, ...]
    times_a: tuple[float, ...]
    times_b: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def quartiles(self) -> tuple[float, float]:
        """The middle half of the pair ratios (first and third quartile)."""
        if len(self.ratios) < 4:
            return min(self.ratios), max(self.ratios)
        q1, _, q3 = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q1, q3

    def describe(self) -> str:
        q1, q3 = self.quartiles
        return (
            f"{self.median:.3f}x (middle half {q1:.3f}-{q3:.3f}, all {min(self.ratios):.3f}-{max(self.ratios):.3f}, "
            f"{len(self.ratios)} pairs)"
        )

    def as_dict(self) -> dict[str, float | int]:
        q1, q3 = self.quartiles
        return {
            "median": round(self.median, 4),
            "q1": round(q1, 4),
            "q3": round(q3, 4),
            "min": round(min(self.ratios), 4),
            "max": round(max(self.ratios), 4),
            "pairs": len(self.ratios),
            "median_ms_a": round(1e3 * statistics.median(self.times_a), 4),
            "median_ms_b": round(1e3 * statistics.median(self.times_b), 4),
        }


def time_call(fn: Callable[[], object], calls: int = 1, sync: Callable[[], None] | None = None) -> float:
    """Seconds per call of `fn`, over `calls` calls back to back (`sync` before and after, e.g. CUDA's)."""
    if sync:
        sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - start) / calls


def interleaved_pairs(
    comparisons: Sequence[tuple[str, Callable[[], float], Callable[[], float]]], pairs: int, warmup: int = 2
) -> dict[str, PairedRatio]:
    """Time every comparison `(name, a, b)` as `pairs` interleaved pairs; `a()` and `b()` return seconds.

    The comparisons take turns pair by pair (round-robin), each pair in alternating order, so that every
    comparison sees the same stretch of the machine's load.
    """
    for _ in range(warmup):
        for _, a, b in comparisons:
            a(), b()
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in comparisons}
    for index in range(pairs):
        for name, a, b in comparisons:
            if index % 2 == 0:
                time_a, time_b = a(), b()
            else:
                time_b, time_a = b(), a()
            results[name][0].append(time_a)
            results[name][1].append(time_b)
    return {
        name: PairedRatio(tuple(b / a for a, b in zip(times_a, times_b, strict=True)), tuple(times_a), tuple(times_b))
        for name, (times_a, times_b) in results.items()
    }
