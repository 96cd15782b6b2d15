"""The PPO step of DDPO: re-scores the stored step and takes the ratio to the stored log-prob (written for the
lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch


def ppo_step(config, samples):
    for j in range(samples["latents"].shape[1] - 1):
        log_prob = samples["score"](samples["latents"][:, j], samples["next_latents"][:, j], j)
        ratio = torch.exp(log_prob - samples["log_probs"][:, j])
        loss = -(samples["advantages"] * ratio.clamp(1 - config.clip_range, 1 + config.clip_range)).mean()
        loss.backward()
