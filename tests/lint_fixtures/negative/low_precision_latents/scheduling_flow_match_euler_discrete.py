"""low-precision-latents, false-positive class: an inference scheduler's own cast back to the model's dtype
(diffusers' schedulers end `step` this way). No log-prob is computed, so nothing can disagree with it.

Lint fixture: parsed, never imported or run.
"""

import torch


class FlowMatchEulerDiscreteScheduler:
    def step(self, model_output, timestep, sample, s_churn=0.0, generator=None, return_dict=True):
        if self.step_index is None:
            self._init_step_index(timestep)
        # Upcast to avoid precision issues when computing prev_sample
        sample = sample.to(torch.float32)
        sigma = self.sigmas[self.step_index]
        sigma_next = self.sigmas[self.step_index + 1]
        prev_sample = sample + (sigma_next - sigma) * model_output
        if self.config.stochastic_sampling:
            x0 = sample - sigma * model_output
            noise = torch.randn(sample.shape, generator=generator, device=sample.device, dtype=sample.dtype)
            prev_sample = (1.0 - sigma_next) * x0 + sigma_next * noise
        self._step_index += 1
        # Cast sample back to model compatible dtype
        prev_sample = prev_sample.to(model_output.dtype)
        if not return_dict:
            return (prev_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev_sample)


class PCMFMScheduler:
    """A distillation solver's step: same cast, and no log-prob either."""

    def step(self, model_output, timestep, sample, return_dict=True):
        sample = sample.to(torch.float32)
        sigma, sigma_next = self.sigmas[self.step_index], self.sigmas[self.step_index + 1]
        denoised = sample - sigma * model_output
        prev_sample = denoised + sigma_next * (sample - denoised) / sigma
        prev_sample = prev_sample.to(model_output.dtype)
        self._step_index += 1
        return (prev_sample, denoised) if not return_dict else PCMFMSchedulerOutput(prev_sample=prev_sample)
