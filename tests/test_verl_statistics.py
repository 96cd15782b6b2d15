"""Statistics named after verl's give verl's number on the same tables.

The reference below is written from verl's rollout-correction formulas (``compute_offpolicy_metrics`` in
``verl/trainer/ppo/rollout_corr_helper.py``, verl 0.8.0-337, commit 1dda039b; verl-omni's diffusion trainer calls
it with ``old_log_prob`` = the trainer's (B, T) log-probs, the rollout's, and an all-ones mask): torch, float64,
a masked mean that divides by ``mask.sum() + 1e-8`` as verl's does, log-ratios and their per-sequence sums clamped
to ±20 before ``exp`` in χ². It does not call this package's code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_consistency.gate import gate

SAFETY_BOUND = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    kept = torch.where(mask.bool(), values, 0.0) * mask
    total = kept.sum() if axis is None else kept.sum(dim=axis)
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return total / (count + 1e-8)


def verl_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> dict[str, float]:
    mask = torch.ones_like(old_log_prob)
    log_ratio = old_log_prob - rollout_log_prob
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)
    mean_trainer = masked_mean(old_log_prob, mask, axis=-1)
    log_ppl_diff = mean_rollout - mean_trainer
    rho_token = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    log_ratio_sum = (log_ratio * mask).sum(dim=-1)
    rho_squared_seq = torch.exp(2.0 * torch.clamp(log_ratio_sum, -SAFETY_BOUND, SAFETY_BOUND))
    return {
        "kl": masked_mean(rollout_log_prob - old_log_prob, mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "chi2_token": (masked_mean(rho_token.square(), mask) - 1.0).item(),
        "chi2_seq": (rho_squared_seq.mean() - 1.0).item(),
    }


@pytest.mark.parametrize(
    "rows, steps, scale, seed",
    [(64, 4, 1e-3, 0), (500, 16, 1e-5, 1), (8, 2, 0.3, 2), (200, 10, 2.5, 3)],  # 2.5 x 10 steps: sums past ±20
)
def test_verl_named_statistics_are_verls_numbers(rows, steps, scale, seed):
    rng = np.random.default_rng(seed)
    rollout = rng.normal(-1.0, 0.5, (rows, steps)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, scale, (rows, steps))).astype(np.float32)
    ours = gate(rollout, trainer).mismatch.overall
    verl = verl_offpolicy_metrics(torch.from_numpy(trainer).double(), torch.from_numpy(rollout).double())
    # verl divides by count + 1e-8: a mean moves by 1e-8/count of itself, which for mean(ρ²) ≈ 1 is an absolute
    # 1e-8/count that the − 1 of chi2_token exposes; the rest is float64 rounding (verl's exp(Δ) − Δ − 1 and
    # mean(ρ²) − 1 cancel, absolute ~1e-16 per entry; ours use expm1)
    epsilon = 1e-8 / (rows * steps)
    for name, value in verl.items():
        assert ours.get(name) == pytest.approx(value, rel=1e-7, abs=1e-13 + 2 * epsilon), name
    if scale > 1:  # the clamp is what bounds chi2_seq: some sequences' sums are beyond ±20
        sums = (trainer.astype(np.float64) - rollout).sum(axis=1)
        assert np.abs(sums).max() > SAFETY_BOUND and ours.chi2_seq < np.exp(2 * SAFETY_BOUND)


def test_chi2_token_is_not_the_pearson_chi2_of_the_weights():
    """`chi2` (mean((w − 1)²), kept for its report key) and verl's `chi2_token` (mean(w²) − 1) differ by
    2·(mean(w) − 1): the same number only when the weights average exactly 1."""
    rng = np.random.default_rng(4)
    rollout = rng.normal(-1.0, 0.5, (100, 4)).astype(np.float32)
    trainer = (rollout + 1e-3 + rng.normal(0.0, 1e-3, (100, 4))).astype(np.float32)
    o = gate(rollout, trainer).mismatch.overall
    w = np.exp(trainer.astype(np.float64) - rollout)
    assert o.chi2 == pytest.approx(np.mean((w - 1) ** 2), rel=1e-9)
    assert o.chi2_token == pytest.approx(np.mean(w**2) - 1, rel=1e-9)
    assert o.chi2_token - o.chi2 == pytest.approx(2 * (np.mean(w) - 1), rel=1e-6)
