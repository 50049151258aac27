"""The CPU fence and its log on their own: the happens-before rules the log checks, the errors a
misuse gets, what an abandon drops, and the times the log keeps, with futures made by hand."""

from __future__ import annotations

import time

import pytest
import torch
from torch.futures import Future

from overlapddp import fence as fence_module
from overlapddp.clock import BucketStamps
from overlapddp.fence import BACKWARD_END, CudaFence, Fence, FenceEdge, FenceLog, _address, _tensors_of, fence_for
from tests.support.fake_cuda import RecordingKit
from tests.support.ticking_clock import DONE, Ticks


def _edge(iteration: int, bucket: int, edge: str, buffer: int = 1) -> FenceEdge:
    return FenceEdge(iteration, bucket, edge, "actor", "cpu", None, buffer, 0.0)


def _cycle(iteration: int, bucket: int, buffer: int = 1) -> list[FenceEdge]:
    return [_edge(iteration, bucket, e, buffer) for e in ("produced", "launched", "completed", "consumed")]


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_a_log_in_order_has_no_violation_and_a_second_consumer_is_allowed() -> None:
    more_consumers = [_edge(0, 0, "consumed"), _edge(0, 0, "consumed")]
    edges = _cycle(0, 0) + more_consumers + [_edge(0, -1, BACKWARD_END)] + _cycle(0, 1, 2) + _cycle(1, 0)
    assert FenceLog(edges).violations() == []


@pytest.mark.parametrize(
    ("edges", "problem"),
    [
        ([_edge(0, 0, "launched")], "iteration 0 bucket 0: 'launched' by actor after nothing"),
        ([_edge(0, 0, "consumed")], "iteration 0 bucket 0: 'consumed' by actor after nothing"),
        (_cycle(0, 0)[:1] + [_edge(0, 0, "completed")], "iteration 0 bucket 0: 'completed' by actor after ['produced']"),
        (_cycle(0, 3)[:2] + [_edge(0, 3, "consumed")], "'consumed' by actor after ['produced', 'launched']"),
        (_cycle(0, 0) + [_edge(0, 0, "produced")], "'produced' by actor after ['produced', 'launched', 'completed', 'consumed']"),
        (_cycle(0, 0)[:3] + [_edge(0, 0, "completed")], "'completed' by actor after ['produced', 'launched', 'completed']"),
        (_cycle(0, 0) + [_edge(0, 0, "completed")],  # only a second consumer may follow a consumer
         "'completed' by actor after ['produced', 'launched', 'completed', 'consumed']"),
    ],
)
def test_each_edge_out_of_order_is_named_with_what_came_before(edges: list[FenceEdge], problem: str) -> None:
    assert problem in FenceLog(edges).violations()[0]


def test_a_buffer_produced_into_while_its_collective_runs_is_a_violation_until_it_completes() -> None:
    racing = _cycle(0, 0, buffer=7)[:2] + [_edge(0, 1, "produced", buffer=7)]
    assert FenceLog(racing).violations() == [
        "iteration 0 bucket 1: buffer reused while the collective of iteration 0 bucket 0 on it had not completed"
    ]
    other_buffer = _cycle(0, 0, buffer=7)[:2] + [_edge(0, 1, "produced", buffer=8)]
    assert FenceLog(other_buffer).violations() == []
    after_completion = _cycle(0, 0, buffer=7)[:3] + [_edge(0, 1, "produced", buffer=7)]
    assert FenceLog(after_completion).violations() == []
    never_launched = _cycle(0, 0, buffer=7)[:1] + [_edge(0, 1, "produced", buffer=7)]
    assert FenceLog(never_launched).violations() == [], "only a launch makes a buffer busy"


def test_a_bucket_launched_twice_or_completed_unlaunched_is_refused_naming_it() -> None:
    fence = Fence()
    fence.launch(4, lambda: torch.zeros(1), lambda: _done(1))
    with pytest.raises(RuntimeError, match="Bucket 4 was launched twice"):
        fence.launch(4, lambda: torch.zeros(1), lambda: _done(1))
    with pytest.raises(RuntimeError, match="Bucket 5 was asked for its result but was never launched"):
        fence.complete(5)
    assert fence.complete(4) == 1
    with pytest.raises(RuntimeError, match="Bucket 4 was asked for its result"):
        fence.complete(4)


def test_complete_tells_the_waiter_hook_which_future_it_waits_for_first() -> None:
    seen: list[tuple[int, Future]] = []
    fence = Fence(before_wait=lambda bucket, future: seen.append((bucket, future)))
    future: Future = Future()
    fence.launch(2, lambda: torch.zeros(1), lambda: future)
    future.set_result("reduced")
    assert fence.complete(2) == "reduced"
    assert seen == [(2, future)]


