"""A hand-written data-parallel loop with a race: the optimizer steps before the gradients' all-reduces
have completed, so each rank steps on (part of) its own local gradient, intermittently.

    torchrun --standalone --nproc-per-node 2 -m overlapddp.sanitize tests/sanitize/scripts/racy_manual.py
"""

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + dist.get_rank())  # each rank its own data

for step in range(5):
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    opt.step()  # the bug: the all-reduces may still be writing these gradients
    for work in works:
        work.wait()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
