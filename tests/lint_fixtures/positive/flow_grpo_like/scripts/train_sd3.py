"""Shaped like Flow-GRPO's training script (written for the lint's tests): one process samples and trains.

Lint fixture: parsed, never imported or run.
"""

import random

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main(config, pipeline, train_dataloader, optimizer, transformer):
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    set_seed(config.seed, device_specific=True)  # expect: non-launcher-seed
    # One process does both halves: a process-wide flag here is not one-sided.
    torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32

    for epoch in range(config.num_epochs):
        samples = []
        for prompts, prompt_metadata in train_dataloader:
            # The window comes from the global generator that set_seed seeded per device (reported there).
            sde_window_start = random.randint(0, config.sample.num_steps - config.sample.sde_window_size)
            images, latents, log_probs = pipeline(prompts, sde_window_start=sde_window_start)
            samples.append({"latents": latents, "log_probs": log_probs})

        for sample in samples:
            with accelerator.accumulate(transformer):
                loss = compute_loss(transformer, sample, config)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(transformer.parameters(), config.train.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()


def compute_loss(transformer, sample, config):
    return transformer(sample["latents"]).mean()
