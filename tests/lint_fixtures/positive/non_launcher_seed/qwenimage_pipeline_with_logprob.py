"""non-launcher-seed, true positives: Flow-GRPO style pipelines that draw the SDE window from the global
`random` generator, seeded per process. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import random

import torch


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, latents, timesteps, noise_level=0.7, process_index=0, sde_window_size=0, sde_window_range=(0, 5)):
    random.seed(process_index)  # expect: non-launcher-seed
    if sde_window_size > 0:
        start = random.randint(sde_window_range[0], sde_window_range[1] - sde_window_size)
        end = start + sde_window_size
        sde_window = (start, end)
    else:
        sde_window = (0, len(timesteps) - 1)
    all_latents, all_log_probs = [], []
    for i, t in enumerate(timesteps):
        cur_noise_level = noise_level if sde_window[0] <= i < sde_window[1] else 0.0
        noise_pred = self.transformer(hidden_states=latents, timestep=t, encoder_hidden_states=prompt_embeds)[0]
        latents, log_prob, _, _ = self.sde_step_with_logprob(noise_pred.float(), t, latents.float(), noise_level=cur_noise_level)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return latents, all_latents, all_log_probs


@torch.no_grad()
def pipeline_with_logprob_fast(self, latents, timesteps, noise_level=0.7, process_index=0, random_timestep=None, sample_num_steps=10):
    """Flow-GRPO-Fast: the one stochastic step is a window of size one, gated in the loop."""
    random.seed(process_index)  # expect: non-launcher-seed
    if random_timestep is None:
        random_timestep = random.randint(0, sample_num_steps // 2)
    for i, t in enumerate(timesteps):
        if i < random_timestep:
            cur_noise_level = 0
        elif i == random_timestep:
            cur_noise_level = noise_level
        else:
            cur_noise_level = 0
        latents = self.step(latents, t, noise_level=cur_noise_level)
    return latents


def draw_window_after_launcher_seed(sde_window_size, sde_window_range):
    """The trainer called `set_seed(config.seed, device_specific=True)`: the global generator differs per rank."""
    start = random.randint(sde_window_range[0], sde_window_range[1] - sde_window_size)  # expect: non-launcher-seed
    return start, start + sde_window_size
