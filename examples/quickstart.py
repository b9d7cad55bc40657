"""Train a small MLP regression with Dobb (hidden matrices) + AdamW (biases); print losses."""

import torch
from torch import nn

import dobb

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
)
teacher = torch.randn(64, 8)

groups = dobb.param_groups(model, exclude="^$")  # no embeddings or head in this model
# the recommended Dobb (the defaults) at the registry's lr for this width
opt = dobb.Dobb(groups, lr=dobb.recommended_lr("dobb", width=256), weight_decay=0.01)
opt.track(model)  # forward pre-hooks collect the activation statistics
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)

for step in range(200):
    x = torch.randn(128, 64)
    loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step % 20 == 0 or step == 199:
        print(f"step {step:3d}  loss {loss.item():.4f}")
