"""When does each thing happen? The reducer's state machine, driven by ``mark_ready(i)`` and ``finalize()``.

It counts gradients and decides when a bucket launches and when the iteration ends; how a bucket is
filled, launched, completed and written back is its pipeline's (bucket/pipeline.py). It knows
tensors, buckets and collectives, never ``nn.Module`` or autograd hooks, so it can be driven by
hand in tests. The wrapper calls, per iteration:

``prepare_for_forward()`` (grad-enabled forward: apply a pending rebuild) ->
``prepare_for_backward()`` (synchronized forward: expect gradients; fix the graph mode) ->
``mark_ready(i)`` once per parameter (count it; launch complete buckets in index order) ->
``finalize()`` once, at the end of backward (complete every bucket; write ``param.grad``).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist

from overlapddp.bucket.consumer import BucketConsumer
from overlapddp.bucket.gradient_checks import GradientWriteWatch
from overlapddp.bucket.pipeline import BucketPipeline, SharedStages
from overlapddp.bucket.reduction import BucketReduction, GradientCopy
from overlapddp.bucket.sparse_storage import SparseBucketStorage
from overlapddp.bucket.storage import BucketStorage
from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import Fence
from overlapddp.layout.lifecycle import LayoutLifecycle
from overlapddp.layout.plan import BucketCaps, BucketPlan
from overlapddp.options import ReducerOptions
from overlapddp.param_usage import UsageMap, grad_accumulators, unreachable
from overlapddp.progress import ProgressRecord
from overlapddp.sync_checks import SyncFlagCheck
from overlapddp.torch_compat import in_backward


class ReducerState(enum.Enum):
    """Where the reducer is in an iteration.

    IDLE -> ARMED (prepare_for_backward) -> REDUCING (first gradient counted in) -> FINALIZING
    (finalize) -> IDLE; in a backward that only counts its gradients (see :class:`GraphMode`):
    ARMED -> LEARNING (first gradient) -> REDUCING (reduce_at_end_of_backward counts every gradient
    in) -> FINALIZING -> IDLE. A failure abandons the iteration: any state -> IDLE (_abandon).
    """

    IDLE = "idle"  # no synchronized backward expected: before the first forward, or after finalize
    ARMED = "armed"  # a synchronized forward ran; its backward's gradients are to be reduced, none came yet
    LEARNING = "learning"  # gradients are counted, nothing launched (GraphMode.LEARNING_STATIC or COUNTING_ONLY)
    REDUCING = "reducing"  # gradients are copied in and complete buckets launched; finalize is owed
    FINALIZING = "finalizing"  # the end-of-backward callback is completing buckets


class GraphMode(enum.Enum):
    """How this backward's gradients are counted: fixed once per backward, by prepare_for_backward."""

    OVERLAP = "overlap"  # each gradient counts once; a bucket launches when complete (DDP's usual backward)
    LEARNING_STATIC = "learning static graph"  # static graph's first backward: count firings, reduce at its end
    STATIC = "static graph learned"  # a gradient counts once it fired as often as in the first backward
    COUNTING_ONLY = "counting only"  # a reentrant checkpoint hides parameters: count firings, reduce at the end


# A gradient arriving in these states belongs to a synchronized backward (otherwise it is local).
_IN_BACKWARD = (ReducerState.REDUCING, ReducerState.ARMED, ReducerState.LEARNING)  # most frequent first
# The states a new iteration may not start from: a backward began and its reduction is unfinished.
_UNFINISHED = (ReducerState.LEARNING, ReducerState.REDUCING, ReducerState.FINALIZING)
# The modes whose backward reduces nothing until it ends (the wrapper adds the end-of-backward trigger).
_REDUCED_AT_END = (GraphMode.LEARNING_STATIC, GraphMode.COUNTING_ONLY)


