"""The reducer's state machine driven by hand on a one-rank group: no autograd, no module, no spawn.

Each test plays the wrapper's part (``prepare_for_forward``, ``prepare_for_backward``, ``mark_ready``
in some order, ``finalize``) and reads what the reducer says about itself, the fence's log, the
desync record and the sync-flag warnings. One rank's reduction is the gradient itself, so the values
written back are known exactly.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import Fence, FenceLog
from overlapddp.layout.plan import BucketCaps
from overlapddp.options import ReducerOptions
from overlapddp.progress import ProgressRecord
from overlapddp.reducer import GraphMode, Reducer, ReducerState
from overlapddp.sync_checks import SyncFlagCheck

ONE_BYTE = BucketCaps(first_bytes=1, bytes_cap=1, per_bucket=(1,))  # every parameter its own bucket, always
NAMES = ["a", "b", "c"]


class RecordedProgress(ProgressRecord):
    """A desync record that keeps every call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def forward(self, iteration: int, reductions: int, dropped: bool) -> None:
        self.calls.append(("forward", iteration, reductions, dropped))

    def reduced(self, iteration: int, reductions: int) -> None:
        self.calls.append(("reduced", iteration, reductions))


def _params(sizes: tuple[int, ...] = (2, 3, 4)) -> list[torch.Tensor]:
    return [torch.zeros(n, requires_grad=True) for n in sizes]


def _reducer(
    params: list[torch.Tensor] | None = None,
    options: ReducerOptions = ReducerOptions(),
    caps: BucketCaps = ONE_BYTE,
    **kwargs: Any,
) -> Reducer:
    params = _params() if params is None else params
    return Reducer(params, NAMES[: len(params)], dist.group.WORLD, Fence(), caps, [False] * len(params), options,
                   **kwargs)


def _grad(reducer: Reducer, index: int, value: float) -> None:
    reducer.params[index].grad = torch.full_like(reducer.params[index], value)


def _index(reducer: Reducer, param: torch.Tensor) -> int:
    return next(i for i, p in enumerate(reducer.params) if p is param)


def _backward(reducer: Reducer, order: list[int], finalize: bool = True) -> list[bool]:
    """A synchronized iteration whose gradients arrive in ``order`` (gradient i is i + 1); what each
    ``mark_ready`` returned."""
    reducer.prepare_for_forward()
    reducer.prepare_for_backward()
    returned = []
    for i in order:
        _grad(reducer, i, i + 1.0)
        returned.append(reducer.mark_ready(i))
    if finalize:
        reducer.finalize()
    return returned


def test_the_wrappers_progress_record_and_sync_flag_are_the_ones_used(one_rank: None) -> None:
    progress, flags = RecordedProgress(), SyncFlagCheck()
    reducer = _reducer(progress=progress, sync_flags=flags)
    assert reducer.progress is progress and reducer.sync_flags is flags
    _backward(reducer, [2, 1, 0])
    assert progress.calls == [("forward", 1, 0, False), ("reduced", 1, 1)]
    defaults = _reducer()
    assert isinstance(defaults.progress, ProgressRecord) and isinstance(defaults.sync_flags, SyncFlagCheck)
    assert defaults.sync_flags.requested is True


def test_a_forward_whose_backward_never_came_is_recorded_as_dropped(one_rank: None) -> None:
    progress = RecordedProgress()
    reducer = _reducer(progress=progress)
    reducer.prepare_for_backward()
    reducer.prepare_for_backward()  # ARMED again: no gradient came, nothing to abandon
    assert progress.calls == [("forward", 1, 0, False), ("forward", 2, 0, True)]
    assert reducer.synchronized_forwards == 2 and reducer.reductions == 0


def test_the_states_of_one_iteration(one_rank: None) -> None:
    reducer = _reducer()
    seen = [reducer.state]
    reducer.prepare_for_forward()
    seen.append(reducer.state)
    reducer.prepare_for_backward()
    seen.append(reducer.state)
    for i in (2, 1, 0):
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
        seen.append(reducer.state)
    reducer.finalize()
    seen.append(reducer.state)
    idle, armed, reducing = ReducerState.IDLE, ReducerState.ARMED, ReducerState.REDUCING
    assert seen == [idle, idle, armed, reducing, reducing, reducing, idle]
    assert reducer.reductions == 1 and reducer.mode is GraphMode.OVERLAP


