"""CUDA: training on a non-default user stream, with the communication stream delayed by sleep kernels;
bit-equal to stock DDP every step. Two ranks on one GPU over gloo, and one rank over NCCL.

Skips without a GPU. Not yet run on a GPU (see docs/cuda.md for what ran where).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.testing import delay_communication
from tests.gpu.scenarios import BACKENDS, deterministic, group_for, world_size_of
from tests.support import models
from tests.support.multiprocess import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train_on_user_stream(rank: int, world_size: int, stage: str, backend: str) -> list[bool]:
    deterministic()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group, delayed_rank = group_for(backend)
    ours = OverlapDDP(models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001, process_group=group)
    ddp_ref = DistributedDataParallel(
        models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001, process_group=group
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp_ref, ours)]
    user_stream = torch.cuda.Stream()
    equal = []
    delayed = delay_communication(ours, rank=delayed_rank, seconds=0.02, stage=stage)
    with delayed, torch.cuda.stream(user_stream):
        for step in range(4):
            inputs, target = (t.to(device) for t in models.batch("cnn_bn", rank, step))
            for wrapper, opt in zip((ddp_ref, ours), optimizers, strict=False):
                models.loss_of(wrapper(inputs), target).backward()
                torch.cuda._sleep(10_000_000)  # a slow consumer stream must still see final values
                opt.step()
                opt.zero_grad()
            equal.append(all(torch.equal(a, b) for a, b in zip(ddp_ref.state_dict().values(), ours.state_dict().values(), strict=False)))
    torch.cuda.synchronize()
    return equal


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", ["launch", "completion"])
def test_user_stream_training_with_delayed_communication_is_bit_equal_to_ddp(stage, backend):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    for rank, equal in enumerate(run_ranks(world_size_of(backend), _train_on_user_stream, stage, backend)):
        assert equal == [True] * 4, f"{backend} rank {rank}: {equal}"
