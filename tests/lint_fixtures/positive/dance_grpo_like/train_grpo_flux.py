"""Shaped like DanceGRPO's FLUX trainer (written for the lint's tests): sampling and training in one file.

Lint fixture: parsed, never imported or run.
"""

import math

import torch
import torch.distributed as dist


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        log_term = -0.5 * eta**2 * score_estimate
        prev_sample_mean = prev_sample_mean + log_term * dsigma
    if grpo and prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    if grpo:
        log_prob = (
            -((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2) / (2 * std_dev_t**2)
            - math.log(std_dev_t)
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        return prev_sample, pred_original_sample, log_prob
    return prev_sample_mean, pred_original_sample


def run_sample_step(args, z, progress_bar, sigma_schedule, transformer, encoder_hidden_states, pooled_prompt_embeds,
                    text_ids, image_ids, grpo_sample):
    all_latents = [z]
    all_log_probs = []
    for i in progress_bar:
        sigma = sigma_schedule[i]
        timestep_value = int(sigma * 1000)
        timesteps = torch.full([encoder_hidden_states.shape[0]], timestep_value, device=z.device, dtype=torch.long)
        with torch.autocast("cuda", torch.bfloat16):
            pred = transformer(hidden_states=z, encoder_hidden_states=encoder_hidden_states, timestep=timesteps / 1000,
                               pooled_projections=pooled_prompt_embeds, txt_ids=text_ids, img_ids=image_ids)[0]
        z, pred_original, log_prob = flux_step(pred, z.to(torch.float32), args.eta, sigma_schedule, i, None,
                                               grpo=True, sde_solver=True)
        z = z.to(torch.bfloat16)  # expect: low-precision-latents
        all_latents.append(z)
        all_log_probs.append(log_prob)
    return z, all_latents, all_log_probs


def sample_reference_model(args, device, transformer, encoder_hidden_states, pooled_prompt_embeds, text_ids):
    sp_size = args.sp_size
    input_latents = torch.randn(
        (1, 16, args.h // 8, args.w // 8),
        device=device,
        dtype=torch.bfloat16,
        # per-rank initial noise: stored with the trajectory, so the trainer reads it back (not reported)
        generator=torch.Generator(device=device).manual_seed(args.seed + dist.get_rank() // sp_size),
    )
    return input_latents


def train_one_step(args, transformer, optimizer, scaler, samples):
    for sample in samples:
        with torch.autocast("cuda", torch.bfloat16):
            new_log_probs = transformer(sample["latents"]).mean()
        ratio = torch.exp(new_log_probs - sample["log_probs"])
        loss = -(sample["advantages"] * ratio).mean()
        scaler.scale(loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(transformer.parameters(), max_norm=args.max_grad_norm)  # expect: clip-before-unscale
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return grad_norm


def main(args, transformer, optimizer):
    scaler = torch.cuda.amp.GradScaler()  # expect: grad-scaler-with-bf16
    return scaler
