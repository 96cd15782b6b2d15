"""verl-omni (Qwen-Image): the actor's LoRA has lora_dropout=0.1, and it recomputes the old log-probs with its module
still in train() mode (no eval context around compute_log_prob), so the dropout is active; the rollout's copy runs
in eval mode."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, add_policy_lora, settings

CASE = dict(expected="train-mode", side="trainer", settings=settings("verl_omni"))


class RolloutAdapter(QwenImageRolloutAdapter):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.transformer, lora_dropout=0.1)
        self.transformer.eval()


class Actor(DiffusionActor):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.module, lora_dropout=0.1)

    def compute_log_prob(self, data, micro_batch_size):
        self.module.train()  # the bug: left in train mode from the update step
        return super().compute_log_prob(data, micro_batch_size)


def make_rollout(config):
    return RolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
