"""When each thing happens: the reducer's state machine, driven by ``mark_ready(i)`` and ``finalize()``.

It knows tensors, buckets and collectives, never ``nn.Module`` or autograd hooks, so it can be
driven by hand in tests. The wrapper calls, per iteration:

``prepare_for_forward()`` (grad-enabled forward: apply a pending rebuild) ->
``prepare_for_backward()`` (synchronized forward: expect gradients) ->
``mark_ready(i)`` once per parameter (copy in; launch complete buckets in index order) ->
``finalize()`` once, at the end of backward (complete every bucket; write ``param.grad``).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import BucketCaps, BucketPlan
from overlapddp.bucket_storage import BucketStorage
from overlapddp.bucket_reduction import BucketReduction
from overlapddp.comm_hook import Bucket, CommHook, hook_result
from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import Fence
from overlapddp.layout_lifecycle import LayoutLifecycle
from overlapddp.gradient_checks import GradientWriteWatch, nonfinite_error
from overlapddp.param_usage import UsageMap, grad_accumulators, unreachable
from overlapddp.progress import ProgressRecord
from overlapddp.sparse_reduction import SparseBucketStorage
from overlapddp.sync_checks import SyncFlagCheck
from overlapddp.token_weighting import TokenCount
from overlapddp.torch_compat import in_backward

if TYPE_CHECKING:
    from overlapddp.tuning.clock import Stamp
    from overlapddp.tuning.tuner import PlanTuner


class ReducerState(enum.Enum):
    """Where the reducer is in an iteration: the only record of it.

    IDLE -> ARMED (prepare_for_backward) -> REDUCING (first gradient counted in) -> FINALIZING
    (finalize) -> IDLE; a static graph's first backward: ARMED -> LEARNING (first gradient) ->
    REDUCING (reduce_at_end_of_backward counts every gradient in) -> FINALIZING -> IDLE, and so does
    a dynamic graph's backward through a reentrant checkpoint (find_unused_parameters). A failure
    abandons the iteration: any state -> IDLE (_abandon).
    """

    IDLE = "idle"  # no synchronized backward expected: before the first forward, or after finalize
    ARMED = "armed"  # a synchronized forward ran; its backward's gradients are to be reduced, none came yet
    LEARNING = "learning"  # gradients are counted, nothing launched (static graph's first; reentrant checkpoint)
    REDUCING = "reducing"  # gradients are copied in and complete buckets launched; finalize is owed
    FINALIZING = "finalizing"  # the end-of-backward callback is completing buckets


# A gradient arriving in these states belongs to a synchronized backward (otherwise it is local).
_IN_BACKWARD = (ReducerState.REDUCING, ReducerState.ARMED, ReducerState.LEARNING)  # most frequent first
# The states a new iteration may not start from: a backward began and its reduction is unfinished.
_UNFINISHED = (ReducerState.LEARNING, ReducerState.REDUCING, ReducerState.FINALIZING)


@dataclass(frozen=True)
class ReducerOptions:
    """DDP's behaviour switches that change when and how gradients are reduced."""

    find_unused_parameters: bool = False  # search each forward's graph; skip globally unused grads
    static_graph: bool = False  # learn the graph in iteration 1, reduce it all at its end
    gradient_as_bucket_view: bool = False  # param.grad is a view into its bucket, no copy-out
    batched_grad_copy: bool = False  # copy unscaled, then divide each bucket (true division)
    skip_all_reduce_unused_params: bool = False  # never reduce buckets holding only unused params
    tuned_plan: bool = False  # after DDP's rebuild, measure, model and select buckets (tuning/tuner.py)


