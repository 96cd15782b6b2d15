"""Shaped like verl's data-parallel actor, for a diffusion policy (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch


class DataParallelDiffusionActor:
    def __init__(self, config, module, optimizer):
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")  # expect: grad-scaler-with-bf16

    def compute_log_prob(self, batch):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            return self.module.log_prob(batch["latents"], batch["next_latents"], batch["timesteps"])

    def update_policy(self, batch):
        log_prob = self.compute_log_prob(batch)
        ratio = torch.exp(log_prob - batch["old_log_probs"])
        loss = -(batch["advantages"] * ratio.clamp(1 - self.config.clip_ratio, 1 + self.config.clip_ratio)).mean()
        self.scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.grad_clip)  # expect: clip-before-unscale
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return {"actor/grad_norm": grad_norm.item(), "actor/pg_loss": loss.item()}