def test_mark_ready_is_true_once_every_bucket_launched_and_buckets_launch_in_index_order(one_rank: None) -> None:
    reducer = _reducer()
    assert reducer.plan.buckets == ((2,), (1,), (0,))  # DDP's initial order: reversed
    log = FenceLog()
    reducer.fence.log = log
    returned = _backward(reducer, [0, 1, 2], finalize=False)  # bucket 2 fills first, bucket 0 last
    launched = [e.bucket for e in log.edges if e.edge == "launched"]
    assert returned == [False, False, True]
    assert launched == [0, 1, 2], "a bucket filled early waits for the ones before it"
    reducer.finalize()
    assert [float(p.grad[0]) for p in reducer.params] == [1.0, 2.0, 3.0]
    assert log.violations() == []


def test_a_gradient_within_a_bucket_launches_nothing_until_the_bucket_is_full(one_rank: None) -> None:
    reducer = _reducer(caps=BucketCaps.from_user(None, None))  # one bucket of all three
    assert _backward(reducer, [2, 0, 1]) == [False, False, True]


def test_unfinished_buckets_are_those_that_took_a_gradient(one_rank: None) -> None:
    reducer = _reducer(params=_params((2, 3)), caps=BucketCaps.from_user(None, None))
    assert reducer.unfinished_buckets() == []
    reducer.prepare_for_backward()
    assert reducer.unfinished_buckets() == [], "armed, nothing taken yet"
    _grad(reducer, 0, 1.0)
    reducer.mark_ready(0)
    assert reducer.unfinished_buckets() == [0]
    _grad(reducer, 1, 1.0)
    reducer.mark_ready(1)
    reducer.finalize()
    assert reducer.unfinished_buckets() == []


def test_a_gradient_marked_twice_names_the_parameter(one_rank: None) -> None:
    reducer = _reducer()
    _backward(reducer, [2], finalize=False)
    _grad(reducer, 2, 1.0)
    with pytest.raises(RuntimeError, match=r"only once. Parameter c \(index 2\) .* on rank 0"):
        reducer.mark_ready(2)


def test_an_unfinished_iteration_names_what_is_missing_and_the_next_one_runs(one_rank: None) -> None:
    reducer = _reducer()
    _backward(reducer, [1], finalize=False)
    with pytest.raises(RuntimeError, match=r"rank 0: a \(index 0\), c \(index 2\)\n"):
        reducer.prepare_for_backward()
    assert reducer.state is ReducerState.IDLE and reducer.unfinished_buckets() == []
    _backward(reducer, [2, 1, 0])
    assert reducer.reductions == 1 and [float(p.grad[0]) for p in reducer.params] == [1.0, 2.0, 3.0]


def test_a_bucket_partly_filled_when_its_iteration_is_dropped_starts_the_next_one_empty(one_rank: None) -> None:
    reducer = _reducer(caps=BucketCaps.from_user(None, None))  # one bucket of the three
    _backward(reducer, [1], finalize=False)
    with pytest.raises(RuntimeError, match="finished reduction in the prior iteration"):
        reducer.prepare_for_forward()
    assert _backward(reducer, [2, 1, 0]) == [False, False, True], "launched by its third gradient, not its second"
    assert [float(p.grad[0]) for p in reducer.params] == [1.0, 2.0, 3.0]



def test_an_abandoned_iteration_renews_exactly_the_buckets_in_flight(one_rank: None) -> None:
    """A collective may still write the launched buckets' buffers: they get new storage; the bucket
    never launched keeps its own."""
    reducer = _reducer()
    reducer.prepare_for_backward()
    for i in (2, 1):  # buckets 0 and 1 launch
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    before = list(reducer.pipelines)
    with pytest.raises(RuntimeError, match="finished reduction in the prior iteration"):
        reducer.prepare_for_forward()
    assert [now is then for now, then in zip(reducer.pipelines, before, strict=True)] == [False, False, True]



