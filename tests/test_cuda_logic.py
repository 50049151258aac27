"""The CUDA path's logic, checked on CPU: the order of stream calls (a recording kit stands in for
CUDA), the host reads in the hot path (counted), and the device object collectives run on.

These check who records and who waits; whether the GPU then obeys is for tests/gpu/.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.futures import Future

from overlapddp import OverlapDDP, construction, module_sync, testing
from overlapddp.bucket.token_weighting import TokenCount
from overlapddp.fence import CudaFence, Fence, fence_for
from overlapddp.layout.plan import BucketCaps, explicit_plan
from overlapddp.param_usage import UsageMap
from overlapddp.reducer import Reducer
from overlapddp.testing import DelayedFence
from tests.support.fake_cuda import HostReads, RecordingKit

CPU = torch.device("cpu")


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


# -- the fence's calls, one bucket at a time -------------------------------------------------------


def test_one_bucket_cycle_records_and_waits_in_order():
    kit = RecordingKit()
    fence = CudaFence(CPU, kit=kit)  # creates the communication stream "side1"
    buffer = torch.zeros(4)
    grads = [torch.zeros(2), torch.zeros(2)]
    with kit.use(kit.stream("producer")):
        fence.launch(0, lambda: kit.calls.append(("fill",)) or buffer, lambda: _done([buffer]))
    with kit.use(kit.stream("consumer")):
        fence.complete(0)
        fence.consumed(0, "copy to param.grad", grads)
    fence.end_iteration()
    with kit.use(kit.stream("reader")):
        fence.make_visible(strict=False, gradients=grads)
    with kit.use(kit.stream("producer")):
        fence.launch(0, lambda: kit.calls.append(("fill",)) or buffer, lambda: _done([buffer]))
    assert kit.calls[:17] == [
        ("fill",),
        ("record", "e1", "producer"),  # produced: on the stream that filled the bucket
        ("record_stream", _ptr(buffer), "producer"),
        ("wait_event", "side1", "e1", "produced"),  # the communication stream waits for the copy-in
        ("record_stream", _ptr(buffer), "side1"),
        ("wait_future", "side1", "collective"),
        ("record", "e2", "side1"),
        ("wait_event", "consumer", "e2", "completed"),
        ("record_stream", _ptr(buffer), "consumer"),  # the result is read on the consumer stream
        ("record", "e3", "consumer"),  # released: after the copy-out
        ("record_stream", _ptr(grads[0]), "consumer"),  # the gradients it wrote
        ("record_stream", _ptr(grads[1]), "consumer"),
        ("wait_stream", "reader", "consumer", "reader"),  # the reader waits for the copy-out, not only e2
        ("record_stream", _ptr(grads[0]), "reader"),
        ("record_stream", _ptr(grads[1]), "reader"),
        ("wait_event", "producer", "e3", "released"),  # the next fill waits for the copy-out
        ("fill",),
    ]


def test_a_hook_result_that_is_not_the_buffer_is_kept_for_the_consumer_stream():
    kit = RecordingKit()
    fence = CudaFence(CPU, kit=kit)
    buffer, decompressed = torch.zeros(4), torch.zeros(4)
    fence.launch(0, lambda: buffer, lambda: _done(decompressed))
    with kit.use(kit.stream("consumer")):
        fence.complete(0)
    assert ("record_stream", _ptr(decompressed), "consumer") in kit.calls


def test_make_visible_on_the_consumer_stream_waits_for_nothing_and_strict_refuses_another():
    kit = RecordingKit()
    fence = CudaFence(CPU, kit=kit)
    fence.make_visible(strict=True)  # before any backward: nothing to wait for
    fence.launch(0, lambda: torch.zeros(1), lambda: _done([torch.zeros(1)]))
    fence.complete(0)
    calls = len(kit.calls)
    fence.make_visible(strict=True)
    assert len(kit.calls) == calls
    with kit.use(kit.stream("reader")), pytest.raises(RuntimeError, match="stream reader"):
        fence.make_visible(strict=True)


# -- the reducer drives the fence: which stream filled a bucket -----------------------------------


def _two_bucket_reducer(kit: RecordingKit) -> tuple[Reducer, list[torch.Tensor]]:
    params = [torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)]
    reducer = Reducer(
        params, ["a", "b"], dist.group.WORLD, CudaFence(CPU, kit=kit), BucketCaps.from_user(None, None), [False] * 2
    )
    reducer._install_plan(explicit_plan(params, [[1], [0]]))  # bucket 0 holds b, bucket 1 holds a
    return reducer, params


def _backward(reducer: Reducer, params: list[torch.Tensor], kit: RecordingKit) -> None:
    reducer.prepare_for_backward()
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    with kit.use(kit.stream("hook a")):
        reducer.mark_ready(0)  # fills bucket 1 (complete ahead of bucket 0, still missing): nothing launches
    with kit.use(kit.stream("hook b")):
        reducer.mark_ready(1)  # fills and launches bucket 0, then launches bucket 1
    with kit.use(kit.stream("consumer")):
        reducer.finalize()


def test_produced_is_recorded_where_the_bucket_was_filled_and_the_next_fill_waits_for_the_copy_out(one_rank):
    kit = RecordingKit()
    reducer, params = _two_bucket_reducer(kit)
    _backward(reducer, params, kit)
    records = {event: stream for call, event, stream in (c for c in kit.calls if c[0] == "record")}
    waits = [c for c in kit.calls if c[0] == "wait_event"]
    produced = [event for _, stream, event, edge in waits if edge == "produced"]
    assert [records[e] for e in produced] == ["hook b", "hook a"]  # bucket 0 then 1, each where filled
    assert not [w for w in waits if w[3] == "released"]  # the first fills follow no copy-out
    _backward(reducer, params, kit)
    second = [c for c in kit.calls if c[0] == "wait_event" and c[3] == "released"]
    records = {event: stream for call, event, stream in (c for c in kit.calls if c[0] == "record")}
    waited_for = [(stream, records[event]) for _, stream, event, _ in second]
    assert waited_for == [("hook a", "consumer"), ("hook b", "consumer")]
    assert [p.grad.tolist() for p in params] == [[2.0] * 3, [2.0] * 2]


def test_with_the_nonfinite_check_a_bucket_complete_ahead_is_filled_at_its_launch_in_index_order(one_rank):
    # The check is a collective: run inside the fill, the fills must come in index order on every rank.
    kit = RecordingKit()
    params = [torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)]
    reducer = Reducer(
        params, ["a", "b"], dist.group.WORLD, CudaFence(CPU, kit=kit), BucketCaps.from_user(None, None), [False] * 2,
        check_nonfinite=True,
    )
    reducer._install_plan(explicit_plan(params, [[1], [0]]))
    _backward(reducer, params, kit)
    records = {event: stream for call, event, stream in (c for c in kit.calls if c[0] == "record")}
    produced = [event for _, stream, event, edge in (c for c in kit.calls if c[0] == "wait_event") if edge == "produced"]
    assert [records[e] for e in produced] == ["hook b", "hook b"]  # bucket 1 waited for bucket 0's launch
    gradients = [c for c in kit.calls if c[0] == "wait_event" and c[3] == "gradient"]
    assert len(gradients) == 1, "bucket 1's fill on hook b waits for hook a's gradient"


# -- refusing a module on several GPUs --------------------------------------------------------------


class _OnDevice:
    """A parameter stand-in on a device this machine may not have (only ``device`` and ``is_sparse`` are read)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.is_sparse = device, False


