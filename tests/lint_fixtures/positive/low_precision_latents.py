"""low-precision-latents: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import torch


class FlowMatchEulerDiscreteScheduler:
    def step(self, model_output, timestep, sample, return_dict=True):
        sigma = self.sigmas[self.step_index]
        sigma_next = self.sigmas[self.step_index + 1]
        prev_sample = sample + (sigma_next - sigma) * model_output
        # Upcast to avoid precision issues when computing prev_sample ... then back to the model's dtype:
        prev_sample = prev_sample.to(model_output.dtype)  # expect: low-precision-latents
        self._step_index += 1
        if not return_dict:
            return (prev_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev_sample)


def sde_step_with_logprob(scheduler, model_output, timestep, sample, noise_level=0.7, generator=None):
    model_output = model_output.float()
    sample = sample.float()
    sigma, sigma_prev = scheduler.sigmas_for(timestep)
    std_dev_t = torch.sqrt(sigma / (1 - sigma)) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * (sigma_prev - sigma))
    variance_noise = torch.randn(sample.shape, generator=generator, dtype=torch.float32)
    prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(sigma - sigma_prev) * variance_noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2).mean(dim=(1, 2, 3))
    return prev_sample.half(), log_prob, prev_sample_mean, std_dev_t  # expect: low-precision-latents


def pipeline_with_logprob(self, prompt_embeds, timesteps, latents, noise_level):
    all_latents = [latents]
    all_log_probs = []
    for t in timesteps:
        noise_pred = self.transformer(hidden_states=latents, timestep=t, encoder_hidden_states=prompt_embeds)
        latents, log_prob, _, _ = sde_step_with_logprob(
            self.scheduler, noise_pred.float(), t, latents.float(), noise_level=noise_level
        )
        latents = latents.to(prompt_embeds.dtype)  # expect: low-precision-latents
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return latents, all_latents, all_log_probs


def store_in_trajectory(scheduler, noise_pred, t, latents, trajectory):
    out = scheduler.step(noise_pred, t, latents)
    trajectory["next_latents"] = out.prev_sample.to(torch.bfloat16)  # expect: low-precision-latents


def continuous_batching_request(state, scheduler, noise_pred):
    out = scheduler.step(noise_pred, state.timestep, state.latents, return_dict=False)
    prev = out[0].type_as(noise_pred)  # expect: low-precision-latents
    state.step_index += 1
    state.latents = prev


def denoise_collect(transformer, scheduler, latents, timesteps, dtype):
    trajectory = []
    for t in timesteps:
        noise_pred = transformer(latents.to(dtype), t)
        prev_latents = scheduler.step(noise_pred, t, latents).prev_sample
        trajectory.append(prev_latents.bfloat16())  # expect: low-precision-latents
        latents = prev_latents
    return trajectory


def denoise_device_and_dtype(transformer, scheduler, latents, timesteps, device, weight_dtype):
    for t in timesteps:
        noise_pred = transformer(latents, t)
        step_output = scheduler.step(noise_pred, t, latents)
        latents = step_output.prev_sample.to(device, weight_dtype)  # expect: low-precision-latents
    return latents


def rounded_then_widened(scheduler, noise_pred, t, x_t):
    x_prev = scheduler.step(noise_pred, t, x_t, return_dict=False)[0]
    return x_prev.to(dtype=torch.float16).float()  # expect: low-precision-latents


def feed_rounded_sample(transformer, scheduler, latents, timesteps, dtype):
    for t in timesteps:
        lowp = latents.to(dtype)  # expect: low-precision-latents
        noise_pred = transformer(lowp, t)
        latents = scheduler.step(noise_pred, t, lowp).prev_sample
    return latents
