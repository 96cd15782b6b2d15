"""verl-omni (Qwen-Image), true CFG 4.0: the actor renormalises the combined prediction over the whole latent
(``dim=(1, 2)``) where the rollout rescales it token by token (``dim=-1``)."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("verl_omni", true_cfg_scale=4.0))


def apply_true_cfg(noise_pred, negative_noise_pred, true_cfg_scale):
    comb_pred = negative_noise_pred + true_cfg_scale * (noise_pred - negative_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=(1, 2), keepdim=True)  # the bug: one norm per sample, not per token
    noise_norm = torch.norm(comb_pred, dim=(1, 2), keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


class Actor(DiffusionActor):
    def predict_noise(self, model_inputs, negative_model_inputs):
        cond, uncond = self.forward(model_inputs), self.forward(negative_model_inputs)
        return apply_true_cfg(cond, uncond, self.model_config.pipeline.true_cfg_scale)


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
