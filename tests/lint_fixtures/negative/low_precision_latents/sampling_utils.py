"""low-precision-latents, false-positive classes from RL samplers that are consistent after all.
Written for the lint's tests, in the style of MixGRPO / DanceGRPO.

Lint fixture: parsed, never imported or run.
"""

import math

import torch


def dpm_step(args, model_output, sample, step_index, sigmas, dpm_state, noise):
    """The sample is rounded *before* its log-prob is computed: the rounded sample is the one scored and
    returned, so the trainer re-scores exactly what the rollout scored."""
    sample = sample.to(torch.float32)
    prev_sample, prev_sample_mean, std_dev_t, dt_sqrt = dpm_solver_first_order_update(
        args, model_output, sigmas, step_index, sample, noise
    )
    dpm_state.update_lower_order()
    # Cast sample back to expected dtype
    prev_sample = prev_sample.to(model_output.dtype)
    # Compute log_prob
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * dt_sqrt) ** 2))
        - torch.log(std_dev_t * dt_sqrt)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, model_output, log_prob


def run_sample_step(args, z, progress_bar, sigma_schedule, transformer, encoder_hidden_states):
    """The loop keeps float32 samples; after it, the final sample is cast for decoding only."""
    all_latents = [z]
    all_log_probs = []
    for i in progress_bar:
        with torch.autocast("cuda", torch.bfloat16):
            pred = transformer(hidden_states=z, encoder_hidden_states=encoder_hidden_states, timestep=sigma_schedule[i])
        z, pred_original, log_prob = dance_grpo_step(pred, z.to(torch.float32), args.eta, sigma_schedule, i, None)
        z.to(torch.bfloat16)  # a no-op: the result is dropped
        all_latents.append(z)
        all_log_probs.append(log_prob)
    if args.drop_last_sample:
        latents = pred_original
    else:
        latents = z.to(pred_original.dtype)
    return z, latents, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)


def dance_grpo_step(model_output, latents, eta, sigmas, index, prev_sample):
    sigma, dsigma = sigmas[index], sigmas[index + 1] - sigmas[index]
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    std_dev_t = eta * math.sqrt(sigma - sigmas[index + 1])
    if prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    log_prob = -((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2) / (2 * std_dev_t**2)
    return prev_sample, pred_original_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def the_fix(self, prompt_embeds, timesteps, latents):
    """Float32 latents throughout; the transformer gets a low-precision copy."""
    all_latents, all_log_probs = [latents], []
    for t in timesteps:
        latent_model_input = latents.to(prompt_embeds.dtype)
        noise_pred = self.transformer(hidden_states=latent_model_input, timestep=t)[0]
        latents, log_prob, _, _ = self.sde_step_with_logprob(noise_pred.float(), t, latents)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return all_latents, all_log_probs


def log_prob_only(scheduler, noise_pred, t, latents, prev_sample):
    log_prob = scheduler.log_prob(noise_pred.float(), t, latents, prev_sample)
    return log_prob.to(torch.bfloat16)


def upcasts(scheduler, noise_pred, t, latents):
    prev_sample, log_prob = scheduler.step_with_logprob(noise_pred, t, latents)
    widened = prev_sample.float()
    doubled = prev_sample.to(dtype=torch.float64)
    moved = prev_sample.to("cpu")
    return widened, doubled, moved, log_prob


def sde_step_rescored(scheduler, model_output, timestep, sample, noise_level):
    """The rounded sample is scored again after the cast: the log-prob returned is the rounded sample's."""
    prev_sample, log_prob, prev_sample_mean, std_dev_t = scheduler.sde_step_with_logprob(
        model_output.float(), timestep, sample.float(), noise_level=noise_level
    )
    prev_sample = prev_sample.to(model_output.dtype)
    log_prob = -((prev_sample.float() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
