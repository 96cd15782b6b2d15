"""The DDPO trainer: samples with the pipeline, then re-scores each stored step (`prev_sample=next_latents`)
against the stored log-probs. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch
from accelerate import Accelerator
from ddpo.diffusers_patch.ddim_with_logprob import ddim_step_with_logprob
from ddpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob


def main(config, pipeline, prompt_embeds, optimizer):
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    inference_dtype = torch.float16 if accelerator.mixed_precision == "fp16" else torch.float32
    pipeline.unet.to(accelerator.device, dtype=inference_dtype)
    images, latents, log_probs = pipeline_with_logprob(pipeline, prompt_embeds, eta=config.sample.eta)
    latents = torch.stack(latents, dim=1)
    log_probs = torch.stack(log_probs, dim=1)
    samples = {"latents": latents[:, :-1], "next_latents": latents[:, 1:], "log_probs": log_probs}
    for j, t in enumerate(pipeline.scheduler.timesteps):
        with accelerator.accumulate(pipeline.unet):
            noise_pred = pipeline.unet(samples["latents"][:, j], t, prompt_embeds).sample
            _, log_prob = ddim_step_with_logprob(
                pipeline.scheduler,
                noise_pred,
                t,
                samples["latents"][:, j],
                eta=config.sample.eta,
                prev_sample=samples["next_latents"][:, j],
            )
            ratio = torch.exp(log_prob - samples["log_probs"][:, j])
            loss = -ratio.mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
