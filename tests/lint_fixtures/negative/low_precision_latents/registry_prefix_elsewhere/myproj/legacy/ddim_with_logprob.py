"""An old DDPO step left in `myproj/legacy/`, outside the `myproj.rollout.` prefix the registry loads from: it
rounds `prev_sample` beside a float32 log-prob, but nothing imports it, the registry cannot load it and no
config names it — a dead copy, no finding. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import math
import torch


def _left_broadcast(t, shape):
    return t.reshape(list(t.shape) + [1] * (len(shape) - t.ndim)).broadcast_to(shape)


def ddim_step_with_logprob(self, model_output, timestep, sample, eta=0.0, generator=None, prev_sample=None):
    prev_timestep = timestep - self.config.num_train_timesteps // self.num_inference_steps
    alpha_prod_t = self.alphas_cumprod.gather(0, timestep.cpu())
    alpha_prod_t_prev = self.alphas_cumprod.gather(0, prev_timestep.clamp(min=0).cpu())
    alpha_prod_t = _left_broadcast(alpha_prod_t, sample.shape).to(sample.device)
    alpha_prod_t_prev = _left_broadcast(alpha_prod_t_prev, sample.shape).to(sample.device)
    beta_prod_t = 1 - alpha_prod_t
    pred_original_sample = (sample - beta_prod_t**0.5 * model_output) / alpha_prod_t**0.5
    variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = eta * variance**0.5
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** 0.5 * model_output
    prev_sample_mean = alpha_prod_t_prev**0.5 * pred_original_sample + pred_sample_direction
    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, device=model_output.device)
        prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t**2))
        - torch.log(std_dev_t)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.type(sample.dtype), log_prob
