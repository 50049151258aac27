"""The stream race detector (tests/support/streams/) on every CUDA path, under the NCCL model, and on the CPU
path with gloo's worker thread as a stream: each scenario must leave no read, write or free unordered,
and together they must run every line of the CUDA path (the coverage gate, with its exceptions).

The mutation matrix (every wait, record_stream, event record and host read, one call site at a time)
is ``tools/stream_mutations.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.streams import scenarios
from tests.support.streams.backends import simulate
from tests.support.streams.coverage import ROOT, LineTracer, cuda_lines
from tests.support.streams.sim import Sim
from tests.support.streams.sites import call_sites, is_cast

TRACED = LineTracer()  # the lines the scenarios ran, for the coverage gate
TRACED_SCENARIOS: set[str] = set()


def _run_traced(name: str) -> list[str]:
    with TRACED:
        findings = scenarios.run(name)
    TRACED_SCENARIOS.add(name)
    return findings


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_scenario_has_no_unordered_access(one_rank, name):
    assert _run_traced(name) == []


# Lines of the CUDA path no scenario runs, each with why: (file, the line's text or its start, why).
NOT_RUN = [
    ("overlapddp/device_streams.py", "return", "record_stream of host memory: no call site hands the kit any; "
     "test_cuda_kit_maps_each_call_onto_torch_cuda runs it"),
    ("overlapddp/device_streams.py", "return torch.cuda.device(device)", "needs a CUDA device object; "
     "tests/test_cuda_logic.py patches torch.cuda.device to check it"),
    ("overlapddp/device_streams.py", "yield", "side_stream without device ids (the CPU path): "
     "tests/integrations/test_frameworks.py runs it"),
    ("overlapddp/fence.py", "pass", "a dropped collective whose future raises: the model's collectives never fail "
     "(gloo failures are tests/test_reliability.py's)"),
    ("overlapddp/integrations/ray.py", "if torch.cuda.is_available() and device.type",
     "Ray's prepare_model needs a Ray worker; tests/integrations/test_ray.py runs it"),
    ("overlapddp/integrations/ray.py", 'kwargs = {"device_ids": [device]', "the same, on a GPU worker only"),
    ("overlapddp/testing.py", "self._on_cuda[bucket] = buffer.is_cuda",
     "race forcing for the GPU tests (delay_communication), run by tests/gpu"),
    ("overlapddp/testing.py", "khz = getattr(torch.cuda.get_device_properties(", "a sleep kernel's length: GPU only"),
    ("overlapddp/testing.py", "if torch.cuda.is_available() and torch.cuda.current_stream()",
     "race forcing on a GPU stream (tests/gpu)"),
    ("overlapddp/testing.py", "_device_sleep(seconds)", "the same"),
    ("overlapddp/testing.py", "future.wait()", "drains the collectives a GPU mutation run left unwaited (tests/gpu)"),
    ("overlapddp/testing.py", "work.wait()", "delay_parameter_gathers on a rank that receives a parameter (two ranks, "
     "on a thread of its own): tests/shard/test_sharded_optimizer.py runs it"),
    ("overlapddp/torch_compat.py", 'sleep = getattr(torch.cuda, "_sleep", None)', "torch.cuda._sleep: GPU only"),
]


def _listed(path: str, text: str) -> tuple[str, str, str] | None:
    return next((entry for entry in NOT_RUN if entry[0] == path and
                 (text == entry[1] or (len(entry[1]) > 12 and text.startswith(entry[1])))), None)


def test_the_scenarios_run_every_line_of_the_cuda_path_and_every_mutable_call(one_rank):
    import linecache

    for name in scenarios.SCENARIOS:
        if name not in TRACED_SCENARIOS:  # this test run alone
            _run_traced(name)
    wanted = cuda_lines()
    for site in call_sites():
        if not is_cast(site):  # float/int/bool: a host read only of a tensor, which only a run tells
            wanted.setdefault(site.path, set()).add(site.first)
    unrun, stale = [], set(NOT_RUN)
    for path, lines in sorted(wanted.items()):
        for line in sorted(lines):
            text = linecache.getline(str(ROOT / path), line).strip()
            listed = _listed(path, text)
            stale.discard(listed)  # type: ignore[arg-type]
            if (path, line) not in TRACED.ran and listed is None:
                unrun.append(f"{path}:{line}: {text}")
    assert unrun == [], "lines of the CUDA path no scenario runs (add a scenario, or list it with why):\n" + \
        "\n".join(unrun)
    assert not stale, f"NOT_RUN lists lines that are no longer on the CUDA path: {sorted(stale)}"


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
                sim.record_stream(tensor, side)
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
    [released] = [m for m in call_sites() if m.kind == "wait" and "'released'" in m.text]

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

    from overlapddp.clock import CudaClock

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


def test_accumulation_runs_on_its_nodes_creation_stream_and_final_callbacks_wait_for_it():
    from overlapddp import torch_compat

    sim = Sim()
    seen: list = []
    with simulate(sim):
        weight = torch.nn.Parameter(torch.ones(2))
        held = sim.stream("held")
        with sim.use(held):
            sim.autograd.hold([weight])  # its AccumulateGrad is made here and kept (A2)

        def callback() -> None:
            seen.append(sim.current.name)
            weight.grad.sum()  # written on held, a leaf stream: ordered (A4)

        weight.register_post_accumulate_grad_hook(lambda p: (seen.append(sim.current.name),
                                                             torch_compat._ENGINE.queue_callback(callback)))
        forward, side = sim.stream("forward"), sim.stream("side")
        forward.wait_stream(sim.default)
        with sim.use(forward):
            loss = (weight * 2).sum()
        side.wait_stream(forward)
        with sim.use(side):
            torch.autograd.backward(loss)
    assert seen == ["held", "side"] and sim.findings == []


# -- the CUDA kit against a recording double of torch.cuda -----------------------------------------------


class _Recorder:
    """Stands in for torch.cuda's streams and events: each call is noted as (object, method, arguments)."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: self.calls.append((self.name, method, args, kwargs))

    def __repr__(self) -> str:
        return self.name


