"""A test named for rollouts that drives the single-process DDPO trainer: a test, not a rollout engine.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from minitrl.trainer.ddpo_trainer import DDPOConfig, DDPOTrainer


def test_grouped_rollout_shapes(tiny_pipeline):
    trainer = DDPOTrainer(DDPOConfig(), reward_function=lambda images: images.mean(), sd_pipeline=tiny_pipeline)
    assert trainer.sd_pipeline is tiny_pipeline
