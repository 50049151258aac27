"""CUDA: two ranks on one GPU (gloo over CUDA tensors), training on a non-default user stream, with
the communication stream delayed by sleep kernels; bit-equal to stock DDP every step.

Skips without a GPU. Not yet run on a GPU (see docs/cuda.md for what ran where).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.testing import delay_communication
from tests import models
from tests.gpu.scenarios import deterministic
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train_on_user_stream(rank: int, world_size: int, stage: str) -> list[bool]:
    deterministic()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ours = OverlapDDP(models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001)
    ddp_ref = DistributedDataParallel(models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp_ref, ours)]
    user_stream = torch.cuda.Stream()
    equal = []
    with delay_communication(ours, rank=1, seconds=0.02, stage=stage), torch.cuda.stream(user_stream):
        for step in range(4):
            inputs, target = (t.to(device) for t in models.batch("cnn_bn", rank, step))
            for wrapper, opt in zip((ddp_ref, ours), optimizers):
                models.loss_of(wrapper(inputs), target).backward()
                torch.cuda._sleep(10_000_000)  # a slow consumer stream must still see final values
                opt.step()
                opt.zero_grad()
            equal.append(all(torch.equal(a, b) for a, b in zip(ddp_ref.state_dict().values(), ours.state_dict().values())))
    torch.cuda.synchronize()
    return equal


@pytest.mark.parametrize("stage", ["launch", "completion"])
def test_user_stream_training_with_delayed_communication_is_bit_equal_to_ddp(stage):
    for rank, equal in enumerate(run_ranks(2, _train_on_user_stream, stage)):
        assert equal == [True] * 4, f"rank {rank}: {equal}"