class Reducer:
    """Reduces the gradients of ``params`` in buckets, overlapping each collective with backward."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        fence: Fence,
        caps: BucketCaps,
        sparse_gradient: Sequence[bool],
        options: ReducerOptions = ReducerOptions(),
        *,
        delayed: DelayedReduction | None = None,
        check_nonfinite: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self._fence = fence
        self._caps = caps
        self._sparse_gradient = list(sparse_gradient)
        self._reduction = BucketReduction(process_group, options.batched_grad_copy)  # what each collective does
        self.state = ReducerState.IDLE
        # Read by the optimizer guards: reductions and synchronized forwards so far, and whether a
        # no_sync backward left local gradients since the last reduction (a fact about param.grad
        # that outlives the iteration's state: it holds through ARMED and LEARNING).
        self.reductions = self.synchronized_forwards = 0
        self.local_gradients_since_reduction = False
        self._local_probe = 0  # a parameter that received such a local gradient (see prepare_for_backward)
        self.sync_flags = SyncFlagCheck()  # the wrapper's require_backward_grad_sync (it installs its own)
        self.progress = ProgressRecord()  # where this rank is, for desync errors (the wrapper installs one)
        self.checks_nonfinite = check_nonfinite  # before each launch, see gradient_checks.nonfinite_error
        # While optimizer guards are attached: gradients written while their bucket was reduced.
        self._write_watch = GradientWriteWatch(self.names, self.params, self.rank)
        # Called in finalize with each bucket's parameters once its gradients are written, while
        # later buckets may still be reducing: the overlapped optimizer's per-bucket update.
        self.after_bucket_reduced: Callable[[list[torch.Tensor]], None] | None = None
        self.after_all_reduced: Callable[[], None] | None = None  # once, when every bucket is written
        # delay_all_reduce_named_params: launched by launch_delayed, completed in finalize.
        self.delayed = delayed
        self._layouts = LayoutLifecycle(self.params, self._sparse_gradient, caps, options)
        self._configure(options)
        self._install_plan(self._layouts.initial_plan())

    def _configure(self, options: ReducerOptions) -> None:
        """Everything but the layout that depends on the graph options, as before the first iteration."""
        self.options = options
        tracks_usage = options.find_unused_parameters or options.static_graph
        self._usage = UsageMap(len(self.params), self.params[0].device) if tracks_usage else None
        self._accumulators = grad_accumulators(self.params) if self._dynamic_unused else []
        # Parameters no output reached (dynamic) or whose hook never fired in iteration 1 (static).
        self._unused: list[int] = []
        # Static graph: hook firings per parameter in this backward, and in the first one (None
        # until the first synchronized backward ended: the graph is not learned yet).
        self._fires = [0] * len(self.params)
        self._expected_fires: list[int] | None = None
        # Dynamic graph through a reentrant checkpoint: this backward only counts its gradients and
        # reduces them all at its end (see reduce_at_end_of_backward).
        self._counting_only = False

    def enable_static_graph(self) -> None:
        """Switch to ``static_graph=True`` (DDP's ``_set_static_graph``); only before the first backward
        and before a checkpointed layout was loaded. The buckets stay as constructed, as in DDP."""
        if self.reductions or self.state is not ReducerState.IDLE or self._layouts.changed:
            raise RuntimeError(
                f"static_graph can only be turned on before the first backward and before load_bucket_state "
                f"(rank {self.rank}); pass static_graph=True to the constructor instead."
            )
        self._configure(dataclasses.replace(self.options, static_graph=True))
        self._layouts.enable_static_graph()

    def set_nonfinite_check(self, enabled: bool) -> None:
        """Turn the non-finite gradient check on or off (see gradient_checks.py)."""
        self.checks_nonfinite = enabled

    def watch_gradient_writes(self, watching: bool = True) -> None:
        """An optimizer guard attaches (or, ``watching=False``, detaches): see gradient_checks.py."""
        self._write_watch.watchers += 1 if watching else -1

    def set_reduction_callbacks(
        self, after_bucket: Callable[[list[torch.Tensor]], None] | None, after_all: Callable[[], None] | None
    ) -> None:
        """The overlapped optimizer's per-bucket update and its end (None, None: detach)."""
        self.after_bucket_reduced, self.after_all_reduced = after_bucket, after_all

    # -- layout -------------------------------------------------------------------------------

    def _install_plan(self, plan: BucketPlan) -> None:
        self.plan = plan
        located = plan.locate()
        self._bucket_of = [located[i][0] for i in range(len(self.params))]
        self._storages = [self._new_storage(b, members) for b, members in enumerate(plan.buckets)]
        self._reset_iteration()

    def _new_storage(self, index: int, members: Sequence[int]) -> BucketStorage | SparseBucketStorage:
        """A flat buffer, or for a parameter that expects a sparse gradient its own gradient (sparse_reduction.py)."""
        if self._sparse_gradient[members[0]]:
            return SparseBucketStorage(index, [self.params[members[0]]], self.names[members[0]])
        return BucketStorage(index, [self.params[i] for i in members])

    def _reset_iteration(self) -> None:
        self._missing = [len(members) for members in self.plan.buckets]  # per bucket: gradients not copied in
        self._marked = [False] * len(self.params)
        self._next_launch = 0
        self._unused_marked = False
        self._fires = [0] * len(self.params)
        # Per synchronized backward, from the layout lifecycle: where to record each fired gradient
        # (while DDP's rebuild is awaited) and the tuner while it measures; None otherwise.
        self._record_ready: Callable[[int], None] | None = None
        self._timing: PlanTuner | None = None

    @property
    def _used(self) -> UsageMap:
        """The usage map, where the options guarantee one (unused-parameter search or static graph)."""
        return cast(UsageMap, self._usage)

    @property
    def _dynamic_unused(self) -> bool:
        return self.options.find_unused_parameters and not self.options.static_graph

    @property
    def needs_end_of_backward_trigger(self) -> bool:
        """Static graph, first iteration, or a dynamic graph through a reentrant checkpoint: nothing is
        reduced during backward; the wrapper must call :meth:`reduce_at_end_of_backward` when backward
        reaches the outputs' end."""
        first = self.options.static_graph and self._expected_fires is None
        return first or (self._counting_only and self.state in _IN_BACKWARD)

    @property
    def final_layout_iteration(self) -> int:
        """The first synchronized iteration (from 0) whose buckets stay (see LayoutLifecycle)."""
        return self._layouts.final_iteration

    @property
    def caps(self) -> BucketCaps:
        """The byte caps the buckets are planned with (a copy of the wrapper plans with them again)."""
        return self._caps

    @property
    def sparse_gradient(self) -> list[bool]:
        """Per parameter, whether its gradient is sparse (as given to the constructor)."""
        return list(self._sparse_gradient)

    @property
    def has_rebuilt_buckets(self) -> bool:
        """True once the ready-order rebuild has happened (or will never happen)."""
        return self._layouts.rebuilt

    def in_flight(self) -> list[int]:
        """Buckets with gradients already taken in this backward that finalize has not written back."""
        if self.state is ReducerState.IDLE:
            return []
        return [b for b, members in enumerate(self.plan.buckets) if self._missing[b] < len(members)]

    @property
    def fence(self) -> Fence:
        """The fence that orders every bucket's collective before its readers."""
        return self._fence

    def replace_fence(self, fence: Fence) -> Fence:
        """Swap in another fence (race-forcing tools wrap the real one); only between iterations."""
        if self.state is not ReducerState.IDLE or self._fence.in_flight():
            raise RuntimeError(
                f"The fence can only be replaced between iterations; the reducer is {self.state.value} "
                f"with buckets {self._fence.in_flight()} in flight."
            )
        previous, self._fence = self._fence, fence
        return previous

    def bucket_order(self) -> list[int] | None:
        """The gradient-ready order the buckets were rebuilt from (None before, or without, a rebuild)."""
        return self._layouts.bucket_order()

    def tuned_buckets(self) -> list[list[int]] | None:
        """The tuned layout, once installed (None before, or without ``bucket_plan="tuned"``)."""
        return [list(members) for members in self.plan.buckets] if self._layouts.tuned else None

    def restore_bucket_order(self, order: list[int] | None, tuned: list[list[int]] | None = None) -> None:
        """Resume with the layout a checkpointed run had, so that its continuation is bit-equal."""
        if order is None:
            return
        self._ensure_prior_reduction_finished()
        self._adopt_plan(self._layouts.restore(order, tuned))

    def enable_token_weighting(self) -> TokenCount:
        """Divide by the global token count instead of the world size (see token_weighting.py)."""
        return self._reduction.enable_token_weighting(self._storages[0].buffer.device)

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the scaled sum."""
        self._reduction.set_comm_hook(state, hook)

    @property
    def comm_hook(self) -> tuple[Any, CommHook] | None:
        """The registered ``(state, hook)``, or None for the default scaled sum."""
        return self._reduction.comm_hook

    def set_join_count(self, work: dist.Work, divide_by_initial_world_size: bool) -> None:
        """Under ``Join``: ``work`` sums 1 per rank still training; average over those ranks unless
        ``divide_by_initial_world_size``."""
        self._reduction.set_join_count(work, divide_by_initial_world_size)

    # -- the iteration ------------------------------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Check the last reduction finished; install the layout the lifecycle answers (DDP's one
        rebuild, the tuner's switches) between iterations."""
        self._ensure_prior_reduction_finished()
        device = self._storages[0].buffer.device
        self._layouts.at_forward(self.process_group, device, self.plan, self._adopt_plan)

    def _adopt_plan(self, plan: BucketPlan) -> None:
        """Switch layouts between iterations; with gradient_as_bucket_view, the gradients move along."""
        self._install_plan(plan)
        if self.options.gradient_as_bucket_view:
            for storage in self._storages:
                with torch.no_grad():
                    for param, view in zip(storage.params, storage.views, strict=False):  # a sparse bucket has no views
                        if param.grad is not None:
                            view.copy_(param.grad)
                storage.point_grads_at_views()

    def check_not_in_backward(self) -> None:
        """A forward from inside backward (a hook) would interleave its collectives with the buckets'."""
        if in_backward() and self.in_flight():
            raise RuntimeError(
                f"forward() was called during backward on rank {self.rank} while buckets {self.in_flight()} "
                "are being reduced; run the next forward after loss.backward() has returned."
            )

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """A synchronized forward ran: the next backward's gradients are to be reduced.

        With ``find_unused_parameters`` the forward's ``outputs`` tell which parameters it used.
        """
        self._ensure_prior_reduction_finished()
        dropped = self.state is ReducerState.ARMED  # the previous forward's backward never came
        if self.local_gradients_since_reduction and self.params[self._local_probe].grad is None:
            self.sync_flags.discarded(self.rank, "zero_grad() (or setting .grad to None) before this forward")
        self._reset_iteration()
        self.synchronized_forwards += 1
        self.progress.forward(self.synchronized_forwards, self.reductions, dropped)
        self._reduction.arm()
        self._record_ready, self._timing = self._layouts.start_iteration()
        if self._dynamic_unused:
            self._unused, hidden = unreachable(outputs, self._accumulators)
            # Only a checkpoint that hides parameters defers the reduction; one over an activation
            # leaves every parameter reachable, and the backward overlaps as in DDP.
            self._counting_only = hidden and bool(self._unused)
        self.state = ReducerState.ARMED  # IDLE or ARMED -> ARMED: this forward's backward is reduced

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index`` has its gradient; returns True when every bucket has launched.

        The caller then queues :meth:`finalize` to run at the end of this backward.
        """
        if self._usage is not None and (self._dynamic_unused or self._expected_fires is None):
            self._usage.mark_used(index)
        if self.state not in _IN_BACKWARD:
            self.local_gradients_since_reduction = True
            self._local_probe = index
            if self.sync_flags.requested:
                self.sync_flags.unarmed_backward(self.rank)
            return False
        if not self.sync_flags.requested:
            self.sync_flags.synced_under_no_sync(self.rank)
        if self._counting_only:
            self._fires[index] += 1
            self.state = ReducerState.LEARNING  # ARMED -> LEARNING: reduced at the end of backward
            return False
        if self.options.static_graph:
            self._fires[index] += 1
            if self._expected_fires is None:
                self.state = ReducerState.LEARNING  # ARMED -> LEARNING: the graph's first backward
                return False  # iteration 1 only learns the graph
            expected = self._expected_fires[index]
            if expected == 0:
                raise RuntimeError(
                    f"Your training graph has changed in this iteration: parameter {self.names[index]} "
                    f"(index {index}) was unused in the first iteration but received a gradient now on rank "
                    f"{self.rank}. This is not compatible with static_graph=True."
                )
            if self._fires[index] < expected:
                return False
        if self._marked[index]:
            raise RuntimeError(
                f"Expected to mark a variable ready only once. Parameter {self.names[index]} (index {index}) "
                f"received its gradient twice in one backward on rank {self.rank}. This happens when a "
                "parameter is used outside forward, in two reentrant checkpoints (torch.utils.checkpoint with "
                "use_reentrant=True: pass find_unused_parameters=True, or static_graph=True if the graph is the "
                "same every step), or in several backwards of one forward (use no_sync() for all but the last)."
            )
        if self._record_ready is not None:
            self._record_ready(index)
        if not self._unused_marked:
            self._unused_marked = True
            for unused in self._unused:
                self._mark(unused)
        self._mark(index)
        return self._next_launch == len(self._storages)

    def _mark(self, index: int) -> None:
        """Count one gradient in; fill and launch every bucket that is complete, in index order."""
        self._marked[index] = True
        self.state = ReducerState.REDUCING  # ARMED or LEARNING -> REDUCING: finalize is owed from here
        if self._timing is not None:
            self._timing.gradient_ready(index)
        bucket = self._bucket_of[index]
        self._fence.gradient_ready(bucket)
        self._missing[bucket] -= 1
        if self._missing[bucket] == 0:
            self._fill(bucket)
        while self._next_launch < len(self._storages) and self._missing[self._next_launch] == 0:
            if not self._skipped(self._next_launch):
                self._launch(self._next_launch)
            self._next_launch += 1
            if self._next_launch == len(self._storages) and self._dynamic_unused:
                self._used.launch_reduction(self.process_group)

    def _skipped(self, bucket: int) -> bool:
        """``skip_all_reduce_unused_params``: a bucket of only unused parameters is not reduced."""
        if not self.options.skip_all_reduce_unused_params:
            return False
        unused = set(self._unused)
        return all(i in unused for i in self.plan.buckets[bucket])

    def launch_delayed(self) -> None:
        """``param_to_hook_all_reduce`` has its gradient: start the delayed all-reduce, once per
        synchronized backward (finalize completes it, or starts it if this never ran)."""
        delayed = cast(DelayedReduction, self.delayed)  # this hook is registered only with one
        if self.state in _IN_BACKWARD and not delayed.launched:
            delayed.launch(self._fence)

    def reduce_at_end_of_backward(self) -> None:
        """End of a backward that only counted its gradients: every parameter that received none is
        unused (in the static graph's first backward, for good); then reduce everything."""
        if self.options.static_graph:
            self._used.launch_reduction(self.process_group)
            self._expected_fires = list(self._fires)
        self._unused = [i for i, fires in enumerate(self._fires) if fires == 0]
        self._unused_marked = True
        for index in range(len(self.params)):
            self._mark(index)
        self.finalize()

    def _fill(self, index: int) -> None:
        """Copy a complete bucket's gradients in, scaled as DDP scales them (batched, once per bucket)."""
        storage = self._storages[index]
        self._fence.filling(index)
        self._reduction.copy_in(storage)
        if self.options.gradient_as_bucket_view:
            storage.point_grads_at_views()
        elif self._write_watch.watchers:
            self._write_watch.taken(index, self.plan.buckets[index], storage.params)
        self._fence.produced(index, storage.buffer)  # on the stream that wrote the bucket

    def _globally_used(self, index: int) -> bool:
        """Whether any rank produced this gradient; a globally unused gradient is left untouched."""
        return self._usage is None or self._usage.globally_used(index)

    def _launch(self, index: int) -> None:
        storage = self._storages[index]
        if self.checks_nonfinite:
            self._fence.order_after_produced(index)  # the check reads param.grad, maybe on another stream
            members, device = self.plan.buckets[index], storage.buffer.device
            error = nonfinite_error(index, members, storage.params, self.names, device, self.process_group)
            if error is not None:
                self._abandon()
                raise error
        bucket = self._hook_bucket(index, storage.buffer)
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{index}.launch"):
            self._fence.launch(index, lambda: self._start_measured(bucket))

    def _start_measured(self, bucket: Bucket) -> torch.futures.Future:
        """Start the reduction; while the tuned plan calibrates, also time it for the tuner."""
        timing = self._timing
        if timing is None or not timing.measuring:
            return self._reduction.start(bucket)
        started, launched = time.perf_counter(), timing.now()
        future = self._reduction.start(bucket)
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        timing.bucket_launched(nbytes, len(bucket.parameters()), started, launched, future)
        return future

    def _hook_bucket(self, index: int, buffer: torch.Tensor) -> Bucket:
        """Bucket ``index`` over ``buffer`` as the comm-hook adapter a hook receives."""
        storage = self._storages[index]
        return Bucket(
            index, buffer, storage.offsets, storage.lengths, storage.params,
            is_last=index == len(self._storages) - 1,
        )

    def shadow_backward(self) -> None:
        """A joined rank's backward: the same collectives as the others', on zeros, in the same order."""
        futures = [
            self._reduction.start(self._hook_bucket(index, torch.zeros_like(storage.buffer)))
            for index, storage in enumerate(self._storages)
        ]
        for future in futures:
            future.wait()
        if self._dynamic_unused:
            self._used.shadow_reduction(self.process_group)
        self._layouts.iteration_shadowed()

    def finalize(self) -> None:
        """Complete every bucket in order and write the reduced values into ``param.grad``."""
        self.state = ReducerState.FINALIZING  # REDUCING -> FINALIZING: every bucket launched, backward over
        self._fence.backward_ended()
        try:
            for index in range(len(self._storages)):
                if not self._skipped(index):
                    self._write_back(index)
            if self.delayed is not None:
                self.delayed.finish(self._fence)
            if self._usage is not None:
                self._usage.settle()
            if self.after_all_reduced is not None:
                self.after_all_reduced()
        except BaseException:
            self._abandon()
            raise
        if self._dynamic_unused:
            self._used.reset()
        self._fence.end_iteration()
        self._layouts.iteration_reduced(self._unused)
        self.reductions += 1
        self.progress.reduced(self.synchronized_forwards, self.reductions)
        self.local_gradients_since_reduction = False
        self._record_ready, self._timing = None, None
        self.state = ReducerState.IDLE  # FINALIZING -> IDLE: every gradient written

    def _write_back(self, index: int) -> None:
        """Complete bucket ``index`` and copy its reduced values into ``param.grad``; then its callback."""
        storage = self._storages[index]
        timing = self._timing if self._timing is not None and self._timing.measuring else None
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{index}.complete"):
            value = self._complete(index)
            reduced_at = timing.now() if timing is not None else None
            self._write_watch.check(index)
            write = [self._globally_used(i) for i in self.plan.buckets[index]]
            result = hook_result(value, self._reduction.hook_name, index, storage.buffer)
            storage.copy_out(result, write, as_view=self.options.gradient_as_bucket_view)
            written = [p.grad for p in storage.params if p.grad is not None]
            self._fence.consumed(index, "copy to param.grad", written)
        if self.after_bucket_reduced is not None:
            self.after_bucket_reduced(storage.params)
        if timing is not None:
            timing.bucket_finalized(cast("Stamp", reduced_at), timing.now())

    def _complete(self, index: int) -> object:
        """The bucket's reduced value, or an error that says which bucket and rank failed (and, from the
        progress records, which ranks are behind)."""
        try:
            return self._fence.complete(index)
        except Exception as error:
            members = self.plan.buckets[index]
            names = ", ".join(self.names[i] for i in members[:4]) + (", ..." if len(members) > 4 else "")
            raise RuntimeError(
                f"The reduction of bucket {index} ({len(members)} parameters: {names}) failed on rank "
                f"{self.rank}: {error}. Another rank may have died or timed out.{self.progress.behind(index)} "
                "This iteration's gradients were not reduced; the process group may no longer be usable."
            ) from error

    # -- errors -------------------------------------------------------------------------------

    def _ensure_prior_reduction_finished(self) -> None:
        if self.state not in _UNFINISHED:
            return
        missing = [i for i, marked in enumerate(self._marked) if not marked]
        self._abandon()
        listed = ", ".join(f"{self.names[i]} (index {i})" for i in missing)
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. "
            "This error indicates that your module has parameters that were not used in producing loss. "
            "You can enable unused parameter detection by passing the keyword argument "
            "`find_unused_parameters=True` to `OverlapDDP`, and by making sure all `forward` function "
            "outputs participate in calculating loss.\n"
            f"Parameters which did not receive grad for rank {self.rank}: {listed}\n"
            "Their gradients from that iteration were not reduced; the wrapper has been reset and the "
            "next iteration can run."
        )

    def _abandon(self) -> None:
        """Drop an unfinished iteration; buckets that may still be written by a collective get new storage."""
        dropped = self._fence.abandon()
        for index in dropped:
            if index >= 0:  # the delayed all-reduce (a negative key) renews its own buffer
                self._storages[index].drop_aliased_grads()
                self._storages[index] = self._new_storage(index, self.plan.buckets[index])
        if self.delayed is not None:
            self.delayed.abandon()
        self._write_watch.clear()
        self._layouts.iteration_abandoned()
        if self._dynamic_unused:
            self._used.reset()
        self._reset_iteration()
        self.state = ReducerState.IDLE  # any -> IDLE: the iteration is dropped
