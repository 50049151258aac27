"""The stream race detector (tests/streams/) on every CUDA path, under the NCCL model, and on the CPU
path with gloo's worker thread as a stream: each scenario must leave no read, write or free unordered.

The mutation matrix (each wait and ``record_stream`` left out) is ``tools/stream_mutations.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.streams import scenarios
from tests.streams.backends import simulate
from tests.streams.sim import Sim


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_scenario_has_no_unordered_access(one_rank, name):
    assert scenarios.run(name) == []


# -- the detector itself -----------------------------------------------------------------------------


def test_a_read_on_another_stream_races_until_that_stream_waits():
    sim = Sim()
    with simulate(sim):
        written = torch.ones(4)  # on the default stream
        side = sim.stream("side")
        with sim.use(side):
            written.sum()
        assert len(sim.findings) == 1 and "races the write" in sim.findings[0]
        sim.findings.clear()
        side.wait_stream(sim.default)
        with sim.use(side):
            written.sum()
    assert sim.findings == []


def test_views_of_a_flat_buffer_alias_it_and_a_write_after_a_read_races():
    sim = Sim()
    with simulate(sim):
        flat = torch.zeros(6)
        view = flat[2:4]
        side = sim.stream("side")
        side.wait_stream(sim.default)
        with sim.use(side):
            view.sum()  # reads the buffer on side
        flat.fill_(1.0)  # the default stream writes it without waiting for side
    assert len(sim.findings) == 1 and "races the read" in sim.findings[0]


def test_a_free_needs_record_stream_for_a_stream_that_used_the_memory():
    for recorded in (False, True):
        sim = Sim()
        with simulate(sim):
            tensor = torch.ones(3)
            side = sim.stream("side")
            side.wait_stream(sim.default)
            with sim.use(side):
                tensor.sum()
            if recorded:
                sim.record_stream(tensor, side, "test")
            del tensor
        assert bool(sim.findings) is not recorded


def test_a_host_sync_orders_later_work_on_every_stream():
    sim = Sim()
    with simulate(sim):
        side = sim.stream("side")
        with sim.use(side):
            written = torch.ones(2)
            written.sum().item()  # the host waits for side
        written.sum()  # enqueued on default after the host saw side finish
    assert sim.findings == []


def test_a_missing_released_wait_shows_only_when_the_backward_stream_changes(one_rank):
    # The autograd engine makes forward's stream wait for the caller's at each backward; with one
    # backward stream that wait orders the next copy-in after the last copy-out by itself.
    def findings(backward: tuple[str, ...]) -> list[str]:
        sim = Sim(skip_waits=frozenset({"released"}))
        with simulate(sim):
            model = scenarios.wrap(sim)
            scenarios.train(sim, model, None, steps=3, forward="forward", backward=backward)
        return sim.findings

    assert findings(("backward",)) == []
    assert any("races" in f for f in findings(("backward A", "backward B")))


def test_the_cuda_clock_never_makes_the_communication_stream_wait_for_a_collective(one_rank):
    import torch.distributed as dist

    from overlapddp.tuning.clock import CudaClock

    sim = Sim()
    with simulate(sim):
        comm = sim.stream("comm")
        with sim.use(comm):
            work = dist.all_reduce(torch.ones(2), async_op=True)
            stamp = CudaClock(torch.device("cpu")).done(work.get_future())
        assert "nccl" not in comm.clock  # the tuned plan's timing: later launches are not held back
        assert stamp.clock.get("nccl", 0) > 0  # the stamp itself is after the collective


def test_the_communication_stream_has_high_priority(monkeypatch):
    from overlapddp.fence import CudaFence

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: made.append(priority) or object())
    CudaFence(torch.device("cpu"))
    assert made == [-1]