def test_the_fence_is_replaced_only_between_iterations(one_rank: None) -> None:
    reducer = _reducer()
    first, other = reducer.fence, Fence()
    assert reducer.replace_fence(other) is first and reducer.fence is other
    _backward(reducer, [2], finalize=False)
    with pytest.raises(RuntimeError, match=r"reducer is reducing with buckets \[0\] in flight"):
        reducer.replace_fence(Fence())
    assert reducer.fence is other
    armed = _reducer()
    armed.prepare_for_backward()  # nothing in flight yet, but the iteration has begun
    with pytest.raises(RuntimeError, match=r"reducer is armed with buckets \[\] in flight"):
        armed.replace_fence(Fence())


def test_a_one_parameter_model_searching_unused_parameters(one_rank: None) -> None:
    reducer = _reducer(_params((2,)), options=ReducerOptions(find_unused_parameters=True))
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([(reducer.params[0] * 2).sum()])
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is True
    reducer.finalize()
    assert float(reducer.params[0].grad[0]) == 1.0


def test_a_gradient_outside_a_synchronized_backward_stays_local(one_rank: None) -> None:
    reducer = _reducer()
    reducer.sync_flags.requested = False  # no_sync(): the forward did not arm
    reducer.sync_flags.forward_synced = False
    _grad(reducer, 1, 5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a local gradient under no_sync is what the user asked for
        assert reducer.mark_ready(1) is False
    assert reducer.local_gradients_since_reduction and reducer.state is ReducerState.IDLE
    assert float(reducer.params[1].grad[0]) == 5.0
    reducer.sync_flags.requested = True
    _backward(reducer, [2, 1, 0])
    assert not reducer.local_gradients_since_reduction, "the reduction took the local gradients in"


def test_a_second_backward_of_one_forward_is_local_and_warned(one_rank: None) -> None:
    reducer = _reducer()
    _backward(reducer, [2, 1, 0])
    _grad(reducer, 0, 1.0)
    with pytest.warns(UserWarning, match="a backward ran after this wrapper's reduction had finished"):
        assert reducer.mark_ready(0) is False
    assert reducer.local_gradients_since_reduction


def test_a_synchronized_backward_under_no_sync_is_reduced_and_warned(one_rank: None) -> None:
    reducer = _reducer()
    reducer.prepare_for_backward()
    reducer.sync_flags.requested = False  # set after the forward: the forward decided
    _grad(reducer, 2, 1.0)
    with pytest.warns(UserWarning, match="ARE being reduced"):
        reducer.mark_ready(2)
    assert reducer.state is ReducerState.REDUCING


def test_local_gradients_cleared_before_the_next_forward_are_warned(one_rank: None) -> None:
    reducer = _reducer()
    reducer.sync_flags.requested = reducer.sync_flags.forward_synced = False
    _grad(reducer, 1, 1.0)
    reducer.mark_ready(1)
    reducer.params[1].grad = None  # zero_grad(set_to_none=True)
    reducer.sync_flags.requested = True
    with pytest.warns(UserWarning, match=r"zero_grad\(\) \(or setting .grad to None\) before this forward"):
        reducer.prepare_for_backward()


def test_local_gradients_kept_until_the_next_forward_are_not_warned(one_rank: None) -> None:
    reducer = _reducer()
    reducer.sync_flags.requested = reducer.sync_flags.forward_synced = False
    _grad(reducer, 1, 1.0)
    reducer.mark_ready(1)
    reducer.sync_flags.requested = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reducer.prepare_for_backward()


def test_detached_watchers_stop_watching_gradient_writes(one_rank: None) -> None:
    reducer = _reducer(caps=BucketCaps.from_user(None, None))
    reducer.stages.write_watch.watchers += 1
    reducer.stages.write_watch.watchers += 1
    reducer.stages.write_watch.watchers -= 1
    _backward(reducer, [2, 1, 0], finalize=False)
    reducer.params[0].grad.mul_(2)  # written after its copy-in, while one watcher is attached
    with pytest.raises(RuntimeError, match=r"gradients of a \(bucket 0\) were changed on rank 0"):
        reducer.finalize()
    reducer.stages.write_watch.watchers -= 1
    _backward(reducer, [2, 1, 0], finalize=False)
    reducer.params[0].grad.mul_(2)  # nobody watches: the reduced value replaces it, as in DDP
    reducer.finalize()
    assert float(reducer.params[0].grad[0]) == 1.0


def test_the_nonfinite_check_is_switched_by_the_setter(one_rank: None) -> None:
    reducer = _reducer()
    assert reducer.stages.check_nonfinite is False
    reducer.stages.check_nonfinite = True
    assert reducer.stages.check_nonfinite is True
    reducer.prepare_for_backward()
    _grad(reducer, 2, float("nan"))
    with pytest.raises(FloatingPointError, match="rank 0: c"):
        reducer.mark_ready(2)
    assert reducer.state is ReducerState.IDLE, "every rank stops before the bucket: the iteration is dropped"
    reducer.stages.check_nonfinite = False
    _backward(reducer, [2, 1, 0])
    assert reducer.reductions == 1


class Recording:
    """A consumer that records what it is handed (bucket/consumer.py)."""

    name = "recording"

    def __init__(self, reducer: Reducer, seen: list[Any]) -> None:
        self._reducer, self.seen = reducer, seen

    def take(self, bucket: Any) -> None:
        self.seen.append([_index(self._reducer, p) for p in bucket.params])

    def all_taken(self) -> None:
        self.seen.append("all")

    def abandoned(self) -> None:
        self.seen.append("abandoned")


def test_an_attached_consumer_takes_each_bucket_after_the_copy_then_hears_the_end(one_rank: None) -> None:
    reducer = _reducer()
    seen: list[Any] = []
    consumer = Recording(reducer, seen)
    reducer.attach(consumer)
    assert reducer.consumers[1:] == [consumer]
    _backward(reducer, [2, 1, 0])
    assert seen == [[2], [1], [0], "all"]
    reducer.detach(consumer)
    _backward(reducer, [2, 1, 0])
    assert seen == [[2], [1], [0], "all"] and len(reducer.consumers) == 1


def test_consumers_are_attached_only_outside_a_backward_and_hear_an_abandoned_iteration(one_rank: None) -> None:
    reducer = _reducer()
    seen: list[Any] = []
    consumer = Recording(reducer, seen)
    reducer.prepare_for_backward()
    reducer.attach(consumer)  # armed, no gradient taken yet: allowed
    _grad(reducer, 2, 1.0)
    reducer.mark_ready(2)
    with pytest.raises(RuntimeError, match=r"recording can only be detached between iterations; the reducer is reducing on rank 0"):
        reducer.detach(consumer)
    with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
        reducer.prepare_for_forward()
    assert seen == ["abandoned"]


def test_static_graph_is_enabled_only_before_the_first_backward(one_rank: None) -> None:
    reducer = _reducer()
    reducer.enable_static_graph()
    assert reducer.options.static_graph and reducer.learns_graph_next
    after = _reducer()
    _backward(after, [2, 1, 0])
    with pytest.raises(RuntimeError, match=r"before the first backward and before load_bucket_state \(rank 0\)"):
        after.enable_static_graph()
    armed = _reducer()
    armed.prepare_for_backward()
    _grad(armed, 2, 1.0)
    armed.mark_ready(2)
    with pytest.raises(RuntimeError, match="before the first backward"):
        armed.enable_static_graph()
    restored = _reducer()
    restored.restore_bucket_order([0, 1, 2])
    with pytest.raises(RuntimeError, match="before the first backward"):
        restored.enable_static_graph()


def test_a_static_graph_learns_in_its_first_backward_then_overlaps(one_rank: None) -> None:
    reducer = _reducer(options=ReducerOptions(static_graph=True))
    assert reducer.learns_graph_next and not reducer.needs_end_of_backward_trigger
    reducer.prepare_for_backward()
    assert reducer.mode is GraphMode.LEARNING_STATIC and reducer.state is ReducerState.ARMED
    assert reducer.needs_end_of_backward_trigger
    for i in (2, 0):  # b is never used
        _grad(reducer, i, 1.0)
        assert reducer.mark_ready(i) is False
        assert reducer.state is ReducerState.LEARNING
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is False, "a second firing is counted, not an error, while learning"
    reducer.reduce_at_end_of_backward()
    assert reducer.state is ReducerState.IDLE and not reducer.learns_graph_next and reducer.reductions == 1
    assert reducer.params[1].grad is None, "unused in the learned graph: left alone"
    reducer.prepare_for_backward()
    assert reducer.mode is GraphMode.STATIC and not reducer.needs_end_of_backward_trigger
    _grad(reducer, 2, 1.0)
    assert reducer.mark_ready(2) is False
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is False, "fired once of the two times it fired in the first backward"
    assert reducer.mark_ready(0) is True, "its second firing makes it final; b is unused: all launched"
    reducer.finalize()
    assert reducer.reductions == 2


def test_a_static_graph_skips_the_buckets_its_first_backward_never_used(one_rank: None) -> None:
    """skip_all_reduce_unused_params in the learning backward: the parameters that never fired are
    those counted at its end, and only their bucket is left out."""
    options = ReducerOptions(static_graph=True, find_unused_parameters=True, skip_all_reduce_unused_params=True)
    reducer = _reducer(options=options)
    log = FenceLog()
    reducer.fence.log = log
    reducer.prepare_for_forward()
    reducer.prepare_for_backward()
    for i in (2, 0):  # b is never used
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.reduce_at_end_of_backward()
    assert [e.bucket for e in log.edges if e.edge == "launched"] == [0, 2], "b's bucket (1) skipped"


def test_a_learned_static_graph_refuses_a_new_parameter_and_an_extra_firing(one_rank: None) -> None:
    reducer = _reducer(options=ReducerOptions(static_graph=True))
    reducer.prepare_for_backward()
    for i in (2, 0):
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.reduce_at_end_of_backward()
    reducer.prepare_for_backward()
    _grad(reducer, 1, 1.0)
    with pytest.raises(RuntimeError, match=r"parameter b \(index 1\) was unused in the first iteration .* rank 0"):
        reducer.mark_ready(1)
    reducer = _reducer(options=ReducerOptions(static_graph=True))
    _learn(reducer, [2, 1, 0])
    reducer.prepare_for_backward()
    _grad(reducer, 2, 1.0)
    reducer.mark_ready(2)
    with pytest.raises(RuntimeError, match=r"only once. Parameter c \(index 2\)"):
        reducer.mark_ready(2)  # fired more often than in the first backward


def _learn(reducer: Reducer, order: list[int]) -> None:
    reducer.prepare_for_backward()
    for i in order:
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.reduce_at_end_of_backward()


def test_unused_parameters_are_counted_in_with_the_first_gradient(one_rank: None) -> None:
    options = ReducerOptions(find_unused_parameters=True)
    params = _params()
    reducer = _reducer(params=params, options=options)
    out = (params[0] * 2).sum() + (params[2] * 3).sum()  # b is not used by this forward
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([out])
    assert reducer.mode is GraphMode.OVERLAP and not reducer.needs_end_of_backward_trigger
    log = FenceLog()
    reducer.fence.log = log
    _grad(reducer, 2, 1.0)
    assert reducer.mark_ready(2) is False
    assert [e.bucket for e in log.edges if e.edge == "launched"] == [0, 1], "b's bucket is full at once"
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is True
    reducer.finalize()
    assert params[1].grad is None, "globally unused: left untouched"


def test_skipped_buckets_of_unused_parameters_are_never_launched(one_rank: None) -> None:
    options = ReducerOptions(find_unused_parameters=True, skip_all_reduce_unused_params=True)
    params = _params()
    reducer = _reducer(params=params, options=options)
    log = FenceLog()
    reducer.fence.log = log
    reducer.prepare_for_backward([(params[0] * 2).sum()])
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is True
    reducer.finalize()
    assert [e.bucket for e in log.edges if e.edge in ("launched", "completed")] == [2, 2], "only a's bucket"
    assert params[1].grad is None and params[2].grad is None


def test_a_reentrant_checkpoint_that_hides_parameters_defers_to_the_end(one_rank: None) -> None:
    options = ReducerOptions(find_unused_parameters=True)
    params = _params()
    reducer = _reducer(params=params, options=options)
    x = torch.ones(2, requires_grad=True)
    hidden = torch.utils.checkpoint.checkpoint(lambda t: t * params[0], x, use_reentrant=True)
    reducer.prepare_for_backward([hidden.sum() + (params[2] * 1).sum()])
    assert reducer.mode is GraphMode.COUNTING_ONLY
    assert reducer.needs_end_of_backward_trigger
    _grad(reducer, 2, 1.0)
    assert reducer.mark_ready(2) is False and reducer.state is ReducerState.LEARNING
    _grad(reducer, 0, 1.0)
    assert reducer.mark_ready(0) is False, "counted only"
    reducer.reduce_at_end_of_backward()
    assert reducer.state is ReducerState.IDLE and params[1].grad is None
    assert float(params[0].grad[0]) == 1.0


def test_a_checkpoint_over_activations_only_keeps_the_overlap(one_rank: None) -> None:
    options = ReducerOptions(find_unused_parameters=True)
    params = _params()
    reducer = _reducer(params=params, options=options)
    x = torch.ones(2, requires_grad=True)
    hidden = torch.utils.checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
    outputs = [(hidden * params[0]).sum() + (params[1].sum() + params[2].sum())]
    reducer.prepare_for_backward(outputs)
    assert reducer.mode is GraphMode.OVERLAP


def test_what_the_reducer_reports_about_its_layout(one_rank: None) -> None:
    reducer = _reducer()
    assert reducer.caps is ONE_BYTE
    sparse = reducer.sparse_gradient
    sparse.append(True)
    assert reducer.sparse_gradient == [False, False, False], "a copy"
    assert reducer.layouts.bucket_order() is None and reducer.tuned_buckets() is None
    assert not reducer.layouts.rebuilt
    _backward(reducer, [0, 2, 1])
    reducer.prepare_for_forward()  # DDP's one rebuild, from the order of the first backward
    assert reducer.layouts.rebuilt
    assert reducer.layouts.bucket_order() == [0, 2, 1]


def test_a_restored_order_is_adopted_and_none_changes_nothing(one_rank: None) -> None:
    reducer = _reducer()
    before = reducer.plan
    reducer.restore_bucket_order(None)
    assert reducer.plan is before
    reducer.restore_bucket_order([1, 0, 2])
    assert reducer.layouts.bucket_order() == [1, 0, 2] and reducer.plan.buckets == ((1,), (0,), (2,))


def test_a_new_layout_with_bucket_views_moves_the_gradients_along(one_rank: None) -> None:
    reducer = _reducer(options=ReducerOptions(gradient_as_bucket_view=True))
    _backward(reducer, [0, 2, 1])
    reducer.prepare_for_forward()  # rebuilt: the same buckets in another order, new buffers
    for i, param in enumerate(reducer.params):
        assert float(param.grad[0]) == i + 1.0
        storage = reducer.pipelines[reducer.plan.locate()[i][0]].storage
        assert param.grad.data_ptr() == storage.views[0].data_ptr(), f"{NAMES[i]}'s grad is its new view"


def test_a_new_layout_with_bucket_views_passes_over_a_sparse_bucket(one_rank: None) -> None:
    """A sparse bucket has no views: the gradients that move are the dense buckets' only."""
    params = _params()
    reducer = Reducer(params, NAMES[:3], dist.group.WORLD, Fence(), ONE_BYTE, [True, False, False],
                      ReducerOptions(gradient_as_bucket_view=True))
    reducer.prepare_for_forward()
    reducer.prepare_for_backward()
    for i in (0, 2, 1):
        dense = torch.full_like(params[i], i + 1.0)
        params[i].grad = dense.to_sparse() if i == 0 else dense
        reducer.mark_ready(i)
    reducer.finalize()
    reducer.prepare_for_forward()  # rebuilt in the order (0, 2, 1)
    assert reducer.layouts.bucket_order() == [0, 2, 1]
    assert params[0].grad.is_sparse and [float(p.grad[0]) for p in params[1:]] == [2.0, 3.0]


def _many(count: int, caps: BucketCaps, options: ReducerOptions = ReducerOptions()) -> Reducer:
    """``count`` one-element parameters: more than CPython's cached small integers (up to 256), so
    counts compared by identity instead of value would differ."""
    params = _params((1,) * count)
    return Reducer(params, [f"p{i}" for i in range(count)], dist.group.WORLD, Fence(), caps, [False] * count, options)


def test_the_reducer_takes_its_arguments_by_keyword(one_rank: None) -> None:
    params = _params()
    reducer = Reducer(params=params, names=NAMES, process_group=dist.group.WORLD, fence=Fence(), caps=ONE_BYTE,
                      sparse_gradient=[False] * 3, options=ReducerOptions(find_unused_parameters=True))
    assert reducer.options.find_unused_parameters and reducer.plan.buckets == ((2,), (1,), (0,))


def test_more_buckets_than_small_integers_all_launch(one_rank: None) -> None:
    reducer = _many(300, ONE_BYTE)
    assert not any(_backward(reducer, list(range(299, 0, -1)), finalize=False))
    assert reducer.mark_ready(0) is True  # the last bucket: every one launched
    reducer.finalize()
    assert reducer.state is ReducerState.IDLE


def test_more_buckets_than_small_integers_searching_unused_parameters(one_rank: None) -> None:
    reducer = _many(300, ONE_BYTE, ReducerOptions(find_unused_parameters=True))
    params = reducer.params
    out = sum((p * 2).sum() for p in params[1:])  # p0 unused
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([out])
    for i in range(299, 0, -1):
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.finalize()
    assert params[0].grad is None and all(float(p.grad[0]) == 1.0 for p in params[1:])


def test_only_the_last_of_more_buckets_than_small_integers_is_last(one_rank: None) -> None:
    reducer = _many(300, ONE_BYTE)
    last: list[int] = []

    def recording(state: Any, bucket: Any) -> torch.futures.Future:
        if bucket.is_last():
            last.append(bucket.index())
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    reducer.reduction.set_comm_hook(None, recording)
    _backward(reducer, list(range(299, -1, -1)))
    assert last == [299]


def test_a_bucket_of_more_members_than_small_integers_is_untouched_until_a_gradient(one_rank: None) -> None:
    reducer = _many(301, BucketCaps(first_bytes=1, bytes_cap=1 << 20, per_bucket=(1, 1 << 20)))
    assert [len(b) for b in reducer.plan.buckets] == [300, 1]
    [alone] = reducer.plan.buckets[1]
    _backward(reducer, [alone], finalize=False)
    assert reducer.unfinished_buckets() == [1]  # bucket 0, untouched, is missing all its 300


def test_a_forward_from_inside_backward_is_refused_only_with_buckets_in_flight(one_rank: None) -> None:
    reducer = _reducer()
    reducer.check_not_in_backward()  # not in a backward
    _backward(reducer, [2], finalize=False)
    reducer.check_not_in_backward()  # in flight, but not in a backward
    seen: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            try:
                reducer.check_not_in_backward()
            except RuntimeError as error:
                seen.append(str(error))
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert len(seen) == 1 and "on rank 0 while buckets [0] are being reduced" in seen[0]


def test_a_comm_hook_and_token_weighting_are_the_reductions(one_rank: None) -> None:
    reducer = _reducer()
    assert reducer.reduction.comm_hook is None

    seen: list[tuple[int, bool, int]] = []

    def doubled(state: Any, bucket: Any) -> torch.futures.Future:
        seen.append((bucket.index(), bucket.is_last(), bucket.buffer().numel()))
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer() * 2)
        return future

    reducer.reduction.set_comm_hook("state", doubled)
    assert reducer.reduction.comm_hook == ("state", doubled)
    _backward(reducer, [2, 1, 0])
    assert [float(p.grad[0]) for p in reducer.params] == [2.0, 4.0, 6.0]
    assert seen == [(0, False, 4), (1, False, 3), (2, True, 2)], "as DDP's buckets: unpadded, the last one last"
    for caps in (ONE_BYTE, BucketCaps.from_user(None, None)):  # three buckets, one
        weighted = _reducer(caps=caps)
        weighted.reduction.enable_token_weighting(torch.device('cpu')).add(4)
        _backward(weighted, [2, 1, 0])
        assert [float(p.grad[0]) for p in weighted.params] == [0.25, 0.5, 0.75]


