"""clip-before-unscale: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import torch
from torch import nn


def train_step(model, optimizer, scaler, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # expect: clip-before-unscale
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class Trainer:
    def step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch).mean()
        self.grad_scaler.scale(loss).backward()
        nn.utils.clip_grad_value_(self.model.parameters(), 0.5)  # expect: clip-before-unscale
        self.grad_scaler.unscale_(self.optimizer)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
