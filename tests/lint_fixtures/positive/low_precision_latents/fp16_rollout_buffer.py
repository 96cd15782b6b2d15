"""low-precision-latents: a rollout that keeps its trajectory in float16 to save memory, beside the float32
log-probs of the unrounded latents. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def collect_rollout(pipe, prompt_embeds, timesteps, latents, buffer):
    for i, t in enumerate(timesteps):
        noise_pred = pipe.transformer(latents.to(torch.float16), t, prompt_embeds)
        next_latents, log_prob = pipe.sde_step_with_logprob(noise_pred.float(), t, latents.float())
        buffer.latents.append(next_latents.to(torch.float16))  # expect: low-precision-latents
        buffer.log_probs.append(log_prob)
        latents = next_latents
    return buffer