@pytest.mark.parametrize("find_unused", (True, False))
def test_a_joined_ranks_shadow_backward_counts_as_no_reduction(one_rank: None, find_unused: bool) -> None:
    """With the unused-parameter search, the usage map's all-reduce is shadowed too; without it there
    is no map to shadow."""
    reducer = _reducer(options=ReducerOptions(find_unused_parameters=find_unused))
    shadowed: list[tuple[int, float]] = []

    def recording(state: Any, bucket: Any) -> torch.futures.Future:
        shadowed.append((bucket.index(), float(bucket.buffer().abs().sum())))
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    reducer.reduction.set_comm_hook(None, recording)
    reducer.shadow_backward()
    assert shadowed == [(0, 0.0), (1, 0.0), (2, 0.0)], "every bucket's collective, on zeros"
    assert reducer.reductions == 0 and reducer.state is ReducerState.IDLE
    assert all(p.grad is None for p in reducer.params)


def test_the_delayed_all_reduce_launches_once_per_synchronized_backward(one_rank: None) -> None:
    delayed_param = torch.zeros(2, requires_grad=True)
    delayed = DelayedReduction([delayed_param], ["d"], dist.group.WORLD)
    reducer = _reducer(delayed=delayed)
    reducer.launch_delayed()
    assert not delayed.launched, "not in a synchronized backward"
    reducer.prepare_for_backward()
    delayed_param.grad = torch.full_like(delayed_param, 3.0)
    delayed.gradient_ready(0, reducer.fence)
    reducer.launch_delayed()
    assert delayed.launched
    for i in (2, 1, 0):
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.finalize()
    assert float(delayed_param.grad[0]) == 3.0 and not delayed.launched