@dataclass
class _Iteration:
    """What one synchronized backward has counted so far: made new by prepare_for_backward."""

    marked: list[bool]  # per parameter: counted in (its bucket has it)
    fires: list[int]  # per parameter: hook firings (the modes that count them)
    missing: list[int]  # per bucket: members not counted in yet (0: the bucket may launch)
    filled: set[int] = field(default_factory=set)  # buckets filled when complete, ahead of their launch
    unused: list[int] = field(default_factory=list)  # counted in without a gradient: no output reached them
    unused_marked: bool = False  # ``unused`` were counted in (at this backward's first gradient)
    next_launch: int = 0  # the next bucket to launch: buckets launch in index order
    # From the layout lifecycle: where to record each fired gradient (while DDP's rebuild is awaited).
    record_ready: Callable[[int], None] | None = None

    @classmethod
    def empty(cls, count: int, plan: BucketPlan) -> _Iteration:
        return cls([False] * count, [0] * count, [len(members) for members in plan.buckets])


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
        sync_flags: SyncFlagCheck | None = None,
        progress: ProgressRecord | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self._caps = caps
        self._sparse_gradient = list(sparse_gradient)
        self.state = ReducerState.IDLE
        self.mode = GraphMode.OVERLAP
        # Read by the optimizer guards: reductions and synchronized forwards so far.
        self.reductions = self.synchronized_forwards = 0
        # A parameter that received a local (no_sync) gradient since the last reduction, or None: a fact
        # about param.grad that outlives the iteration's state (it holds through ARMED and LEARNING).
        self._local_probe: int | None = None
        self.sync_flags = SyncFlagCheck() if sync_flags is None else sync_flags  # the wrapper's flag
        self.progress = ProgressRecord() if progress is None else progress  # where this rank is, for desyncs
        # What each bucket's collective does and divides by (the default sum, a comm hook, token
        # weighting, Join's count): the wrapper sets those on it directly.
        self.reduction = BucketReduction(process_group, options.batched_grad_copy)
        self.stages = SharedStages(
            fence, self.reduction,
            GradientWriteWatch(self.names, self.params, self.rank), self.progress, self.names,
            options.gradient_as_bucket_view, check_nonfinite,
        )
        # Who takes each reduced bucket, in order (bucket/consumer.py): DDP's copy into param.grad
        # first, then whatever attach() added (the overlapped optimizer's per-bucket update).
        self.consumers: list[BucketConsumer] = [GradientCopy(self.reduction, options.gradient_as_bucket_view)]
        # delay_all_reduce_named_params: launched by launch_delayed, completed in finalize.
        self.delayed = delayed
        self.layouts = LayoutLifecycle(self.params, self._sparse_gradient, caps, options)
        self._configure(options)
        self._install_plan(self.layouts.initial_plan())

    def _configure(self, options: ReducerOptions) -> None:
        """Everything but the layout that depends on the graph options, as before the first iteration."""
        self.options = options
        tracks_usage = options.find_unused_parameters or options.static_graph
        self._usage = UsageMap(len(self.params), self.params[0].device) if tracks_usage else None
        self._accumulators = grad_accumulators(self.params) if options.searches_unused_each_forward else []
        # Static graph: each parameter's hook firings in its first backward (None until that backward
        # was reduced: the graph is not learned yet).
        self._learned_fires: list[int] | None = None

    def enable_static_graph(self) -> None:
        """Switch to ``static_graph=True`` (DDP's ``_set_static_graph``); only before the first backward
        and before a checkpointed layout was loaded. The buckets stay as constructed, as in DDP."""
        if self.reductions or self.state is not ReducerState.IDLE or self.layouts.changed:
            raise RuntimeError(
                f"static_graph can only be turned on before the first backward and before load_bucket_state "
                f"(rank {self.rank}); pass static_graph=True to the constructor instead."
            )
        self._configure(dataclasses.replace(self.options, static_graph=True))
        self.layouts.enable_static_graph()

    def attach(self, consumer: BucketConsumer) -> None:
        """Hand every reduced bucket to ``consumer`` too, after those attached before it; only between
        iterations (a bucket is never taken by some consumers of an iteration and not others)."""
        self._between_iterations(f"{consumer.name} can only be attached")
        self.consumers.append(consumer)

    def detach(self, consumer: BucketConsumer) -> None:
        """Stop handing buckets to ``consumer``."""
        self._between_iterations(f"{consumer.name} can only be detached")
        self.consumers.remove(consumer)

    def _between_iterations(self, what: str) -> None:
        """Refuse while a backward's buckets are being taken in (a consumer sees all of one or none)."""
        if self.state in _UNFINISHED or self.fence.in_flight():
            raise RuntimeError(
                f"{what} between iterations; the reducer is {self.state.value} on rank {self.rank}."
            )

    # -- layout -------------------------------------------------------------------------------

    def _install_plan(self, plan: BucketPlan) -> None:
        self.plan = plan
        located = plan.locate()
        self._bucket_of = [located[i][0] for i in range(len(self.params))]
        self.pipelines = [self._new_pipeline(b, members) for b, members in enumerate(plan.buckets)]
        self._iteration = _Iteration.empty(len(self.params), self.plan)

    def _new_pipeline(self, index: int, members: Sequence[int]) -> BucketPipeline:
        """A bucket's pipeline over a flat buffer, or for a parameter that expects a sparse gradient its
        own gradient (bucket/sparse_storage.py)."""
        storage: BucketStorage | SparseBucketStorage
        if self._sparse_gradient[members[0]]:
            storage = SparseBucketStorage(index, [self.params[members[0]]], self.names[members[0]])
        else:
            storage = BucketStorage(index, [self.params[i] for i in members])
        return BucketPipeline(index, members, storage, self.stages, is_last=index == len(self.plan.buckets) - 1)

    @property
    def _used(self) -> UsageMap:
        """The usage map, where the options guarantee one (unused-parameter search or static graph)."""
        return cast(UsageMap, self._usage)

    @property
    def needs_end_of_backward_trigger(self) -> bool:
        """This backward only counts its gradients (:data:`_REDUCED_AT_END`): the wrapper must call
        :meth:`reduce_at_end_of_backward` when backward reaches the outputs' end."""
        return self.mode in _REDUCED_AT_END and self.state in _IN_BACKWARD

    @property
    def learns_graph_next(self) -> bool:
        """The next synchronized backward is a static graph's first (reduced only at its end)."""
        return self.options.static_graph and self._learned_fires is None

    @property
    def local_gradients_since_reduction(self) -> bool:
        """A no_sync backward left local gradients in ``param.grad`` since the last reduction."""
        return self._local_probe is not None

    @property
    def caps(self) -> BucketCaps:
        """The byte caps the buckets are planned with (a copy of the wrapper plans with them again)."""
        return self._caps

    @property
    def sparse_gradient(self) -> list[bool]:
        """Per parameter, whether its gradient is sparse (as given to the constructor)."""
        return list(self._sparse_gradient)

    def unfinished_buckets(self) -> list[int]:
        """Buckets with gradients already taken in this backward that finalize has not written back
        (a superset of the fence's ``in_flight()``: those launched and not completed)."""
        if self.state is ReducerState.IDLE:
            return []
        missing = self._iteration.missing
        return [p.index for p in self.pipelines if missing[p.index] < len(p.members)]

    @property
    def fence(self) -> Fence:
        """The fence that orders every bucket's collective before its readers."""
        return self.stages.fence

    def replace_fence(self, fence: Fence) -> Fence:
        """Swap in another fence (race-forcing tools wrap the real one); only between iterations."""
        current = self.stages.fence
        if self.state is not ReducerState.IDLE or current.in_flight():
            raise RuntimeError(
                f"The fence can only be replaced between iterations; the reducer is {self.state.value} "
                f"with buckets {current.in_flight()} in flight."
            )
        self.stages.fence = fence
        return current

    def tuned_buckets(self) -> list[list[int]] | None:
        """The tuned layout, once installed (None before, or without ``bucket_plan="tuned"``)."""
        return [list(members) for members in self.plan.buckets] if self.layouts.tuned else None

    def restore_bucket_order(self, order: list[int] | None, tuned: list[list[int]] | None = None) -> None:
        """Resume with the layout a checkpointed run had, so that its continuation is bit-equal."""
        if order is None:
            return
        self._ensure_prior_reduction_finished()
        self._adopt_plan(self.layouts.restore(order, tuned))

    # -- the iteration ------------------------------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Check the last reduction finished; install the layout the lifecycle answers (DDP's one
        rebuild, the tuner's switches) between iterations."""
        self._ensure_prior_reduction_finished()
        device = self.pipelines[0].storage.buffer.device
        self.layouts.at_forward(self.process_group, device, self.plan, self._adopt_plan)

    def _adopt_plan(self, plan: BucketPlan) -> None:
        """Switch layouts between iterations; with gradient_as_bucket_view, the gradients move along."""
        self._install_plan(plan)
        if self.options.gradient_as_bucket_view:
            for pipeline in self.pipelines:
                storage = pipeline.storage
                with torch.no_grad():
                    for param, view in zip(storage.params, storage.views, strict=False):  # a sparse bucket has no views
                        if param.grad is not None:
                            view.copy_(param.grad)
                storage.point_grads_at_views()

    def check_not_in_backward(self) -> None:
        """A forward from inside backward (a hook) would interleave its collectives with the buckets'."""
        if in_backward() and self.unfinished_buckets():
            raise RuntimeError(
                f"forward() was called during backward on rank {self.rank} while buckets "
                f"{self.unfinished_buckets()} are being reduced; run the next forward after loss.backward() "
                "has returned."
            )

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """A synchronized forward ran: the next backward's gradients are to be reduced, in the graph
        mode fixed here. With ``find_unused_parameters`` the forward's ``outputs`` tell which
        parameters it used."""
        self._ensure_prior_reduction_finished()
        dropped = self.state is ReducerState.ARMED  # the previous forward's backward never came
        probe = self._local_probe
        if probe is not None and self.params[probe].grad is None:
            self.sync_flags.discarded(self.rank, "zero_grad() (or setting .grad to None) before this forward")
        self.synchronized_forwards += 1
        self.progress.forward(self.synchronized_forwards, self.reductions, dropped)
        self.reduction.arm()
        iteration = _Iteration.empty(len(self.params), self.plan)
        iteration.record_ready = self.layouts.start_iteration(self.fence, self.plan)
        self.mode = GraphMode.OVERLAP
        if self.options.static_graph:
            learned = self._learned_fires
            self.mode = GraphMode.LEARNING_STATIC if learned is None else GraphMode.STATIC
            iteration.unused = [] if learned is None else [i for i, fires in enumerate(learned) if fires == 0]
        elif self.options.find_unused_parameters:
            iteration.unused, hidden = unreachable(outputs, self._accumulators)
            # Only a checkpoint that hides parameters defers the reduction; one over an activation
            # leaves every parameter reachable, and the backward overlaps as in DDP.
            if hidden and iteration.unused:
                self.mode = GraphMode.COUNTING_ONLY
        self._iteration = iteration
        self.state = ReducerState.ARMED  # IDLE or ARMED -> ARMED: this forward's backward is reduced

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index`` has its gradient; returns True when every bucket has launched.

        The caller then queues :meth:`finalize` to run at the end of this backward.
        """
        # As DDP: a hook fired with an undefined gradient (from an output the loss never reached) is not a use.
        used = self.params[index].grad is not None
        if self._usage is not None and used and (self.options.searches_unused_each_forward or self.learns_graph_next):
            self._usage.mark_used(index)
        if self.state not in _IN_BACKWARD:
            self._local_gradient(index)
            return False
        if not self.sync_flags.requested:
            self.sync_flags.synced_under_no_sync(self.rank)
        if self.mode is not GraphMode.OVERLAP and not self._final_now(index):
            return False
        iteration = self._iteration
        if iteration.marked[index]:
            raise RuntimeError(
                f"Expected to mark a variable ready only once. Parameter {self.names[index]} (index {index}) "
                f"received its gradient twice in one backward on rank {self.rank}. This happens when a "
                "parameter is used outside forward, in two reentrant checkpoints (torch.utils.checkpoint with "
                "use_reentrant=True: pass find_unused_parameters=True, or static_graph=True if the graph is the "
                "same every step), or in several backwards of one forward (use no_sync() for all but the last)."
            )
        if iteration.record_ready is not None:
            iteration.record_ready(index)
        if not iteration.unused_marked:  # this backward's unused parameters count in with its first gradient
            iteration.unused_marked = True
            for unused in iteration.unused:
                self._count(unused)
        self._count(index)
        return iteration.next_launch == len(self.pipelines)

    def _final_now(self, index: int) -> bool:
        """The modes that count firings: whether this firing makes the gradient final (only in a
        learned static graph, once it fired as often as in the first backward)."""
        self._iteration.fires[index] += 1
        if self.mode is not GraphMode.STATIC:
            self.state = ReducerState.LEARNING  # ARMED -> LEARNING: counted now, reduced at the end of backward
            return False
        expected = cast(list[int], self._learned_fires)[index]
        if expected == 0:
            raise RuntimeError(
                f"Your training graph has changed in this iteration: parameter {self.names[index]} "
                f"(index {index}) was unused in the first iteration but received a gradient now on rank "
                f"{self.rank}. This is not compatible with static_graph=True."
            )
        return self._iteration.fires[index] >= expected

    def _local_gradient(self, index: int) -> None:
        """A gradient outside a synchronized backward (no_sync): it stays local in ``param.grad``."""
        self._local_probe = index
        if self.sync_flags.requested:
            self.sync_flags.unarmed_backward(self.rank)

    def _count(self, index: int) -> None:
        """One gradient is in its bucket's count (the fence notes its stream). A bucket complete now is
        filled and launched at once if every bucket before it has launched, then every complete bucket
        after it launches, in index order; one complete ahead of its turn is filled now, as DDP copies
        each gradient in at its hook (unless the non-finite check, a collective, must run in index
        order with the fill), and launched in its turn."""
        iteration = self._iteration
        iteration.marked[index] = True
        self.state = ReducerState.REDUCING  # ARMED or LEARNING -> REDUCING: finalize is owed from here
        bucket = self._bucket_of[index]
        self.stages.fence.gradient_ready(bucket, index)
        iteration.missing[bucket] -= 1
        if iteration.missing[bucket]:
            return
        try:
            if bucket != iteration.next_launch and not self.stages.check_nonfinite:
                self.pipelines[bucket].fill()
                iteration.filled.add(bucket)
            while iteration.next_launch < len(self.pipelines) and not iteration.missing[iteration.next_launch]:
                pipeline = self.pipelines[iteration.next_launch]
                filled = pipeline.index in iteration.filled
                if not self._skipped(pipeline):
                    pipeline.launch(filled)
                elif not filled:
                    pipeline.fill()  # filled as DDP fills it; no collective
                iteration.next_launch += 1
                if iteration.next_launch == len(self.pipelines) and self.options.searches_unused_each_forward:
                    if not self.reduction.issues_from_callbacks:  # else finalize launches it
                        self._used.launch_reduction(self.process_group)
        except FloatingPointError:  # the non-finite check: every rank stops before this bucket
            self._abandon()
            raise

    def _skipped(self, pipeline: BucketPipeline) -> bool:
        """``skip_all_reduce_unused_params``: a bucket of only unused parameters is not reduced."""
        if not self.options.skip_all_reduce_unused_params:
            return False
        unused = set(self._iteration.unused)
        return all(i in unused for i in pipeline.members)

    def launch_delayed(self) -> None:
        """``param_to_hook_all_reduce`` has its gradient: start the delayed all-reduce, once per
        synchronized backward (finalize completes it, or starts it if this never ran)."""
        delayed = cast(DelayedReduction, self.delayed)  # this hook is registered only with one
        # A hook that issues collectives from its callbacks (PowerSGD) would interleave them with this
        # one in a different order on each rank: then finalize starts it, after every bucket's chain.
        chained = self.reduction.issues_from_callbacks
        if self.state in _IN_BACKWARD and not delayed.launched and not chained:
            delayed.launch(self.fence)

    def reduce_at_end_of_backward(self) -> None:
        """End of a backward that only counted its gradients: every parameter that received none is
        unused (in the static graph's first backward, for good); then reduce everything."""
        iteration = self._iteration
        if self.mode is GraphMode.LEARNING_STATIC:
            self._used.launch_reduction(self.process_group)
            self._learned_fires = list(iteration.fires)
        iteration.unused = [i for i, fires in enumerate(iteration.fires) if fires == 0]
        iteration.unused_marked = True
        for index in range(len(self.params)):
            self._count(index)
        self.finalize()

    def shadow_backward(self) -> None:
        """A joined rank's backward: the same collectives as the others', on zeros, in the same order."""
        for future in [pipeline.shadow() for pipeline in self.pipelines]:
            future.wait()
        if self.options.searches_unused_each_forward:
            self._used.shadow_reduction(self.process_group)
        self.layouts.iteration_shadowed()

    def finalize(self) -> None:
        """Complete every bucket in order and write the reduced values into ``param.grad``."""
        self.state = ReducerState.FINALIZING  # REDUCING -> FINALIZING: every bucket launched, backward over
        fence, iteration = self.fence, self._iteration
        fence.backward_ended()
        try:
            if self.options.searches_unused_each_forward and self.reduction.issues_from_callbacks:
                # The usage flags' all-reduce after every hook chain, so no rank issues it between a
                # chain's collectives (see BucketReduction.issues_from_callbacks).
                self.reduction.wait_for_hook_chains()
                self._used.launch_reduction(self.process_group)
            for pipeline in self.pipelines:
                if self._skipped(pipeline):
                    continue
                write = [self._globally_used(i) for i in pipeline.members]
                pipeline.write_back(write, self.consumers)
            if self.delayed is not None:
                self.delayed.finish(fence)
            if self._usage is not None:
                self._usage.settle()
            for consumer in self.consumers:
                consumer.all_taken()
        except BaseException:
            self._abandon()
            raise
        if self.options.searches_unused_each_forward:
            self._used.reset()
        fence.end_iteration()
        self.layouts.iteration_reduced(iteration.unused)
        self.reductions += 1
        self.progress.reduced(self.synchronized_forwards, self.reductions)
        self._local_probe = None
        self._iteration = _Iteration.empty(len(self.params), self.plan)
        self.state = ReducerState.IDLE  # FINALIZING -> IDLE: every gradient written

    def _globally_used(self, index: int) -> bool:
        """Whether any rank produced this gradient; a globally unused gradient is left untouched."""
        return self._usage is None or self._usage.globally_used(index)

    # -- errors -------------------------------------------------------------------------------

    def _ensure_prior_reduction_finished(self) -> None:
        if self.state not in _UNFINISHED:
            return
        missing = [i for i, marked in enumerate(self._iteration.marked) if not marked]
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
        for index in self.fence.abandon():
            if index >= 0:  # the delayed all-reduce (a negative key) renews its own buffer
                self.pipelines[index].storage.drop_aliased_grads()
                self.pipelines[index] = self._new_pipeline(index, self.plan.buckets[index])
        if self.delayed is not None:
            self.delayed.abandon()
        self.stages.write_watch.clear()
        self.layouts.iteration_abandoned()
        if self.options.searches_unused_each_forward:
            self._used.reset()
        for consumer in self.consumers:
            consumer.abandoned()
        self._iteration = _Iteration.empty(len(self.params), self.plan)
        self.state = ReducerState.IDLE  # any -> IDLE: the iteration is dropped

