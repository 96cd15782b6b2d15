"""grad-scaler-with-bf16 near miss: fp16 needs the scaler.

Lint fixture: parsed, never imported or run.
"""

import torch


def train(model, optimizer, loader):
    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
