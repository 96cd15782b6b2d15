"""verl-omni (Qwen-Image), true CFG 4.0: the actor combines the two predictions without the norm rescale."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("verl_omni", true_cfg_scale=4.0))


class Actor(DiffusionActor):
    def predict_noise(self, model_inputs, negative_model_inputs):
        cond, uncond = self.forward(model_inputs), self.forward(negative_model_inputs)
        return uncond + self.model_config.pipeline.true_cfg_scale * (cond - uncond)  # the bug: no norm rescale


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
