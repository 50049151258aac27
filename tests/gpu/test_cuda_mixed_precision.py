"""CUDA: ``mixed_precision`` against stock DDP's own (which runs only on CUDA), two ranks on one GPU.

Every parameter, gradient and buffer bit-equal every step, for a reduce dtype wider than the
parameter dtype and for the default (reduce in ``param_dtype``); two ranks over gloo and one over NCCL.
Skips without a GPU; not yet run on a GPU in this project (none was available when it was written).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP
from tests.gpu.scenarios import BACKENDS, group_for, world_size_of
from tests.support.multiprocess import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = {
    "bf16/fp32/bf16": (torch.bfloat16, torch.float32, torch.bfloat16),
    "fp16/None/None": (torch.float16, None, None),
}


def _net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8)).to(device)


def _train(rank: int, world_size: int, name: str, backend: str) -> list[list[str]]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group, _ = group_for(backend)
    config = _MixedPrecision(*CONFIGS[name])
    ddp = DistributedDataParallel(_net(device), device_ids=[0], mixed_precision=config, process_group=group)
    ours = OverlapDDP(_net(device), device_ids=[0], mixed_precision=config, process_group=group)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ddp, ours)]
    per_step = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
        for model in (ddp, ours):
            nn.functional.mse_loss(model(x).float(), y).backward()
        torch.cuda.synchronize()
        found = [n for (n, p), (_, q) in zip(ddp.named_parameters(), ours.named_parameters(), strict=False)
                 if p.grad is None or q.grad is None or not torch.equal(p.grad, q.grad)]
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        found += [n for (n, a), (_, b) in zip(ddp.state_dict().items(), ours.state_dict().items(), strict=False) if not torch.equal(a, b)]
        per_step.append(found)
    torch.cuda.synchronize()
    return per_step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_precision_is_bit_equal_to_ddp_on_cuda(name, backend):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    for rank, per_step in enumerate(run_ranks(world_size_of(backend), _train, name, backend)):
        assert per_step == [[]] * 4, f"{backend} rank {rank}: {per_step}"
