"""grad-scaler-with-bf16: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import torch


def train(model, optimizer, loader):
    scaler = torch.cuda.amp.GradScaler()  # expect: grad-scaler-with-bf16
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