def test_cuda_kit_maps_each_call_onto_torch_cuda(monkeypatch):
    from contextlib import nullcontext

    from overlapddp import device_streams
    from overlapddp.device_streams import CudaKit

    calls: list = []
    made = iter(["s1", "s2"])
    monkeypatch.setattr(device_streams, "Future", lambda devices: calls.append(("Future", devices)) or "made")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: calls.append(("Stream", device, priority))
                        or _Recorder(next(made), calls))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: _Recorder("e", calls))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(("current", device)) or "cur")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: calls.append(("use", stream)) or nullcontext())
    device = torch.device("cuda", 1)
    kit = CudaKit(device)
    comm, other = kit.new_stream(high_priority=True), kit.new_stream()
    event = kit.new_event()
    assert kit.current_stream() == "cur"
    with kit.use(comm):
        pass
    kit.wait_event(comm, event, "produced")
    kit.wait_stream(comm, other, "reader")
    future = torch.futures.Future()
    future.set_result(7)
    assert kit.wait_future(future, "collective") == 7
    assert kit.new_future() == "made"
    kit.record_stream(torch.ones(2), comm)  # host memory: nothing to record
    assert calls == [
        ("Stream", device, -1), ("Stream", device, 0), ("current", device), ("use", comm),
        ("s1", "wait_event", (event,), {}),  # the waiting stream waits, on the event
        ("s1", "wait_stream", (other,), {}),  # the waiting stream waits, for the other
        ("Future", [device]),  # a future that records events on the device (one without devices orders nothing)
    ]


def test_cuda_kit_records_a_device_tensor_and_a_sparse_ones_parts(monkeypatch):
    from overlapddp.device_streams import CudaKit

    recorded: list = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: recorded.append((t.shape, t.dtype, stream)))
    kit = CudaKit(torch.device("cuda", 0))
    kit.record_stream(torch.ones(3), "s")
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)).coalesce()
    kit.record_stream(sparse, "s")
    assert recorded == [((3,), torch.float32, "s"), ((1, 2), torch.int64, "s"), ((2,), torch.float32, "s")]


# -- the races the host-memory model exists for, planted in the library's own paths -------------------------


def test_the_token_count_read_after_a_stream_wait_instead_of_an_event_synchronize_races(one_rank, monkeypatch):
    from overlapddp.bucket.token_weighting import TokenCount

    real_launch = TokenCount.launch

    def launch_then_wait_on_a_stream(self, process_group) -> None:
        real_launch(self, process_group)
        copied = self._copied

        class StreamWaitOnly:  # what `synchronize()` replaced by a stream wait would order: no host read
            def synchronize(self) -> None:
                torch.cuda.current_stream().wait_event(copied)

        self._copied = StreamWaitOnly()

    monkeypatch.setattr(TokenCount, "launch", launch_then_wait_on_a_stream)
    findings = scenarios.run("token weighting")
    assert any("read by aten._local_scalar_dense.default on host races the write by aten.copy_.default on tokens"
               in f for f in findings), findings


def test_tolist_of_the_usage_counts_not_ordered_after_their_collective_races(one_rank):
    [wait] = [m for m in call_sites() if m.kind == "wait" and m.text == "self._reduction.wait()"
              and m.path == "overlapddp/param_usage.py" and "tolist" in m.text + _line(m)]
    findings = scenarios.run("find_unused_parameters", Sim(mutant=wait))
    assert any("read by Tensor.tolist on default races the write by nccl all_reduce" in f for f in findings), findings


def _line(mutant) -> str:
    import linecache

    return linecache.getline(str(ROOT / mutant.path), mutant.first)
