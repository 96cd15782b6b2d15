"""grad-scaler-with-bf16 near misses: a scaler switched on for fp16 only; bf16 without a scaler.

Lint fixture: parsed, never imported or run.
"""

import torch


def train(model, optimizer, loader, mixed_precision):
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=mixed_precision == "fp16")
    fp16_scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    for batch in loader:
        with torch.autocast("cuda", dtype=dtype):
            loss = model(batch).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return fp16_scaler


def train_bf16(model, optimizer, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch).mean()
    loss.backward()
    optimizer.step()
