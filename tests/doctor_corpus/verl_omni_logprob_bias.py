"""verl-omni (Qwen-Image): the actor's log-probs carry a constant 1e-6 (a stray epsilon in its Gaussian)."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="logprob-offset", side="trainer", settings=settings("verl_omni"))


class Actor(DiffusionActor):
    def forward_and_sample_previous_step(self, model_inputs, negative_model_inputs, scheduler_inputs, step):
        log_prob = super().forward_and_sample_previous_step(model_inputs, negative_model_inputs, scheduler_inputs, step)
        return log_prob + 1e-6  # the bug


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
