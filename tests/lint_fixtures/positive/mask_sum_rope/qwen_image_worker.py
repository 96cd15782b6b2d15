"""mask-sum-rope, true positives: rollout-engine code known by its class name or by what it imports.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class vLLMQwenImageRollout:
    def text_seq_lens_of(self, mask):
        return [int(n) for n in torch.sum(mask, dim=1)]  # expect: mask-sum-rope

    def encoder_lengths(self, text_mask):
        self.encoder_seq_lens: list[int] = torch.count_nonzero(text_mask, dim=1).tolist()  # expect: mask-sum-rope
        return self.encoder_seq_lens
