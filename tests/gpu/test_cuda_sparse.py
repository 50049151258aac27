"""CUDA: sparse gradients (``Embedding(sparse=True)``) against stock DDP, two ranks on one GPU over gloo;
on an NCCL group, which cannot all-reduce them, the wrapper refuses them at construction.

Skips without a GPU; not yet run on a GPU in this project (none was available when it was written).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.gpu.scenarios import group_for
from tests.support.multiprocess import run_ranks
from tests.test_sparse import Recommender, _batch, _differences

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(rank: int, world_size: int) -> list[list[str]]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ddp = DistributedDataParallel(Recommender().to(device), device_ids=[0])
    ours = OverlapDDP(Recommender().to(device), device_ids=[0])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ours)]
    per_step = []
    for step in range(4):
        users, items, offsets, target = (t.to(device) for t in _batch(rank, step))
        for model in (ddp, ours):
            nn.functional.mse_loss(model(users, items, offsets), target).backward()
        torch.cuda.synchronize()
        found = _differences(ddp, ours)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        per_step.append(found + _differences(ddp, ours))
    torch.cuda.synchronize()
    return per_step


def test_sparse_gradients_are_bit_equal_to_ddp_on_cuda():
    for rank, per_step in enumerate(run_ranks(2, _train)):
        assert per_step == [[]] * 4, f"rank {rank}: {per_step}"


def _refused_on_nccl(rank: int, world_size: int) -> str:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group, _ = group_for("nccl")
    try:
        OverlapDDP(Recommender().to(device), device_ids=[0], process_group=group)
    except ValueError as error:
        return str(error)
    return "not refused"


@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL")
def test_sparse_gradients_on_nccl_are_refused_at_construction_naming_them():
    [message] = run_ranks(1, _refused_on_nccl)
    assert "produce sparse gradients" in message and "gloo" in message, message
