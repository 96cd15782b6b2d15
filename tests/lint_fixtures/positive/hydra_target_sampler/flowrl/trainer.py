"""The GRPO update: re-scores the stored step and takes the ratio to the stored log-prob (written for the
lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch


def grpo_step(cfg, sampler, samples):
    for j in range(samples["latents"].shape[1] - 1):
        log_prob = sampler.score(samples["latents"][:, j], samples["next_latents"][:, j], j)
        ratio = torch.exp(log_prob - samples["log_probs"][:, j])
        loss = -(samples["advantages"] * ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)).mean()
        loss.backward()
