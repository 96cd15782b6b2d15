"""verl-omni (Qwen-Image): the actor forwards one sample at a time; the rollout batched four per forward.

Float32 rounding of a forward that depends on its batch-mates: whether it shows depends on this CPU's kernels
(a case that passes here has nothing to diagnose)."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="batch-composition", side="trainer", settings=settings("verl_omni"))


class Actor(DiffusionActor):
    def __call__(self, data, *, micro_batch_size):
        return self.compute_log_prob(data, 1)  # the difference: ppo_micro_batch_size_per_gpu = 1


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
