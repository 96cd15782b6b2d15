# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the two log-prob tables themselves say about a disagreement (no code, no settings).

With ``Δ = trainer − rollout`` per entry, grouped by timestep (or window position without timesteps):

* **ratio**: ``trainer ≈ c · rollout`` with one constant ``c`` far from 1 (a sum against a mean over the latent
  gives ``c`` = the number of latent elements, or its inverse: ``count``; ``c = −1`` is a sign flipped on one side,
  and a ``c`` that is negative or no whole number is no count);
* **uniform offset**: every ``Δ`` is the same number up to float32 rounding (a constant added on one side);
* **per-step offset**: ``Δ`` is one number per timestep, the same for every sample, and differs between timesteps:
  exactly (up to float rounding) for a normaliser ``−log std − ½ log 2π`` on one side only, up to the spread of
  the residual's mean square for another variance formula (``cps`` scores ``−mean((x' − mean)²)`` with none);
* **std scaling**: within each timestep ``Δ`` moves with the rollout's log-prob itself (``|corr| ≥``
  `STD_CORRELATION`): the two sides score the same residual under another transition std
  (``Δ ≈ (r² − 1)·(rollout − const)``), so the noise level or the SDE type differs; a slope that is the same at
  every timestep is a constant ratio of stds (the noise level), one that moves with the timestep is another std
  formula (the SDE type);
* otherwise a **shift** of the transition mean (velocity, timestep, text, weights, CFG, a rounded sample), which
  the tables cannot separate further.

[`read_tables`] returns a JSON-able dict (``kind`` and the measured numbers) that the doctor turns into causes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Within every timestep (of at least `_GROUP_MIN` entries), |corr(rollout log-prob, Δ)| at least this: a mean
#: shift's Δ does not move with the rollout's own log-prob (corr ~ 0); a std change does (its mean moves too, so
#: not all the way to 1). Chance reaches it in one group of 5 with p ~ 0.1, in two with p ~ 0.01.
STD_CORRELATION = 0.8
_GROUP_MIN = 5
#: A constant added to one side's log-probs leaves only float32 rounding around it (a few ULP of a log-prob).
_ROUNDING = 1e-6
#: A sum against a mean over n values gives n up to float32 rounding of the sums (~1e-6 relative); a fitted ratio
#: further than this from a whole number is another scaling.
_COUNT_RTOL = 1e-4


def read_tables(rollout: Any, trainer: Any, timesteps: Any = None) -> dict[str, Any]:
    """The tables' signature (see the module docstring); ``{"kind": "none"}`` when they agree or cannot be read."""
    r = np.asarray(rollout, dtype=np.float64)
    t = np.asarray(trainer, dtype=np.float64)
    flat_r = r.reshape(-1)
    if r.shape != t.shape or r.ndim != 2 or not r.size:
        return {"kind": "none"}
    finite = np.isfinite(r) & np.isfinite(t)
    if not finite.any():
        return {"kind": "none"}
    everywhere = bool(finite.all())  # then whole tables, not masked copies
    delta = t - r
    d = delta.reshape(-1) if everywhere else delta[finite]
    if not np.any(d):
        return {"kind": "none"}
    out: dict[str, Any] = {"entries": int(d.size), "mean": float(d.mean()), "max_abs": float(np.abs(d).max())}

    rv, tv = (r.reshape(-1), t.reshape(-1)) if everywhere else (r[finite], t[finite])
    denominator = float(rv @ rv)
    if denominator > 0:
        c = float(rv @ tv) / denominator
        residual = float(np.linalg.norm(tv - c * rv)) / max(float(np.linalg.norm(tv)), 1e-300)
        if abs(c - 1) > 0.5 and abs(c) > 1e-12 and residual < 1e-3:
            return {**out, "kind": "ratio", "ratio": c, "residual": residual, "count": reduction_count(c)}

    groups = _groups(r, timesteps, finite)
    flat_delta = delta.reshape(-1)
    step_means = [float(flat_delta[g].mean()) for g in groups]
    within = max(float(flat_delta[g].std()) for g in groups)
    largest = max(abs(m) for m in step_means)
    if len(groups) > 1 and max(step_means) - min(step_means) > 10 * within and within < 0.05 * largest:
        # Pure log-density terms differ (float rounding within a step), or a variance formula does (the spread
        # of the residual's mean square, ~sqrt(2/D), within a step).
        exact = within <= 1e-4 * largest
        return {**out, "kind": "per-step-offset", "step_offsets": step_means, "within_spread": within, "exact": exact}

    spread = float(d.std())
    rounding = _ROUNDING * (1 + float(np.abs(rv).max()))
    if abs(out["mean"]) > 4 * spread and spread <= rounding and (np.all(d > 0) or np.all(d < 0)):
        return {**out, "kind": "uniform-offset", "offset": out["mean"], "spread": spread}

    slopes, correlations = [], []
    for g in groups:
        if g.size < _GROUP_MIN or np.ptp(flat_r[g]) == 0:
            continue
        x, y = flat_r[g], flat_delta[g]
        (var_x, cov), (_, var_y) = np.cov(x, y)  # one pass for the correlation and the least-squares slope
        corr = float(cov / math.sqrt(var_x * var_y)) if var_y > 0 else 0.0
        if math.isfinite(corr):
            correlations.append(corr)
            slopes.append(1 + float(cov / var_x))
    if correlations and min(abs(c) for c in correlations) >= STD_CORRELATION:
        steady = (max(slopes) - min(slopes)) <= 0.1 * max(abs(s) for s in slopes)
        return {**out, "kind": "std-scaling", "slopes": slopes, "correlations": correlations, "steady": steady}
    return {**out, "kind": "shift", "correlations": correlations}


def reduction_count(ratio: float) -> int | None:
    """The number of latent values ``n >= 2`` a sum against a mean over them would give as `ratio` (``n`` or
    ``1/n``), or None: a negative ratio flips a sign (a count is positive) and a ratio that is no whole number
    (within `_COUNT_RTOL`) is no count."""
    if not ratio > 0:
        return None
    size = max(ratio, 1 / ratio)
    count = round(size)
    return count if count >= 2 and abs(size - count) <= max(_COUNT_RTOL * size, 1e-2) else None


def _groups(r: np.ndarray, timesteps: Any, finite: np.ndarray) -> list[np.ndarray]:
    """Flat indices of the finite entries of each timestep (each column without timesteps), in ascending key
    order and, within a group, in table order."""
    width = r.shape[1]
    steps = None if timesteps is None else np.asarray(timesteps, dtype=np.float64)
    if steps is None or steps.shape != r.shape:
        column_keys = np.arange(width, dtype=np.float64)
    elif (steps == steps[:1]).all():  # one timestep per column (a window shared by every sample)
        column_keys = steps[0]
    else:  # windows per sample: one sort of the finite entries by timestep
        flat = np.flatnonzero(finite)
        keys, key_of = np.unique(steps.reshape(-1)[flat], return_inverse=True)
        order = np.argsort(key_of, kind="stable")
        bounds = np.searchsorted(key_of[order], np.arange(keys.size + 1))
        return [flat[order[bounds[k] : bounds[k + 1]]] for k in range(keys.size)]
    groups = []
    keys, column_group = np.unique(column_keys, return_inverse=True)
    for key in range(keys.size):
        columns = np.flatnonzero(column_group == key)
        rows, which = np.nonzero(finite[:, columns])  # row-major: table order
        if rows.size:
            groups.append(rows * width + columns[which])
    return groups
