"""verl-omni (Qwen-Image): the actor drops ``encoder_hidden_states_mask``, so padded text tokens reach attention."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="text-conditioning", side="trainer", settings=settings("verl_omni"))


class Actor(DiffusionActor):
    def prepare_model_inputs(self, micro_batch, step):
        model_inputs, negative_model_inputs = super().prepare_model_inputs(micro_batch, step)
        model_inputs["encoder_hidden_states_mask"] = None  # the bug
        return model_inputs, negative_model_inputs


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
