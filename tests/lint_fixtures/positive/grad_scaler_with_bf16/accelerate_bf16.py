"""grad-scaler-with-bf16 with accelerate's bf16 mixed precision.

Lint fixture: parsed, never imported or run.
"""

import torch
from accelerate import Accelerator


def main(model, optimizer, loader):
    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scaler = torch.amp.GradScaler("cuda")  # expect: grad-scaler-with-bf16
    for batch in loader:
        with accelerator.autocast():
            loss = model(batch).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
