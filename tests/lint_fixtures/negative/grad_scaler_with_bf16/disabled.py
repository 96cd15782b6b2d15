"""grad-scaler-with-bf16 near miss: a disabled scaler in bf16 code (a no-op, kept for one code path).

Lint fixture: parsed, never imported or run.
"""

import torch


def train(model, optimizer, batch):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
