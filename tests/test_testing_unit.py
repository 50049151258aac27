"""The race-forcing tools on their own, with a recording inner fence and stand-ins for the wrapper:
which stage each delay lands on, what each refuses, that a late future keeps its value or its
error, and that the unfenced fence really hands out unfinished buffers."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.futures import Future

from overlapddp import testing
from overlapddp.clock import BucketStamps, HostClock
from overlapddp.fence import CudaFence, Fence, FenceLog
from overlapddp.testing import (
    STAGES,
    DelayedFence,
    SynchronousReference,
    UnfencedFence,
    delay_communication,
    delay_parameter_gathers,
    unfenced,
)
from tests.support.fake_cuda import RecordingKit


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Recorder(Fence):
    """An inner fence that lists every call it gets, in order, and otherwise behaves as the CPU fence."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def gradient_ready(self, bucket: int, param: int | None = None) -> None:
        self.calls.append(("gradient_ready", bucket, param))

    def _filling(self, bucket: int) -> None:
        self.calls.append(("filling", bucket))

    def _produced(self, bucket: int, buffer: torch.Tensor) -> None:
        self.calls.append(("produced", bucket))
        super()._produced(bucket, buffer)

    def consumed(self, bucket: int, consumer: str, written: Any = ()) -> None:
        self.calls.append(("consumed", bucket, consumer, tuple(written)))

    def backward_ended(self) -> None:
        self.calls.append(("backward_ended",))

    def end_iteration(self) -> None:
        self.calls.append(("end_iteration",))
        super().end_iteration()

    def make_visible(self, strict: bool, gradients: Any = ()) -> None:
        self.calls.append(("make_visible", strict, tuple(gradients)))


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The host sleeps the tools ask for, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(testing, "time", SimpleNamespace(sleep=slept.append))  # testing's own name only
    return slept


class HeldTimer:
    """A ``threading.Timer`` that the test fires by hand: the delay is read, never waited for."""

    def __init__(self, held: list["HeldTimer"], interval: float, function: Any, args: tuple = ()) -> None:
        self.interval, self.function, self.args, self.daemon = interval, function, args, False
        held.append(self)

    def start(self) -> None:
        pass

    def fire(self) -> None:
        self.function(*self.args)


@pytest.fixture
def held_timers(monkeypatch: pytest.MonkeyPatch) -> list[HeldTimer]:
    held: list[HeldTimer] = []
    monkeypatch.setattr(testing, "threading", SimpleNamespace(Timer=lambda *a, **k: HeldTimer(held, *a, **k)))
    return held


def test_a_delay_refuses_an_unknown_stage_and_a_negative_time() -> None:
    with pytest.raises(ValueError, match=r"stage must be one of \('launch', 'completion', 'production', 'consumption'\), got 'later'"):
        DelayedFence(Fence(), 0.1, "later")
    with pytest.raises(ValueError, match="seconds must not be negative, got -0.5"):
        DelayedFence(Fence(), -0.5, "launch")
    DelayedFence(Fence(), 0.0, "launch")  # no delay is allowed


def test_a_delayed_fence_passes_every_call_through_to_its_inner_fence(sleeps: list[float]) -> None:
    inner = Recorder()
    fence = DelayedFence(inner, 0.25, "launch")
    log = FenceLog()
    fence.log = log
    assert inner.log is log and fence.log is log
    stamps = BucketStamps(HostClock(), 1)
    fence.stamps = stamps
    assert inner.stamps is stamps and fence.stamps is stamps
    fence.stamps = None
    buffer, written = torch.zeros(2), torch.ones(1)
    fence.gradient_ready(0, 7)
    fence.launch(0, lambda: inner.calls.append(("fill",)) or buffer, lambda: _done([buffer]))
    assert fence.in_flight() == [0]
    assert fence.complete(0) == [buffer]
    fence.consumed(0, "copy", [written])
    fence.backward_ended()
    fence.end_iteration()
    fence.make_visible(True, [written])
    fence.launch(1, lambda: torch.zeros(1), lambda: _done(None))
    assert fence.abandon() == [1] and fence.in_flight() == []
    assert inner.calls == [
        ("gradient_ready", 0, 7), ("filling", 0), ("fill",), ("produced", 0),
        ("consumed", 0, "copy", (written,)), ("backward_ended",), ("end_iteration",), ("make_visible", True, (written,)),
        ("filling", 1), ("produced", 1),
    ]
    assert sleeps == [0.25, 0.25], "one sleep before each launch, none elsewhere"


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_sleeps_where_it_says_and_nowhere_else(stage: str, sleeps: list[Any]) -> None:
    inner = Recorder()
    inner.calls = sleeps  # the inner fence's edges and the sleeps, in one list, in the order they happened
    fence = DelayedFence(inner, 0.5, "".join(list(stage)))  # a stage read from a config: compared by value
    fence.launch(0, lambda: sleeps.append(("fill",)) or torch.zeros(1), lambda: _done(None))
    if stage != "completion":  # resolved from a timer: the next tests
        fence.complete(0)
        fence.consumed(0, "copy")
    edges = [("filling", 0), ("fill",), ("produced", 0)]
    expected = {
        "launch": [0.5, *edges, ("consumed", 0, "copy", ())],  # before the launch's edges
        "production": [edges[0], 0.5, *edges[1:], ("consumed", 0, "copy", ())],  # after edge 0, before the fill
        "consumption": [*edges, 0.5, ("consumed", 0, "copy", ())],  # after the completion, before the consumers
        "completion": edges,
    }
    assert sleeps == expected[stage]