def test_a_module_on_two_gpus_is_refused_naming_the_devices_before_any_collective():
    named = [("a", _OnDevice(torch.device("cuda", 0))), ("b", _OnDevice(torch.device("cuda", 1)))]
    with pytest.raises(ValueError, match=r"2 devices \(cuda:0: a; cuda:1: b\).*DistributedDataParallel accepts"):
        construction._check_parameters(named, named)
    assert type(fence_for(CPU)) is Fence


# -- object collectives on the module's device -----------------------------------------------------


class _FakeCudaDevice:
    """Stands in for ``torch.cuda.device``: tracks which device is current."""

    current: list[object] = ["cuda:0"]

    def __init__(self, device: object) -> None:
        self.device = str(device)

    def __enter__(self) -> None:
        self.current.append(self.device)

    def __exit__(self, *exc: object) -> None:
        self.current.pop()


def test_object_gathers_run_on_the_modules_device_not_the_current_one(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    monkeypatch.setattr(
        dist, "all_gather_object", lambda out, obj, group=None: seen.append(_FakeCudaDevice.current[-1])
    )
    group = type("Group", (), {"size": lambda self: 2})()
    module_sync.gather_objects("x", group, torch.device("cuda", 3))
    assert seen == ["cuda:3"]

    devices = []
    monkeypatch.setattr(module_sync, "gather_objects", lambda obj, group, device: devices.append(device) or [obj])
    module_sync.verify_same_parameters(["w"], [torch.empty(2, device="meta")], group)
    assert devices == [torch.device("meta")]


# -- host reads in the hot path ----------------------------------------------------------------------


def test_settling_the_usage_reduction_reads_nothing_on_the_host(monkeypatch):
    usage = UsageMap(3, CPU)
    usage.mark_used(0)
    waited = []
    reduced = torch.tensor([1, 0, 1], dtype=torch.int32)

    class Work:
        def get_future(self) -> Future:
            future = _done([reduced])
            original = future.wait
            future.wait = lambda: waited.append(True) or original()  # type: ignore[method-assign]
            return future

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, async_op=False: Work())
    usage.launch_reduction(None)
    with HostReads() as counter:
        usage.settle()
    assert waited and counter.reads == []
    assert usage.globally_used(2)  # a locally unused parameter: now the host reads the reduced flags


