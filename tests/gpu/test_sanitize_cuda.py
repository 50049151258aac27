"""The race detector on a real GPU (one rank, a world-size-1 NCCL group): the consuming stream's wait
is what counts, not the host's; ``--force`` keeps a clean loop's bits and shows a racy read as NaN.

The same rules run without a GPU on the suite's stream model (tests/sanitize/test_cuda_model.py);
here the streams and events are torch.cuda's own, followed by the detector's patches
(overlapddp/sanitize/streams.py). Skips without CUDA or NCCL.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from overlapddp.sanitize import READ, detect

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU and NCCL")


@pytest.fixture(scope="module")
def nccl_rank():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=device)
    yield device
    dist.destroy_process_group()


def _kinds(findings) -> list[str]:
    return [f.kind for f in findings]


def test_a_host_side_wait_does_not_order_another_stream(nccl_rank):
    side = torch.cuda.Stream()
    with detect(echo=False) as findings:
        grad = torch.ones(1024, device=nccl_rank)
        work = dist.all_reduce(grad, async_op=True)
        work.wait()  # the current (default) stream waits; the side stream does not
        with torch.cuda.stream(side):
            grad.sum()
        assert _kinds(findings) == [READ]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            grad.sum()
        torch.cuda.synchronize()
    assert _kinds(findings) == [READ]


def test_a_wait_on_the_reading_stream_or_an_event_after_it_orders_the_read(nccl_rank):
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with detect(echo=False) as findings:
        grad = torch.ones(1024, device=nccl_rank)
        work = dist.all_reduce(grad, async_op=True)
        with torch.cuda.stream(side):
            work.wait()
            grad.sum()
            done = torch.cuda.Event()
            done.record()
        other.wait_event(done)
        with torch.cuda.stream(other):
            grad.add_(1)
        torch.cuda.synchronize()
    assert findings == []


def test_a_futures_value_orders_no_stream_and_a_device_synchronize_orders_all(nccl_rank):
    with detect(echo=False) as findings:
        grad = torch.ones(1024, device=nccl_rank)
        future = dist.all_reduce(grad, async_op=True).get_future()
        future.value()
        grad.sum()
        assert _kinds(findings) == [READ]
        torch.cuda.synchronize()  # the host saw the communication stream finish: every later access is after it
        with torch.cuda.stream(torch.cuda.Stream()):
            grad.sum()
    assert _kinds(findings) == [READ]


def _loop(device: torch.device, racy: bool) -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.randn(64, 64, device=device)
    for _ in range(3):
        grad = weight.sin()
        work = dist.all_reduce(grad, async_op=True)
        if racy:
            weight -= 0.1 * grad  # read before the wait
            work.wait()
        else:
            work.wait()
            weight -= 0.1 * grad
    torch.cuda.synchronize()
    return weight


def test_force_keeps_a_clean_loops_bits_and_shows_a_racy_read_as_nan(nccl_rank):
    bare = _loop(nccl_rank, racy=False)
    with detect(force=True, echo=False) as findings:
        forced = _loop(nccl_rank, racy=False)
    assert findings == [] and torch.equal(bare, forced)
    with detect(force=True, echo=False) as findings:
        racy = _loop(nccl_rank, racy=True)
    assert _kinds(findings) == [READ] and racy.isnan().any()