@pytest.mark.parametrize("stage", ("production", "consumption"))
def test_outside_the_launch_and_completion_stages_a_collective_starts_as_given(stage: str, sleeps: list[float]) -> None:
    started: list[Any] = []

    class Launches(Fence):
        def launch(self, bucket: int, fill: Any, start: Any) -> None:
            started.append(start)

    fence = DelayedFence(Launches(), 0.5, "".join(list(stage)))
    start = lambda: _done(None)  # noqa: E731
    fence.launch(0, lambda: torch.zeros(1), start)
    assert started == [start] and sleeps == [], "the collective is neither delayed nor resolved late"


def test_a_completion_delay_resolves_late_from_a_timer_with_the_collectives_value(
    sleeps: list[float], held_timers: list[HeldTimer]
) -> None:
    fence = DelayedFence(Fence(), 0.2, "".join(list("completion")))  # compared by value
    fence.launch(0, lambda: torch.zeros(1), lambda: _done(["reduced"]))
    assert sleeps == [], "the launching thread is not delayed"
    assert [timer.interval for timer in held_timers] == [0.2] and held_timers[0].daemon
    assert fence.in_flight() == [0]
    held_timers[0].fire()
    assert fence.complete(0) == ["reduced"]
    assert sleeps == [], "nor is the consumer: the delay is the timer's"


def test_a_late_future_is_unset_until_its_timer_fires(held_timers: list[HeldTimer]) -> None:
    late = testing._resolved_from_a_timer(_done(3), 0.2)
    assert not late.done(), "the result came no earlier than the delay"
    held_timers[0].fire()
    assert late.wait() == 3


def test_a_late_future_carries_the_collectives_error_to_its_waiter() -> None:
    failed: Future = Future()
    late = testing._resolved_from_a_timer(failed, 0.0)
    failed.set_exception(RuntimeError("gloo: connection closed"))
    with pytest.raises(RuntimeError, match="connection closed"):
        late.wait()


def test_a_pending_delay_never_keeps_the_process_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    timers: list[threading.Timer] = []

    class Recorded(threading.Timer):
        def start(self) -> None:
            timers.append(self)
            super().start()

    monkeypatch.setattr(testing.threading, "Timer", Recorded)
    assert testing._resolved_from_a_timer(_done(1), 0.0).wait() == 1
    assert len(timers) == 1 and timers[0].daemon


def test_a_late_future_is_set_from_a_timer_thread_not_the_attaching_one() -> None:
    setters: list[str] = []
    called = threading.Event()

    def record(_: Future) -> None:
        setters.append(threading.current_thread().name)
        called.set()

    source: Future = Future()
    late = testing._resolved_from_a_timer(source, 0.01)
    late.add_done_callback(record)
    source.set_result(7)  # the timer is armed only now, after the callback is attached
    assert late.wait() == 7
    assert called.wait(10), "the late future's callbacks ran"
    assert setters[0] != threading.current_thread().name


def test_on_cuda_a_completion_delay_writes_the_result_late_on_the_callbacks_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(testing, "_device_sleep", slept.append)
    reduced = torch.tensor([1.0, 2.0])
    as_list = testing._written_late_on_stream(_done([reduced]), 0.3)
    assert isinstance(as_list, list) and torch.equal(as_list[0], reduced) and as_list[0] is not reduced
    as_tuple = testing._written_late_on_stream(_done((reduced, torch.zeros(1))), 0.3)
    assert isinstance(as_tuple, list) and len(as_tuple) == 1 and torch.equal(as_tuple[0], reduced)
    alone = testing._written_late_on_stream(_done(reduced), 0.3)
    assert torch.equal(alone, reduced) and alone is not reduced
    assert slept == [0.3, 0.3, 0.3]
    host: list[float] = []
    monkeypatch.setattr(testing, "time", SimpleNamespace(sleep=host.append))
    assert testing._written_late_on_stream(_done(None), 0.4) is None and host == [0.4], "no tensor: the callback waits"


