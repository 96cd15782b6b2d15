"""grad-scaler-with-bf16 through a dtype name and the torch.amp spelling.

Lint fixture: parsed, never imported or run.
"""

import torch
from torch.amp import GradScaler

weight_dtype = torch.bfloat16


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = GradScaler("cuda", enabled=True)  # expect: grad-scaler-with-bf16

    def training_step(self, batch):
        with torch.autocast(device_type="cuda", dtype=weight_dtype):
            loss = self.model(batch).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
