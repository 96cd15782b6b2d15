"""verl-omni (Qwen-Image): the rollout hands the transformer a bfloat16 timestep (the model's dtype)."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, build_img_shapes, settings

CASE = dict(expected="model-input", side="rollout", settings=settings("verl_omni"))


class Rollout(QwenImageRolloutAdapter):
    def forward(self, latents, t, prompt_embeds, prompt_embeds_mask):
        pipeline = self.model_config.pipeline
        if prompt_embeds_mask is not None and bool(prompt_embeds_mask.all()):
            prompt_embeds_mask = None
        timestep = (t.expand(latents.shape[0]) / 1000).to(torch.bfloat16)  # the bug
        return self.transformer(
            hidden_states=latents,
            timestep=timestep.float(),
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            img_shapes=build_img_shapes(pipeline.height, pipeline.width, latents.shape[0]),
            return_dict=False,
        )[0]


def make_rollout(config):
    return Rollout(config)


def make_trainer(config):
    return DiffusionActor(config)