def test_a_hook_fired_without_a_gradient_is_not_a_use(one_rank: None) -> None:
    """As DDP: an output the loss never reached fires its parameters' hooks with no gradient."""
    for options in (ReducerOptions(find_unused_parameters=True), ReducerOptions(static_graph=True)):
        params = _params()
        reducer = _reducer(params=params, options=options)
        reducer.prepare_for_backward([sum(p.sum() for p in params)])  # the forward used all three
        for i in (2, 1, 0):
            if i != 1:
                _grad(reducer, i, 1.0)
            reducer.mark_ready(i)
        if reducer.needs_end_of_backward_trigger:
            reducer.reduce_at_end_of_backward()
        else:
            reducer.finalize()
        assert params[1].grad is None, f"{options}: b had no gradient on any rank, so it is left alone"


def _doubling(state: Any, bucket: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer() * 2)
    return future


def test_a_gradient_used_here_is_written_back_whether_the_search_is_dynamic_or_learned(one_rank: None) -> None:
    """The usage map marks each gradient this rank produced, in the dynamic search and in a static
    graph's first backward alike: a marked one is written back (doubled by the hook), never left local."""
    for options in (ReducerOptions(find_unused_parameters=True), ReducerOptions(static_graph=True)):
        params = _params()
        reducer = _reducer(params=params, options=options)
        reducer.reduction.set_comm_hook(None, _doubling)
        reducer.prepare_for_forward()
        reducer.prepare_for_backward([sum(p.sum() for p in params)])
        for i in (2, 1, 0):
            _grad(reducer, i, i + 1.0)
            reducer.mark_ready(i)
        if reducer.needs_end_of_backward_trigger:
            reducer.reduce_at_end_of_backward()
        else:
            reducer.finalize()
        assert [float(p.grad[0]) for p in params] == [2.0, 4.0, 6.0], options


