"""clip-before-unscale near misses: nothing here may be reported.

Lint fixture: parsed, never imported or run.
"""

import torch


def train_step(model, optimizer, scaler, batch):
    """The fix: unscale, clip, step."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()


def train_step_bf16(model, optimizer, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()


def train_step_accelerate(accelerator, model, optimizer, scaler, batch):
    loss = model(batch).mean()
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)


def clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def train_step_helper(model, optimizer, scaler, batch):
    scaler.scale(model(batch).mean()).backward()
    scaler.unscale_(optimizer)
    clip(model)
    scaler.step(optimizer)
    scaler.update()