def test_abandon_drops_every_collective_in_flight_and_starts_a_new_iteration() -> None:
    fence = Fence()
    for bucket in (3, 1, 2):
        fence.launch(bucket, lambda: torch.zeros(1), lambda: _done(None))
    fence.complete(2)
    assert fence.in_flight() == [1, 3]
    assert fence.abandon() == [1, 3]
    assert fence.in_flight() == [] and fence.iteration == 1
    fence.launch(1, lambda: torch.zeros(1), lambda: _done(None))  # no longer "launched twice"
    fence.end_iteration()
    assert fence.iteration == 2


def test_the_log_records_each_edge_with_its_iteration_buffer_and_times_in_order() -> None:
    fence = Fence()
    fence.log = FenceLog()
    buffer = torch.zeros(3)
    fence.launch(0, lambda: buffer, lambda: _done(buffer))
    fence.complete(0)
    fence.consumed(0, "copy to param.grad")
    fence.backward_ended()
    fence.end_iteration()
    fence.launch(0, lambda: buffer, lambda: _done(buffer))
    edges = fence.log.edges
    assert [(e.iteration, e.bucket, e.edge, e.actor) for e in edges] == [
        (0, 0, "produced", "autograd hook"),
        (0, 0, "launched", "collective"),
        (0, 0, "completed", "finalize"),
        (0, 0, "consumed", "copy to param.grad"),
        (0, -1, BACKWARD_END, "autograd engine"),
        (1, 0, "produced", "autograd hook"),
        (1, 0, "launched", "collective"),
    ]
    assert {e.buffer for e in edges if e.bucket == 0} == {buffer.data_ptr()} and edges[4].buffer == 0
    assert all(e.stream == "cpu" and e.event is None for e in edges)
    times = [e.time for e in edges]
    assert times == sorted(times), "each edge's time is not before the previous one's"
    assert fence.log.violations() == []


def test_without_a_log_nothing_is_recorded_or_kept_per_launch() -> None:
    fence = Fence()
    fence.launch(0, lambda: torch.zeros(1), lambda: _done(None))
    assert fence._launched_at == {} and fence._finished_at == {}
    fence.complete(0)
    assert fence.log is None


def test_a_buffer_is_named_by_its_memory_a_sparse_one_by_identity_and_none_by_zero() -> None:
    dense = torch.zeros(2)
    sparse = torch.zeros(2).to_sparse()
    assert _address(dense) == dense.data_ptr() and _address(sparse) == id(sparse) and _address(None) == 0


def test_the_tensors_of_a_result_are_its_tensors_in_order() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    assert _tensors_of(a)[0] is a
    assert [t is x for t, x in zip(_tensors_of([a, "not a tensor", b]), (a, b), strict=True)] == [True, True]
    assert len(_tensors_of((a, b))) == 2 and _tensors_of(None) == []


def test_the_fence_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fence_module, "CudaKit", lambda device: RecordingKit())
    calls: list[int] = []
    cpu = fence_for(torch.device("cpu"), before_wait=lambda bucket, future: calls.append(bucket))
    cuda = fence_for(torch.device("cuda", 0), before_wait=lambda bucket, future: calls.append(-bucket))
    assert type(cpu) is Fence and type(cuda) is CudaFence
    assert all(type(fence_for(torch.device(other))) is Fence for other in ("meta", "xpu", "mps")), "streams are CUDA's only"
    for fence, bucket in ((cpu, 1), (cuda, 2)):
        fence.launch(bucket, lambda: torch.zeros(1), lambda: _done(None))
        fence.complete(bucket)
    assert calls == [1, -2], "each fence got its waiter hook"


def test_a_bucket_filled_from_two_streams_waits_for_each_before_its_copy() -> None:
    """Backward accumulates a gradient on the stream its forward op ran on: the filling stream waits
    on an event on every stream a bucket's gradients came from, and on none when they came from it."""
    kit = RecordingKit()
    fence = CudaFence(torch.device("cpu"), kit=kit)
    fence.gradient_ready(0)
    fence.gradient_ready(0)
    with kit.use(kit.stream("side")):
        fence.gradient_ready(0)
    fence.launch(0, lambda: kit.calls.append(("fill",)) or torch.zeros(1), lambda: _done(None))
    before_fill = kit.calls[:kit.calls.index(("fill",))]
    assert [(c[1], c[2]) for c in before_fill if c[0] == "record"] == [("e1", "main"), ("e2", "side")]
    assert [c for c in before_fill if c[0] == "wait_event"] == [
        ("wait_event", "main", "e1", "gradient"), ("wait_event", "main", "e2", "gradient")]
    kit.calls.clear()
    fence.gradient_ready(1)
    fence.gradient_ready(1)
    fence.launch(1, lambda: kit.calls.append(("fill",)) or torch.zeros(1), lambda: _done(None))
    assert kit.calls[0] == ("fill",), "one stream: no event, no wait before the fill"


