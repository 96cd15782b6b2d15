"""one-sided-precision-flag, false-positive class: a trainer that samples and trains in one process
(Flow-GRPO style); TF32 belongs to the process, so both halves run with it. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch
from accelerate import Accelerator

from diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
from rollout_buffer import RolloutBuffer


def main(config):
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    if config.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    buffer = RolloutBuffer()
    for epoch in range(config.num_epochs):
        buffer.add(pipeline_with_logprob(config.pipeline, config.prompts, epoch=epoch))
        accelerator.backward(buffer.loss())
