"""On CUDA the question is the consuming stream's, not the host's: checked on the suite's CPU model of
streams and events (``tests/support/streams/sim.py``), whose vector clocks are the detector's own.

The collectives are real (a one-rank gloo group); the model says which stream is current, which
tensors are device memory (all of them here) and how streams and events order each other. A
``work.wait()`` orders the stream current when it is called (NCCL's ``WorkNCCL::wait``: the current
stream waits on the end event), a future's ``wait()`` likewise, its ``value()`` nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from overlapddp.sanitize import READ, WRITE, detect
from overlapddp.sanitize.clocks import StreamClocks
from tests.support.streams.sim import DEVICE, Sim, SimEvent


class SimStreams:
    """The detector's stream model over a :class:`Sim`: its clocks, its current stream, its memory."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.clocks: StreamClocks = sim.clocks

    def current(self) -> str:
        return self.sim.current.name

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self.sim.place(tensor) == DEVICE

    def after_op(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        return None

    def patches(self) -> list[tuple[Any, str, Any]]:
        return []


@pytest.fixture
def sim(one_rank) -> Sim:
    return Sim()


def _kinds(findings: list[Any]) -> list[str]:
    return [f.kind for f in findings]


def test_a_host_wait_on_one_stream_does_not_order_a_read_on_another(sim):
    side = sim.stream("side")
    with detect(streams=SimStreams(sim), echo=False) as findings:
        grad = torch.ones(4)
        work = dist.all_reduce(grad, async_op=True)
        work.wait()  # on the default stream: it waits, the side stream does not
        with sim.use(side):
            grad.sum()
        assert _kinds(findings) == [READ]
        side.wait_stream(sim.default)  # now it has
        with sim.use(side):
            grad.sum()
        assert _kinds(findings) == [READ]
        grad.mul_(2)  # the default stream waited: its write is ordered too
    assert _kinds(findings) == [READ]


def test_an_event_recorded_after_the_wait_orders_its_waiters_one_recorded_before_does_not(sim):
    side = sim.stream("side")
    with detect(streams=SimStreams(sim), echo=False) as findings:
        grad = torch.ones(4)
        work = dist.all_reduce(grad, async_op=True)
        early = SimEvent(sim)
        early.record()  # before the wait: it carries nothing of the collective
        work.wait()
        late = SimEvent(sim)
        late.record()
        with sim.use(side):
            side.wait_event(early)
            grad.add_(1)
        assert _kinds(findings) == [WRITE]
        with sim.use(side):
            side.wait_event(late)
            grad.add_(1)
    assert _kinds(findings) == [WRITE]


def test_a_wait_on_the_reading_stream_orders_it(sim):
    side = sim.stream("side")
    with detect(streams=SimStreams(sim), echo=False) as findings:
        grad = torch.ones(4)
        work = dist.all_reduce(grad, async_op=True)
        with sim.use(side):
            work.wait()  # NCCL: the side stream waits on the end event
            grad.sum()
    assert findings == []


def test_a_futures_value_orders_no_stream_its_wait_does(sim):
    with detect(streams=SimStreams(sim), echo=False) as findings:
        grad = torch.ones(4)
        future = dist.all_reduce(grad, async_op=True).get_future()
        future.value()  # the host has it; no stream waited
        grad.sum()
        assert _kinds(findings) == [READ]
        future.wait()
        grad.sum()
    assert _kinds(findings) == [READ]


def test_host_memory_is_the_hosts_to_wait_for_even_in_a_cuda_program(sim):
    with detect(streams=SimStreams(sim), echo=False) as findings:
        grad = torch.ones(4)
        sim.tag(grad, "host", "test")  # pageable host memory: gloo on CPU tensors
        work = dist.all_reduce(grad, async_op=True)
        with sim.use(sim.stream("side")):
            work.wait()  # the host waited: every stream's later work is after it
        grad.sum()
    assert findings == []