def test_an_abandoned_failed_collective_is_waited_on_the_communication_stream_and_dropped() -> None:
    """Its error belongs to the dropped iteration (already reported): abandoning swallows it."""
    kit = RecordingKit()
    fence = CudaFence(torch.device("cpu"), kit=kit)
    failed: Future = Future()
    failed.set_exception(RuntimeError("gloo: connection closed"))
    fence.launch(0, lambda: torch.zeros(1), lambda: failed)
    assert fence.abandon() == [0] and fence.in_flight() == []
    waits = [c for c in kit.calls if c[0] == "wait_future"]
    assert len(waits) == 1 and waits[0][1] != "main" and waits[0][2] == "collective"


def test_a_log_of_edge_names_read_from_elsewhere_is_checked_by_value() -> None:
    """A log rebuilt from a saved trace holds equal edge names that are other string objects."""

    def rebuilt(edge: FenceEdge) -> FenceEdge:
        return FenceEdge(edge.iteration, edge.bucket, "".join(list(edge.edge)), edge.actor, edge.stream,
                         edge.event, edge.buffer, edge.time)

    backward_end = _edge(0, -1, "".join(list(BACKWARD_END)))
    in_order = [rebuilt(e) for e in _cycle(0, 0, buffer=7) + [_edge(0, 0, "consumed"), backward_end] + _cycle(1, 0, buffer=7)]
    assert all(a.edge is not b.edge for a, b in zip(in_order, _cycle(0, 0), strict=False))
    assert FenceLog(in_order).violations() == []


def test_on_cuda_a_completion_is_logged_when_it_was_waited_not_when_the_future_was_done() -> None:
    """NCCL's future is done at enqueue: its time says nothing of the collective, the wait's does."""
    kit = RecordingKit()
    fence = CudaFence(torch.device("cpu"), kit=kit)
    fence.log = FenceLog()
    fence.launch(0, lambda: torch.zeros(1), lambda: _done([torch.zeros(1)]))
    time.sleep(0.02)
    waited = time.perf_counter()
    fence.complete(0)
    completed = [e for e in fence.log.edges if e.edge == "completed"]
    assert len(completed) == 1 and completed[0].time >= waited


def test_on_cpu_a_completion_is_logged_when_the_collective_finished_not_when_it_was_waited() -> None:
    """Gloo's future is done when the result is final: a timeline shows the completion where it happened."""
    fence = Fence()
    fence.log = FenceLog()
    buffer = torch.zeros(1)
    running: Future = Future()
    fence.launch(0, lambda: buffer, lambda: running)
    running.set_result(buffer)
    time.sleep(0.02)
    waited = time.perf_counter()
    fence.complete(0)
    completed = [e for e in fence.log.edges if e.edge == "completed"]
    assert len(completed) == 1 and completed[0].time < waited


def test_a_logged_edge_cannot_be_rewritten() -> None:
    edge = _edge(0, 0, "produced")
    with pytest.raises(AttributeError):
        edge.edge = "completed"  # type: ignore[misc]


def test_a_bucket_filled_ahead_launches_without_a_second_fill_and_none_launches_unfilled() -> None:
    fence = Fence()
    fills: list[int] = []
    fence.fill(3, lambda: fills.append(3) or torch.zeros(1))
    fence.launch(3, None, lambda: _done(None))  # filled when it completed, ahead of its turn
    assert fills == [3] and fence.in_flight() == [3]
    fence.complete(3)
    with pytest.raises(RuntimeError, match="Bucket 3 was launched before it was filled"):
        fence.launch(3, None, lambda: _done(None))  # last iteration's fill does not count
    fence.fill(4, lambda: torch.zeros(1))
    fence.abandon()
    with pytest.raises(RuntimeError, match="Bucket 4 was launched before it was filled"):
        fence.launch(4, None, lambda: _done(None))  # nor one from a dropped iteration
    fence.fill(5, lambda: torch.zeros(1))  # a skipped bucket: filled, never launched
    fence.end_iteration()
    with pytest.raises(RuntimeError, match="Bucket 5 was launched before it was filled"):
        fence.launch(5, None, lambda: _done(None))



def test_while_measuring_every_bucket_is_stamped_at_each_edge_and_the_delayed_key_at_none() -> None:
    fence = Fence()
    fence.stamps = stamps = BucketStamps(Ticks(), 3)
    fence.gradient_ready(2, 1)
    fence.gradient_ready(-2)  # the delayed all-reduce's gradients name no parameter of a bucket
    for bucket in (0, 2, -2):  # two buckets, then the delayed all-reduce's key
        fence.launch(bucket, lambda: torch.zeros(3, dtype=torch.float64), lambda: _done(None))
        fence.complete(bucket)
        fence.consumed(bucket, "copy to param.grad")
    assert stamps.ready == [None, 2, None]
    assert [(s.bucket, s.nbytes, s.launched, s.done) for s in stamps.launches] == [(0, 24, 3, DONE), (2, 24, 6, DONE)]
    assert stamps.completed == {0: 4, 2: 7} and stamps.consumed == {0: 5, 2: 8}