def test_on_cuda_the_copies_are_delayed_on_the_device_not_the_host(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    device: list[float] = []
    monkeypatch.setattr(testing, "_device_sleep", device.append)
    fence = DelayedFence(CudaFence(torch.device("cpu"), kit=RecordingKit()), 0.1, "production")
    fence.launch(0, lambda: torch.zeros(1), lambda: _done(None))
    assert device == [0.1] and sleeps == []


def test_a_launch_delay_sleeps_on_the_device_only_when_the_collective_runs_on_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    device: list[float] = []
    monkeypatch.setattr(testing, "_device_sleep", device.append)
    kit = RecordingKit()
    side = kit.streams.setdefault("side", type(kit.current)(kit, "side"))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: type(kit.current)(kit, "main"))
    started = _done(3)
    for available, current, slept in ((False, side, []), (True, kit.current, []), (True, side, [0.2])):
        device.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda current=current: type(current)(kit, current.name))
        assert testing._after_device_sleep(lambda: started, 0.2) is started
        assert device == slept, (available, current)


def test_the_device_sleep_counts_cycles_at_no_less_than_2_ghz(monkeypatch: pytest.MonkeyPatch) -> None:
    cycles: list[int] = []
    monkeypatch.setattr(testing, "cuda_sleep", cycles.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for khz in (1_000_000, 3_000_000):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, khz=khz: SimpleNamespace(clock_rate=khz))
        testing._device_sleep(0.5)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace())
    testing._device_sleep(0.5)
    assert cycles == [1_000_000_000, 1_500_000_000, 1_000_000_000]


def test_the_unfenced_fence_hands_out_the_buffer_of_an_unfinished_collective_and_drains_it() -> None:
    fence = UnfencedFence()
    buffer = torch.zeros(2)
    running: Future = Future()
    fence.launch(0, lambda: buffer, lambda: running)
    assert fence.complete(0) is buffer and not running.done()
    assert fence.in_flight() == []
    drained = threading.Thread(target=fence.drain, daemon=True)
    drained.start()
    drained.join(0.2)
    assert drained.is_alive(), "drain waits for the collective"
    running.set_result(None)
    drained.join(5)
    assert not drained.is_alive() and fence._unwaited == []


