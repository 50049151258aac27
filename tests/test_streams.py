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
from tests.streams.sites import call_sites


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
    [released] = [m for m in call_sites() if m.kind == "wait" and '"released"' in m.text]

    def findings(backward: tuple[str, ...]) -> list[str]:
        sim = Sim(mutant=released)
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


# -- host memory -------------------------------------------------------------------------------------


def test_a_host_read_of_pinned_memory_needs_the_host_to_wait_not_a_stream():
    sim = Sim()
    with simulate(sim):
        side = sim.stream("side")
        written = torch.ones(2)
        pinned = torch.empty(2, pin_memory=True)
        assert pinned.is_pinned()
        side.wait_stream(sim.default)
        with sim.use(side):
            pinned.copy_(written, non_blocking=True)  # a device access of host memory, on side
            copied = torch.cuda.Event()
            copied.record(side)
        sim.default.wait_event(copied)  # orders the default stream, not the host
        float(pinned[0])
        assert len(sim.findings) == 1 and "read by aten._local_scalar_dense.default on host races" in sim.findings[0]
        sim.findings.clear()
        copied.synchronize()
        float(pinned[1]), pinned.tolist(), pinned.numpy(), pinned.data_ptr()
    assert sim.findings == []


def test_a_blocking_copy_to_the_host_waits_and_a_host_write_orders_later_copies():
    sim = Sim()
    with simulate(sim):
        side = sim.stream("side")
        device = torch.ones(3)
        host = torch.frombuffer(bytearray(12), dtype=torch.float32)
        side.wait_stream(sim.default)
        with sim.use(side):
            host.copy_(device)  # pageable: blocking, the host waits for side
        host.add_(1)  # a host op, after the copy
        with sim.use(side):
            device.copy_(host, non_blocking=True)  # the host stages the source at once
    assert sim.findings == []


def test_tolist_of_device_memory_reads_on_the_current_stream(one_rank):
    import torch.distributed as dist

    sim = Sim()
    with simulate(sim):
        reduced = torch.ones(2)
        work = dist.all_reduce(reduced, async_op=True)
        reduced.tolist()  # not ordered after the collective
        assert len(sim.findings) == 1 and "Tensor.tolist on default races the write by nccl" in sim.findings[0]
        sim.findings.clear()
        work.wait()
        reduced.tolist()
    assert sim.findings == []


def test_numpy_of_device_memory_is_a_finding_only_for_the_package():
    sim = Sim()
    with simulate(sim):
        torch.ones(2).numpy()  # a test's own call: not the package's
    assert sim.findings == []


# -- NCCL and the engine, torch 2.11 to 2.14 -----------------------------------------------------------


def test_nccl_work_wait_releases_the_stash(one_rank):
    import torch.distributed as dist

    for waited in (False, True):
        sim = Sim()
        with simulate(sim):
            side = sim.stream("side")
            tensor = torch.ones(2)  # allocated on the default stream
            work = dist.all_reduce(tensor, async_op=True)
            if waited:
                with sim.use(side):
                    work.wait()  # side is ordered after the collective; the default stream is not
            del tensor, work
        assert bool(sim.findings) is waited, sim.findings


def test_a_synchronous_nccl_collective_runs_on_the_current_stream_and_keeps_nothing(one_rank):
    import torch.distributed as dist

    sim = Sim()
    with simulate(sim):
        side = sim.stream("side")
        tensor = torch.ones(2)
        side.wait_stream(sim.default)
        with sim.use(side):
            dist.all_reduce(tensor)
        assert "nccl" not in sim.default.clock and sim.streams["nccl"].clock == {"nccl": 0}
        del tensor  # used on side, never recorded for it
    assert len(sim.findings) == 1 and "no record_stream for side" in sim.findings[0]


def test_a_child_future_without_device_memory_orders_nothing(one_rank):
    import torch.distributed as dist

    def findings(callback) -> list[str]:
        sim = Sim()
        with simulate(sim):
            tensor = torch.ones(2)
            dist.all_reduce(tensor, async_op=True).get_future().then(callback).wait()
            tensor.sum()
        return sim.findings

    assert findings(lambda f: f.value()[0]) == []  # events on the pool stream, after the collective
    assert any("races the write by nccl" in f for f in findings(lambda f: None))


def test_final_callbacks_wait_for_the_leaf_streams_only():
    from overlapddp import torch_compat

    sim = Sim()
    reads: list[list[str]] = []
    with simulate(sim):
        weight = torch.nn.Parameter(torch.ones(2))
        held = sim.stream("held")
        with sim.use(held):
            sim.autograd.hold([weight])  # its AccumulateGrad is kept from here: it runs on held
        seen: list[torch.Tensor] = []

        def callback() -> None:
            weight.grad.sum()  # written on the leaf stream: ordered
            reads.append(list(sim.findings))
            seen[0].sum()  # written on the root's stream, not a leaf stream: not ordered
            reads.append(list(sim.findings))

        def on_hidden(grad: torch.Tensor) -> None:
            seen.append(grad * 1)
            torch_compat._ENGINE.queue_callback(callback)

        forward, side = sim.stream("forward"), sim.stream("side")
        forward.wait_stream(sim.default)
        with sim.use(forward):
            hidden = weight * 2
            hidden.register_hook(on_hidden)
            loss = hidden.sum()
        side.wait_stream(forward)
        with sim.use(side):
            torch.autograd.backward(loss)
    assert reads[0] == [] and len(reads[1]) == 1 and "on side races the write by aten.mul.Tensor on forward" in reads[1][0]
