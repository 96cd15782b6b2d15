"""Evidence is what was measured: each sentence the doctor's templates write is checked on a case where it is true
and on a planted case where it would be false (the sentence must not appear there).

Tables (`table_signatures` / `figure_causes`): a sign flip is a convention, never "a sum against a mean over −1
latent values"; a factor that is no whole number is no reduction; a negative count is both. The experts guard
(Wan 2.2) names the side whose record breaks the boundary rule, in both directions, and says so when it cannot
tell. Pairing (`localise._key_pairing`): "left out of the permutation" only where one key kept the batch's order
while the latents' rows were permuted, not when the key took another permutation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rollout_consistency.gate import gate
from rollout_consistency.gate.judging.experts import compare_experts


def _tables(seed: int = 0, shape=(8, 4)):
    rng = np.random.default_rng(seed)
    rollout = -1.2 - rng.random(shape)  # per-entry log-probs, all distinct
    timesteps = np.tile(np.array([900.0, 700.0, 500.0, 300.0]), (shape[0], 1))
    return rollout, timesteps


def _evidence(report) -> str:
    return "\n".join(e for d in report.diagnosis for e in d["evidence"])


def test_a_sign_flipped_table_is_a_convention_not_a_reduction_over_minus_one_values():
    rollout, timesteps = _tables()
    report = gate(rollout, -rollout, timesteps=timesteps)
    top = report.diagnosis[0]
    assert top["cause"] == "logprob-convention", report.diagnosis
    assert "trainer = −1 × rollout at every entry" in top["evidence"][0]
    text = _evidence(report)
    assert "latent values" not in text and "sum against a mean" not in text
    assert "logprob-reduction" not in [d["cause"] for d in report.diagnosis]


def test_a_whole_number_ratio_is_a_reduction_and_a_fractional_one_is_not():
    rollout, timesteps = _tables(1)
    summed = gate(rollout, 1024 * rollout, timesteps=timesteps)
    assert summed.diagnosis[0]["cause"] == "logprob-reduction"
    assert "a sum against a mean over 1024 latent values" in summed.diagnosis[0]["evidence"][0]
    for factor in (2.5, 1 / 2.5, 37.3):  # the planted false case: no count of latent values gives these
        report = gate(rollout, factor * rollout, timesteps=timesteps)
        assert report.diagnosis[0]["cause"] == "logprob-convention", (factor, report.diagnosis)
        text = _evidence(report)
        assert "sum against a mean over" not in text and "no whole number of latent values" in text
        assert "opposite signs" not in text


def test_a_negative_count_is_a_flipped_sign_and_a_sum():
    rollout, timesteps = _tables(2)
    report = gate(rollout, -64 * rollout, timesteps=timesteps)
    causes = [d["cause"] for d in report.diagnosis[:2]]
    assert causes == ["logprob-convention", "logprob-reduction"], report.diagnosis
    line = report.diagnosis[0]["evidence"][0]
    assert "opposite signs" in line and "over 64 latent values" in line and "−64 latent" not in line


def test_a_constant_offset_is_said_only_of_a_constant():
    rollout, timesteps = _tables(3)
    offset = gate(rollout, rollout + 1e-3, timesteps=timesteps)
    assert offset.diagnosis[0]["cause"] == "logprob-offset"
    assert "a constant added to one side's log-probs" in offset.diagnosis[0]["evidence"][0]
    # Planted: one constant per timestep is not one constant everywhere.
    per_step = gate(rollout, rollout + np.array([1e-3, 2e-3, 3e-3, 4e-3]), timesteps=timesteps)
    assert "a constant added to one side's log-probs" not in _evidence(per_step)
    assert "one number per timestep" in _evidence(per_step)
    # Planted: a per-step term with a spread beyond float rounding is not "a normaliser on one side only".
    noisy = (
        rollout + np.array([1e-2, 2e-2, 3e-2, 4e-2]) + 1e-4 * np.random.default_rng(4).standard_normal(rollout.shape)
    )
    assert "a normaliser or std term on one side only" not in _evidence(gate(rollout, noisy, timesteps=timesteps))
    exact = gate(rollout, rollout + np.array([1e-2, 2e-2, 3e-2, 4e-2]), timesteps=timesteps)
    assert "a normaliser or std term on one side only" in _evidence(exact)


# ----------------------------------------------------------------------------------------------------
# The experts guard (Wan 2.2): boundary 875, steps at t = 1000, 953, 883 | 771, 562.
_TIMESTEPS = (1000.0, 953.0, 883.0, 771.0, 562.0)
_RULE = ("transformer",) * 3 + ("transformer_2",) * 2
_LATE = ("transformer",) * 4 + ("transformer_2",)  # the switch taken one step late


def _experts_result(rollout, trainer):
    return SimpleNamespace(
        sample_indices=(0, 1),
        window_starts=(0, 0),
        timesteps=[_TIMESTEPS, _TIMESTEPS],
        experts={"rollout": (rollout, rollout), "trainer": (trainer, trainer)},
    )


@pytest.mark.parametrize("late", ["rollout", "trainer"])
def test_the_experts_guard_names_the_side_that_breaks_the_boundary_rule(late):
    rollout, trainer = (_LATE, _RULE) if late == "rollout" else (_RULE, _LATE)
    other = "trainer" if late == "rollout" else "rollout"
    (message,) = compare_experts([_experts_result(rollout, trainer)], boundary=(875.0, *_RULE[2:4])).problems
    assert f"the {late} breaks it (the {other} follows it)" in message, message
    assert f"the {other} breaks it" not in message
    assert "gives transformer_2 at step 3" in message


def test_the_experts_guard_says_it_cannot_tell_without_a_boundary():
    (message,) = compare_experts([_experts_result(_LATE, _RULE)]).problems
    assert "which side breaks the boundary rule was not measured" in message
    assert "breaks it" not in message and "must switch experts at the rollout's step" not in message


def test_both_sides_off_the_rule_are_both_named():
    early = ("transformer",) * 2 + ("transformer_2",) * 3
    (message,) = compare_experts([_experts_result(_LATE, early)], boundary=(875.0, *_RULE[2:4])).problems
    assert "both sides break it" in message


# ----------------------------------------------------------------------------------------------------
# Pairing, on flow_grpo's loop: the trainer shuffles every key with `perm` but `next_latents` with another
# permutation. The step still scores another sample's next latents (misaligned-batch), but `next_latents` did not
# keep the batch's order, so "left out of the permutation" would be false.
def make_rollout(config):
    from doctor_corpus.loops import FlowGRPOSampler

    return FlowGRPOSampler(config)


def make_trainer(config):
    import torch
    from doctor_corpus.loops import FlowGRPOTrainer

    class Trainer(FlowGRPOTrainer):
        def __call__(self, samples, *, micro_batch_size):
            n = samples["timesteps"].shape[0]
            perm, other = torch.roll(torch.arange(n), 1), torch.roll(torch.arange(n), 2)
            shuffled = {k: v[other if k == "next_latents" else perm] for k, v in samples.items()}
            return super().__call__(shuffled, micro_batch_size=micro_batch_size)[torch.argsort(perm)]

    return Trainer(config)


def test_a_key_shuffled_by_another_permutation_is_misaligned_but_not_left_out():
    from doctor_corpus.loops import settings

    from rollout_consistency import CheckConfig, run_step1_check

    config = CheckConfig(rollout_backend=f"{__file__}:make_rollout", trainer_backend=f"{__file__}:make_trainer")
    report = run_step1_check(config.replace(**settings("flow_grpo")))
    top = report.diagnosis[0]
    assert top["cause"] == "misaligned-batch", report.diagnosis[:2]
    text = "\n".join(top["evidence"])
    assert "only when its step for a sample scores the next latents the rollout stepped to from another sample" in text
    assert "`latents` row 3 with `next_latents` row 2" in text  # perm and the other permutation, as matched
    assert "left out of the permutation" not in text and "follow the batch's order" not in text
    assert "the trainer's log-probs are reproduced" not in text