class FakeModel:
    """What the tools use of OverlapDDP: its fence, the swap, and its process group's rank."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.swaps: list[Fence] = []

    def replace_fence(self, fence: Fence) -> Fence:
        previous, self.fence = self.fence, fence
        self.swaps.append(fence)
        return previous


# Ranks on either side of this one, and above 256: CPython caches small ints, so an identity
# comparison of ranks would pass with small ones only.
@pytest.mark.parametrize("rank", (300, 301, 302))
def test_delay_communication_wraps_only_the_named_ranks_fence_and_restores_it(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(testing, "_rank_of", lambda model: int("301"))
    original = Fence()
    model = FakeModel(original)
    with delay_communication(model, rank=rank, seconds=0.2, stage="consumption"):  # type: ignore[arg-type]
        inside = model.fence
    assert model.fence is original
    if rank == 301:
        assert isinstance(inside, DelayedFence) and inside.inner is original
        assert (inside.seconds, inside.stage) == (0.2, "consumption")
    else:
        assert inside is original and model.swaps == []
    with pytest.raises(ValueError, match="stage must be one of"), delay_communication(model, rank=rank, seconds=0.2, stage="x"):  # type: ignore[arg-type]
        pass


def test_a_delay_is_undone_when_the_block_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "_rank_of", lambda model: 0)
    original = Fence()
    model = FakeModel(original)
    with pytest.raises(KeyError), delay_communication(model, rank=0, seconds=0.1):  # type: ignore[arg-type]
        raise KeyError("in the block")
    assert model.fence is original


def test_unfenced_keeps_the_log_and_an_enclosing_delay_then_restores_the_fence() -> None:
    original = Fence()
    original.log = FenceLog()
    model = FakeModel(original)
    with unfenced(model) as unsafe:  # type: ignore[arg-type]
        assert model.fence is unsafe and unsafe.log is original.log
    assert model.fence is original
    delayed = DelayedFence(Fence(), 0.3, "completion")
    model = FakeModel(delayed)
    with unfenced(model) as unsafe:  # type: ignore[arg-type]
        inside = model.fence
        assert isinstance(inside, DelayedFence) and inside.inner is unsafe
        assert (inside.seconds, inside.stage) == (0.3, "completion")
    assert model.fence is delayed


def test_unfenced_drains_what_it_skipped_before_restoring() -> None:
    model = FakeModel(Fence())
    with unfenced(model) as unsafe:  # type: ignore[arg-type]
        unsafe.launch(0, lambda: torch.zeros(1), lambda: _done(None))
        unsafe.complete(0)
        assert len(unsafe._unwaited) == 1
    assert unsafe._unwaited == []


class _Broadcast:
    """A broadcast that has already delivered: it wrote 7 into the tensor it was given."""

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor.fill_(7.0)

    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("rank", (300, 301, 302))  # as above: either side, and not cached
def test_delay_parameter_gathers_delays_only_the_named_ranks_broadcasts(rank: int, sleeps: list[float]) -> None:
    started: list[tuple] = []

    def start(tensor: torch.Tensor, owner: int) -> _Broadcast:
        started.append((tensor, owner))
        return _Broadcast(tensor)

    sharded = SimpleNamespace(rank=int("301"), gather_start=start)
    owned, received = torch.zeros(2), torch.zeros(2)
    with delay_parameter_gathers(sharded, rank=rank, seconds=0.7):  # type: ignore[arg-type]
        sharded.gather_start(owned, 301).wait()  # sent by this rank: launched late
        arriving = sharded.gather_start(received, 5)  # received: lands late, through a copy
        arriving.wait()
    assert sharded.gather_start is start and started[0][0] is owned
    assert torch.equal(received, torch.full((2,), 7.0)), "wait() returns once the values are in place"
    if rank == 301:
        assert started[1][0] is not received and sleeps == [0.7, 0.7]
    else:
        assert started[1][0] is received and sleeps == []
    with pytest.raises(ValueError, match="seconds must not be negative, got -1"), delay_parameter_gathers(sharded, rank=rank, seconds=-1):  # type: ignore[arg-type]
        pass
    with delay_parameter_gathers(sharded, rank=rank, seconds=0):  # type: ignore[arg-type]  # no delay is allowed
        pass


def test_the_synchronous_reference_needs_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=None)))  # whatever ran before
    with pytest.raises(RuntimeError, match="needs a process group"):
        SynchronousReference(torch.nn.Linear(1, 1))


def test_the_synchronous_reference_scales_every_gradient_and_writes_it_back_in_place(one_rank: None) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1, bias=False))
    reference = SynchronousReference(module)
    reference(torch.ones(4, 3)).sum().backward()
    before = {name: p.grad.clone() for name, p in module.named_parameters()}
    grads = [p.grad for p in module.parameters()]
    reference.reduce_gradients()
    assert all(p.grad is g for p, g in zip(module.parameters(), grads, strict=True)), "written in place"
    assert all(torch.equal(p.grad, before[name]) for name, p in module.named_parameters()), "one rank: unchanged"


def test_the_synchronous_reference_multiplies_by_the_reciprocal_of_the_group_size(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank cannot tell a missing scale: the group's size and the all-reduce are stood in for."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    reference = SynchronousReference(module)
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(testing.dist, "all_reduce", lambda flat, group: reduced.append(flat.clone()))
    reference.process_group = SimpleNamespace(size=lambda: 4)  # type: ignore[assignment]
    reference(torch.ones(2, 3)).sum().backward()
    module[0].bias.grad = None  # a parameter without a gradient is left out
    before = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    reference.reduce_gradients()
    after = [p.grad for p in module.parameters() if p.grad is not None]
    assert all(torch.equal(a, b * 0.25) for a, b in zip(after, before, strict=True))
    assert len(reduced) == 1 and torch.equal(reduced[0], torch.cat([b.reshape(-1) * 0.25 for b in before]))
    assert module[0].bias.grad is None


def test_the_synchronous_reference_broadcasts_buffers_before_each_training_forward_only(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    broadcasts: list[tuple[int, int]] = []
    monkeypatch.setattr(testing, "broadcast_coalesced", lambda tensors, src, group: broadcasts.append((len(tensors), src)))
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))  # 4 parameters, 3 buffers
    reference = SynchronousReference(module)
    assert broadcasts == [(7, 0)], "parameters and buffers from rank 0 at construction"
    reference(torch.ones(3, 2))
    with torch.no_grad():
        reference(torch.ones(3, 2))
    reference(torch.ones(3, 2))
    assert broadcasts == [(7, 0), (3, 0), (3, 0)], "buffers before each forward with gradients, only those"
