"""verl-omni (Qwen-Image): the actor computes the dynamic shift's ``mu`` from the latent grid before packing
(``height // vae_scale_factor``, without the 2×2 patch), four times the image sequence length the rollout used:
its sigmas are of another schedule than the timesteps the rollout stored."""

import numpy as np

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings
from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler
from rollout_consistency.schedulers.scheduler_setup import image_seq_len_shift

CASE = dict(
    expected="schedule-shift",
    side="trainer",
    settings=settings("verl_omni"),
    # The actor's scheduler cannot look up the rollout's timesteps: it scores nothing, and the guard says why.
    evidence=(
        "the rollout's timesteps are qwen-image's scheduler with mu 0.4873 (calculate_shift of 4 image tokens)",
        "the trainer's with mu 0.4879 (calculate_shift of 16 image tokens)",
    ),
)


class Actor(DiffusionActor):
    def __init__(self, config):
        super().__init__(config)
        pipeline = self.model_config.pipeline
        scheduler = FlowMatchSDEDiscreteScheduler.from_config(self.scheduler.config)
        num_steps = pipeline.num_inference_steps
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        # the bug: the sequence length of the unpacked latent grid (no // 2 for the 2x2 patches)
        image_seq_len = (pipeline.height // 8) * (pipeline.width // 8)
        scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=image_seq_len_shift(image_seq_len, scheduler.config))
        self.scheduler = scheduler


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