def test_token_count_on_cuda_is_reduced_on_a_side_stream_and_never_read_from_the_device(one_rank, monkeypatch):
    kit = RecordingKit()
    tokens = TokenCount(CPU, kit=kit)
    issued = []
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, group=None, async_op=False):
        issued.append((kit.current.name, _ptr(tensor)))
        return real_all_reduce(tensor, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    tokens.add(7)
    with HostReads() as counter:
        tokens.launch(dist.group.WORLD)
        total = tokens.total(0)
    assert total == 7.0
    [(stream, reduced)] = issued
    assert stream == "side1"  # not the compute stream: the count does not wait for forward
    assert reduced not in [ptr for _, ptr in counter.reads]  # never .item() on the device tensor
    assert kit.calls[-1] == ("synchronize", "e1")  # the host waits for the copy's event only


def _nonfinite_reads() -> tuple[int, int]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    model = OverlapDDP(net)
    params = list(net.parameters())
    model._reducer._install_plan(explicit_plan(params, [[i, i + 1] for i in range(0, len(params), 2)]))
    model.check_nonfinite_gradients()
    loss = model(torch.ones(2, 4)).sum()
    with HostReads() as counter:
        loss.backward()
    return len([r for r in counter.reads if r[0] == "aten._local_scalar_dense.default"]), len(model.bucket_indices())


def test_the_nonfinite_check_reads_one_count_per_bucket(one_rank):
    reads, buckets = _nonfinite_reads()
    assert buckets > 1
    assert reads == buckets


# -- the guard orders every reader and writer of the gradients --------------------------------------


class _VisibilityLog(Fence):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def make_visible(self, strict: bool, gradients=()) -> None:
        self.calls.append(len(list(gradients)))


def test_the_guard_makes_gradients_visible_before_step_zero_grad_and_unscale(one_rank):
    torch.manual_seed(0)
    model = OverlapDDP(torch.nn.Linear(3, 2))
    fence = _VisibilityLog()
    model._reducer.replace_fence(fence)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    model.attach_optimizer(optimizer, scaler=scaler)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=False)
    assert fence.calls == [2, 2, 2]  # unscale_, step, zero_grad: each with both gradients


# -- race forcing: the copy-in and copy-out delays touch nothing else ----------------------------------


