"""Pref-GRPO's FLUX trainer (the DanceGRPO loop): the SDE step scores the float32 `z` and the trajectory keeps
it float32, so the trainer re-scores what the rollout scored. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import argparse
import math

import torch

from fastvideo.utils.logging_ import main_print


def flux_step(model_output, latents, eta, sigmas, index, prev_sample=None):
    sigma, dsigma = sigmas[index], sigmas[index + 1] - sigmas[index]
    prev_sample_mean = latents + dsigma * model_output
    std_dev_t = eta * math.sqrt(abs(dsigma))
    if prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    log_prob = -((prev_sample.detach().float() - prev_sample_mean.float()) ** 2) / (2 * std_dev_t**2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, sigma, log_prob


def run_sample_step(args, z, transformer, encoder_hidden_states, sigmas):
    all_latents, all_log_probs = [z], []
    for i in range(len(sigmas) - 1):
        with torch.autocast("cuda", torch.bfloat16):
            pred = transformer(hidden_states=z.to(torch.bfloat16), encoder_hidden_states=encoder_hidden_states)
        z, _, log_prob = flux_step(pred.float(), z.float(), args.eta, sigmas, i)
        all_latents.append(z)
        all_log_probs.append(log_prob)
    return z, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)


def train_one_step(args, transformer, optimizer, samples, sigmas):
    for i in range(samples["latents"].shape[1] - 1):
        pred = transformer(hidden_states=samples["latents"][:, i].to(torch.bfloat16))
        _, _, log_prob = flux_step(
            pred.float(),
            samples["latents"][:, i].float(),
            args.eta,
            sigmas,
            i,
            prev_sample=samples["latents"][:, i + 1].float(),
        )
        ratio = torch.exp(log_prob - samples["log_probs"][:, i])
        loss = -(samples["advantages"] * ratio).mean()
        loss.backward()
        optimizer.step()
        main_print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--eta", type=float, default=0.3)
    main_print(parser.parse_args())
