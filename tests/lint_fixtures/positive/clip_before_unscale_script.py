"""clip-before-unscale in a script's top-level training loop (no function around it). Written for the lint's
tests.

Lint fixture: parsed, never imported or run.
"""

import torch

model = torch.nn.Linear(16, 16).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.cuda.amp.GradScaler()

for batch in torch.randn(100, 8, 16).cuda():
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch).pow(2).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: clip-before-unscale
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