@pytest.mark.parametrize("stage", ["production", "consumption"])
def test_copy_delays_delay_only_their_copy_and_leave_the_collective_alone(stage):
    fence = DelayedFence(Fence(), 0.05, stage)
    future = _done([torch.zeros(1)])
    filled: list[float] = []
    started = time.perf_counter()
    fence.launch(0, lambda: filled.append(time.perf_counter()) or torch.zeros(1), lambda: future)
    launched = time.perf_counter()
    assert fence.inner._in_flight[0] is future  # neither delayed nor wrapped
    fence.complete(0)
    completed = time.perf_counter()
    assert (filled[0] - started >= 0.05) == (stage == "production")
    assert (completed - launched >= 0.05) == (stage == "consumption")


def test_a_completion_delay_falls_on_the_collective_never_on_the_launching_thread():
    # A collective that had already finished when the delay was attached (gloo can be that fast):
    # a sleeping callback would run at once on the launching thread, stalling backward instead of
    # the communication (it made test_timeline's exposed communication vanish on a CI run).
    fence = DelayedFence(Fence(), 0.3, "completion")
    started = time.perf_counter()
    fence.launch(0, lambda: torch.zeros(1), lambda: _done([torch.ones(1)]))
    launched = time.perf_counter()
    assert torch.equal(fence.complete(0)[0], torch.ones(1))  # the collective's result, after the delay
    completed = time.perf_counter()
    assert launched - started < 0.15 and completed - started >= 0.29


def test_a_delayed_collectives_error_reaches_whoever_waits_for_it():
    failed: Future = Future()
    failed.set_exception(RuntimeError("the collective failed"))
    fence = DelayedFence(Fence(), 0.01, "completion")
    fence.launch(0, lambda: torch.zeros(1), lambda: failed)
    with pytest.raises(RuntimeError, match="the collective failed"):
        fence.complete(0)


def test_a_cuda_buckets_completion_delay_is_written_late_on_the_callbacks_stream(monkeypatch):
    class CudaLike:  # what the launch reads of a CUDA bucket
        is_cuda = True

    written = []
    monkeypatch.setattr(testing, "_written_late_on_stream", lambda done, seconds: written.append(seconds) or done.value())
    fence = DelayedFence(Fence(), 0.01, "completion")
    fence.launch(0, lambda: CudaLike(), lambda: _done([torch.ones(1)]))
    fence.complete(0)
    assert written == [0.01]


# -- what the backend cannot reduce is refused at construction ------------------------------------------


@pytest.mark.parametrize(
    "backend, device, refused",
    [("nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False),
     ("gloo", "cuda", False)],
)
def test_sparse_gradients_on_nccl_are_refused_naming_them(monkeypatch, backend, device, refused):
    from overlapddp.backend_support import refuse_unsupported

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    refuse_unsupported(None, torch.device(device), [])  # nothing sparse: nothing to refuse
    if not refused:
        refuse_unsupported(None, torch.device(device), ["emb.weight"])
        return
    with pytest.raises(ValueError, match=r"emb\.weight, bag\.weight produce sparse gradients .* gloo"):
        refuse_unsupported(None, torch.device(device), ["emb.weight", "bag.weight"])


@pytest.mark.parametrize("mode, backend, refused", [("2", "nccl", True), ("3", "nccl", False), ("2", "gloo", False)])
def test_nccl_error_handling_that_aborts_without_raising_is_refused(monkeypatch, mode, backend, refused):
    from overlapddp.backend_support import refuse_unsupported

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", mode)
    if not refused:
        refuse_unsupported(None, torch.device("cuda"), [])
        return
    with pytest.raises(ValueError, match="ASYNC_ERROR_HANDLING=2 .* silently use partial sums"):
        refuse_unsupported(None, torch.device("cuda"), [])


def test_each_bucket_makes_its_events_once_and_records_them_again(one_rank):
    kit = RecordingKit()
    reducer, params = _two_bucket_reducer(kit)
    _backward(reducer, params, kit)
    first = kit._events
    _backward(reducer, params, kit)
    assert first == 6 and kit._events == first  # produced, completed, released per bucket, once