def test_a_consumer_is_refused_once_a_gradient_is_taken_even_with_nothing_in_flight(one_rank: None) -> None:
    """Bucket 2's gradient waits for buckets 0 and 1 to launch first: nothing is in flight, but the
    backward has begun, so a consumer attached now would miss that bucket's take."""
    reducer = _reducer()
    reducer.prepare_for_backward()
    _grad(reducer, 0, 1.0)
    reducer.mark_ready(0)  # parameter 0 is the last bucket's
    assert reducer.fence.in_flight() == [] and reducer.state is ReducerState.REDUCING
    with pytest.raises(RuntimeError, match="recording can only be attached between iterations; the reducer is reducing"):
        reducer.attach(Recording(reducer, []))


def test_the_usage_all_reduce_starts_once_after_the_last_bucket_launched(one_rank: None) -> None:
    """One all-reduce of the usage flags per backward of the dynamic search, after every bucket's: an
    earlier one would send flags that later gradients have not set yet."""
    reducer = _reducer(options=ReducerOptions(find_unused_parameters=True))
    usage = reducer._usage
    assert usage is not None
    launched: list[list[int]] = []  # the buckets in flight at each launch of the usage all-reduce
    launch = usage.launch_reduction
    usage.launch_reduction = lambda group: (launched.append(list(reducer.fence.in_flight())), launch(group))[-1]  # type: ignore[method-assign]
    reducer.prepare_for_forward()
    reducer.prepare_for_backward([sum(p.sum() for p in reducer.params)])  # every parameter used
    for i in (2, 1, 0):
        _grad(reducer, i, 1.0)
        reducer.mark_ready(i)
    reducer.finalize()
    assert launched == [[0, 1, 2]]
