"""CUDA: the tuned plan times work with events, not the host clock, and trains on a GPU.

Skips without a GPU. Not yet run on a GPU in this project's CI (which has none).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.clock import CudaClock, clock_for
from overlapddp.layout import tuner
from tests.gpu.scenarios import BACKENDS, group_for, world_size_of
from tests.support import models
from tests.support.multiprocess import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP_CYCLES = 50_000_000  # a few tens of milliseconds of GPU time on current GPUs


def test_event_stamps_time_the_gpu_work_the_host_does_not_wait_for():
    device = torch.device("cuda", 0)
    clock = clock_for(device)
    assert isinstance(clock, CudaClock)
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        host_start = time.perf_counter()
        origin = clock.now()
        torch.cuda._sleep(SLEEP_CYCLES)  # queued: the host returns at once
        end = clock.now()
        host_s = time.perf_counter() - host_start
    gpu_s = clock.seconds(origin, [end])[0]
    assert gpu_s > 5 * host_s, (gpu_s, host_s)


def test_a_collective_counts_as_done_when_its_stream_finishes_it():
    # Stand-in for a collective: work on a side stream whose future completes at once on the host,
    # as NCCL's does at enqueue. The completion stamp must wait for the work, not for the future.
    device = torch.device("cuda", 0)
    clock = CudaClock(device)
    side, comm = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(comm):
        origin = clock.now()
    with torch.cuda.stream(side):
        side.wait_stream(comm)
        torch.cuda._sleep(SLEEP_CYCLES)
        future = torch.futures.Future(devices=[device])
        future.set_result(torch.zeros(1, device=device))  # recorded on the side stream, after the sleep
    with torch.cuda.stream(comm):
        done = clock.done(future)
        queued = clock.now()
    finished, idle = clock.seconds(origin, [done, queued])
    assert finished > 0.005 and idle >= finished


def _tuned_on_cuda(rank: int, world_size: int, backend: str) -> dict[str, object]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group, _ = group_for(backend)
    ddp = DistributedDataParallel(
        models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001, process_group=group
    )
    ours = OverlapDDP(
        models.build("cnn_bn").to(device), device_ids=[0], bucket_cap_mb=0.001, bucket_plan="tuned", process_group=group
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, ours)]
    ours.attach_optimizer(optimizers[1], overlap=True)
    equal, layouts = [], []
    for step in range(2 + tuner.TUNING_ITERATIONS):
        inputs, target = (t.to(device) for t in models.batch("cnn_bn", rank, step))
        for wrapper, opt in zip((ddp, ours), optimizers, strict=False):
            models.loss_of(wrapper(inputs), target).backward()
            opt.step()
            opt.zero_grad()
        equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False)))
        layouts.append(ours.bucket_indices())
    torch.cuda.synchronize()
    return {"equal": equal, "layouts": layouts, "state": ours.bucket_state()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_tuned_plan_on_cuda_settles_on_one_layout_on_every_rank_bit_equal_to_ddp(backend):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    per_rank = run_ranks(world_size_of(backend), _tuned_on_cuda, backend)
    for result in per_rank:
        assert all(result["equal"]), result["equal"]
        assert result["state"]["tuned_buckets"] == result["layouts"][-1]
        assert result["layouts"] == per_rank[0]["layouts"]
