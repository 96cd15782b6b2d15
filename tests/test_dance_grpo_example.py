"""The DanceGRPO-style reference integration (scripts/examples/dance_grpo_style.py) under the checker: its own Wan
2.2 sampling loop (`dance_sde`, CFG as one forward of 2B, bf16 autocast, one video at a time) and its own
per-(sample, timestep) trainer, plugged in as both sides. The trainer that switches experts as the rollout does
passes bit for bit; the one that holds one module throughout fails on the `experts` guard, naming the steps."""

from __future__ import annotations

from pathlib import Path

from rollout_consistency import CheckConfig, run_step1_check

EXAMPLE = f"{Path(__file__).resolve().parents[1] / 'scripts' / 'examples' / 'dance_grpo_style.py'}:"
# A window of 4 of 6 steps holds the first low-noise step (3) wherever the plan draws it.
RUN = dict(
    model_family="wan",
    boundary_ratio=0.875,
    sde_type="dance_sde",
    noise_level=0.3,
    guidance_scale=4.5,
    sde_window_size=4,
    num_prompts=1,
    num_images_per_prompt=2,
    rollout_batch_size=2,
    rollout_backend=EXAMPLE + "make_rollout",
    progress=False,
)


def test_dance_grpo_style_pair_passes_bit_for_bit():
    report = run_step1_check(CheckConfig(trainer_backend=EXAMPLE + "make_trainer", **RUN))
    assert report.passed, report.reasons
    assert report.metrics.overall.max_abs_dlogp == 0.0  # shuffled timesteps, one sample at a time: same bits
    assert {c.name: c.passed for c in report.verdict.checks}["experts"]
    assert {n for row in report.run["experts"] for n in row["rollout"]} == {"transformer", "transformer_2"}


def test_a_trainer_holding_one_expert_fails_naming_the_steps_and_both_experts():
    report = run_step1_check(CheckConfig(trainer_backend=EXAMPLE + "make_trainer_one_expert", **RUN))
    assert not report.passed
    (reason,) = [r for r in report.reasons if r.startswith("experts:")]
    assert "step 3 (t=771.431): rollout transformer_2, trainer transformer (2 samples)" in reason
    assert report.diagnosis[0]["cause"] == "expert-switch"
    high = [s for s in report.metrics.by_timestep if s.timestep >= 875]
    assert high and all(s.values.max_abs_dlogp == 0 for s in high)  # the high-noise steps still agree
