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
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import BucketCaps, BucketPlan, explicit_plan, initial_plan, rebuilt_plan
from overlapddp.bucket_storage import BucketStorage
from overlapddp.comm_hook import Bucket, CommHook, allreduce_sum, hook_result, is_unchained, run_hook
from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import Fence
from overlapddp.module_sync import gather_objects
from overlapddp.param_usage import UsageMap, grad_accumulators, unreachable
from overlapddp.plan_tuner import TUNING_ITERATIONS, PlanTuner
from overlapddp.sparse_reduction import SparseBucketStorage
from overlapddp.token_weighting import TokenCount
from overlapddp.torch_compat import in_backward


class ReducerState(enum.Enum):
    """Where the reducer is in an iteration."""

    IDLE = "idle"  # no synchronized backward expected: before the first forward, or after finalize
    BACKWARD = "backward"  # a synchronized forward ran; gradients are copied in and buckets launched
    FINALIZING = "finalizing"  # the end-of-backward callback is completing buckets


@dataclass(frozen=True)
class ReducerOptions:
    """DDP's behaviour switches that change when and how gradients are reduced."""

    find_unused_parameters: bool = False  # search each forward's graph; skip globally unused grads
    static_graph: bool = False  # learn the graph in iteration 1, reduce it all at its end
    gradient_as_bucket_view: bool = False  # param.grad is a view into its bucket, no copy-out
    batched_grad_copy: bool = False  # copy unscaled, then divide each bucket (true division)
    skip_all_reduce_unused_params: bool = False  # never reduce buckets holding only unused params
    tuned_plan: bool = False  # after DDP's rebuild, measure, model and select buckets (plan_tuner.py)


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
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self._fence = fence
        self._caps = caps
        self._sparse_gradient = list(sparse_gradient)
        self._comm_hook: tuple[Any, CommHook] | None = None
        self.state = ReducerState.IDLE
        self._scale: float | None = None  # set per backward by prepare_for_backward
        # Likewise: the world size, the ranks still training under Join, or (None until the first
        # fill) the global token count.
        self._divide_by: float | None = 1
        self._hook_future: torch.futures.Future | None = None  # last hook chain started, see _start_reduction
        self._join_count: dist.Work | None = None  # set per forward under Join, see set_join_count
        # Read by the optimizer guard: completed reductions so far, and whether a backward outside
        # synchronization (no_sync) has accumulated local gradients since the last one.
        self.reductions = 0
        self.backwards_armed = 0  # synchronized forwards so far: names the current iteration
        self.local_gradients_since_reduction = False
        self.check_finite = False  # see _check_finite
        # Optimizer guards attached: while any is, report gradients written while their bucket was
        # reduced (see _check_untouched). Per bucket: each gradient and its version when taken.
        self.gradient_write_watchers = 0
        self._taken: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        self.tokens: TokenCount | None = None  # token-weighted reduction, see enable_token_weighting
        # Called in finalize with each bucket's parameters once its gradients are written, while
        # later buckets may still be reducing: the overlapped optimizer's per-bucket update.
        self.after_bucket_reduced: Callable[[list[torch.Tensor]], None] | None = None
        self.after_all_reduced: Callable[[], None] | None = None  # once, when every bucket is written
        # delay_all_reduce_named_params: launched by launch_delayed, completed in finalize (set by the wrapper).
        self.delayed: DelayedReduction | None = None
        self._ready_order: list[int] = []
        self._rebuilt_from: list[int] = []  # rank 0's ready order the current plan was built from
        # True from the first mark_ready of a backward until finalize: an unfinished reduction.
        self._require_finalize = False
        self._tuner = PlanTuner(self.params, self._sparse_gradient) if options.tuned_plan else None
        self._configure(options)
        self._install_plan(
            initial_plan(
                self.params, self._sparse_gradient, self._caps, options.find_unused_parameters, options.static_graph
            )
        )

    def _configure(self, options: ReducerOptions) -> None:
        """Everything but the plan that depends on the graph options, as before the first iteration."""
        self.options = options
        # DDP rebuilds once, from rank 0's gradient-ready order, unless it searches unused
        # parameters on a dynamic graph.
        self._rebuild_pending = options.static_graph or not options.find_unused_parameters
        tracks_usage = options.find_unused_parameters or options.static_graph
        self._usage = UsageMap(len(self.params), self.params[0].device) if tracks_usage else None
        self._accumulators = grad_accumulators(self.params) if self._dynamic_unused else []
        # Parameters no output reached (dynamic) or whose hook never fired in iteration 1 (static).
        self._unused: list[int] = []
        # Static graph: hook firings per parameter in this backward, and in the first one (None
        # until the first synchronized backward ended).
        self._fires = [0] * len(self.params)
        self._expected_fires: list[int] | None = None

    def enable_static_graph(self) -> None:
        """Switch to ``static_graph=True`` (DDP's ``_set_static_graph``); only before the first backward
        and before a checkpointed layout was loaded. The buckets stay as constructed, as in DDP."""
        started = self.reductions or self._require_finalize or self.state is not ReducerState.IDLE
        if started or self._rebuilt_from or (self._tuner is not None and self._tuner.done):
            raise RuntimeError(
                f"static_graph can only be turned on before the first backward and before load_bucket_state "
                f"(rank {self.rank}); pass static_graph=True to the constructor instead."
            )
        self._configure(dataclasses.replace(self.options, static_graph=True))

    # -- plan ---------------------------------------------------------------------------------

    def _install_plan(self, plan: BucketPlan) -> None:
        self.plan = plan
        located = plan.locate()
        self._locate = [located[i][0] for i in range(len(self.params))]
        self._storages = [self._new_storage(b, members) for b, members in enumerate(plan.buckets)]
        self._reset_iteration()

    def _new_storage(self, index: int, members: Sequence[int]) -> BucketStorage | SparseBucketStorage:
        """A flat buffer, or for a parameter that expects a sparse gradient its own gradient (sparse_reduction.py)."""
        if self._sparse_gradient[members[0]]:
            return SparseBucketStorage(index, [self.params[members[0]]], self.names[members[0]])
        return BucketStorage(index, [self.params[i] for i in members])

    def _reset_iteration(self) -> None:
        self._pending = [len(members) for members in self.plan.buckets]
        self._marked = [False] * len(self.params)
        self._next_launch = 0
        self._unused_marked = False
        self._fires = [0] * len(self.params)

    @property
    def _dynamic_unused(self) -> bool:
        return self.options.find_unused_parameters and not self.options.static_graph

    @property
    def needs_end_of_backward_trigger(self) -> bool:
        """Static graph, first iteration: nothing is reduced during backward; the wrapper must
        call :meth:`reduce_learned_graph` when backward reaches the outputs' end."""
        return self.options.static_graph and self._expected_fires is None

    @property
    def final_layout_iteration(self) -> int:
        """The first synchronized iteration (from 0) whose buckets stay: DDP's rebuild is in force
        from iteration 1 (2 with a static graph); the tuned plan, measured and selected after it, at the
        latest this many later."""
        ddp = 2 if self.options.static_graph else 1
        return ddp + (TUNING_ITERATIONS if self._tuner is not None else 0)

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
        return not self._rebuild_pending

    def in_flight(self) -> list[int]:
        """Buckets with gradients already taken in this backward that finalize has not written back."""
        if self.state is ReducerState.IDLE:
            return []
        return [b for b, members in enumerate(self.plan.buckets) if self._pending[b] < len(members)]

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
        return list(self._rebuilt_from) or None

    def tuned_buckets(self) -> list[list[int]] | None:
        """The tuned layout, once installed (None before, or without ``bucket_plan="tuned"``)."""
        if self._tuner is None or not self._tuner.done:
            return None
        return [list(members) for members in self.plan.buckets]

    def restore_bucket_order(self, order: list[int] | None, tuned: list[list[int]] | None = None) -> None:
        """Resume with the layout a checkpointed run had, so that its continuation is bit-equal."""
        if order is None:
            return
        self._ensure_prior_reduction_finished()
        self._rebuild_pending = False
        self._ready_order = []
        self._rebuilt_from = list(order)
        plan = rebuilt_plan(self.params, self._sparse_gradient, self._caps, order)
        if tuned is not None:
            if self._tuner is None:
                raise ValueError("This bucket state holds a tuned layout; construct with bucket_plan='tuned'.")
            if sorted(i for b in tuned for i in b) != list(range(len(self.params))):
                raise ValueError(f"The tuned layout must hold each of the {len(self.params)} parameters once.")
            self._tuner.restored()
            plan = explicit_plan(self.params, tuned)
        self._adopt_plan(plan)

    def enable_token_weighting(self) -> TokenCount:
        """Divide by the global token count instead of the world size (see token_weighting.py)."""
        if self._comm_hook is not None:
            raise RuntimeError("Token-weighted reduction cannot be combined with a communication hook.")
        if self.tokens is None:
            self.tokens = TokenCount(self._storages[0].buffer.device)
        return self.tokens

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the scaled sum."""
        if self.tokens is not None:
            raise RuntimeError("A communication hook cannot be combined with token-weighted reduction.")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook = (state, hook)

    # -- the iteration ------------------------------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Check the last reduction finished; apply the one rebuild once the ready order is known; let
        the tuned plan switch layouts between iterations."""
        self._ensure_prior_reduction_finished()
        if self._rebuild_pending and self._ready_order:
            order = torch.tensor(self._ready_order, dtype=torch.int64, device=self._storages[0].buffer.device)
            dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
            self._rebuild_pending = False
            self._ready_order = []
            self._rebuilt_from = order.tolist()
            self._adopt_plan(rebuilt_plan(self.params, self._sparse_gradient, self._caps, self._rebuilt_from))
        elif self._tuner is not None and self.has_rebuilt_buckets:
            device = self._storages[0].buffer.device
            self._tuner.between_iterations(self.process_group, device, self._rebuilt_from, self.plan, self._adopt_plan)

    def _adopt_plan(self, plan: BucketPlan) -> None:
        """Switch layouts between iterations; with gradient_as_bucket_view, the gradients move along."""
        self._install_plan(plan)
        if self.options.gradient_as_bucket_view:
            for storage in self._storages:
                with torch.no_grad():
                    for param, view in zip(storage.params, storage.views):
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
        self._reset_iteration()
        self.backwards_armed += 1
        # Scale while copying, as DDP's default path does; a hook or batched copy divides later.
        no_scaling = self._comm_hook is not None or self.options.batched_grad_copy
        self._divide_by = self._divisor()
        self._scale = None if no_scaling else 1.0 / self._divide_by
        if self.tokens is not None:
            self.tokens.launch(self.process_group)  # overlaps backward; waited at the first fill
            self._divide_by = None
        if self._tuner is not None and self.has_rebuilt_buckets:
            self._tuner.start_iteration()
        if self._dynamic_unused:
            self._unused = unreachable(outputs, self._accumulators)
        self.state = ReducerState.BACKWARD

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index`` has its gradient; returns True when every bucket has launched.

        The caller then queues :meth:`finalize` to run at the end of this backward.
        """
        if self._usage is not None and (self._dynamic_unused or self._expected_fires is None):
            self._usage.mark_used(index)
        if self.state is not ReducerState.BACKWARD:
            self.local_gradients_since_reduction = True
            return False
        if self.options.static_graph:
            self._fires[index] += 1
            if self._expected_fires is None:
                self._require_finalize = True
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
                "parameter is used outside forward, in reentrant backward (use static_graph=True), or in "
                "several backwards of one forward; use no_sync() for all but the last backward."
            )
        if self._rebuild_pending:
            self._ready_order.append(index)
        if not self._unused_marked:
            self._unused_marked = True
            for unused in self._unused:
                self._mark(unused)
        self._mark(index)
        return self._next_launch == len(self._storages)

    def _mark(self, index: int) -> None:
        """Count one gradient in; fill and launch every bucket that is complete, in index order."""
        self._marked[index] = True
        self._require_finalize = True
        if self._tuner is not None:
            self._tuner.gradient_ready(index)
        bucket = self._locate[index]
        self._fence.gradient_ready(bucket)
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._fill(bucket)
        while self._next_launch < len(self._storages) and self._pending[self._next_launch] == 0:
            if not self._skipped(self._next_launch):
                self._launch(self._next_launch)
            self._next_launch += 1
            if self._next_launch == len(self._storages) and self._dynamic_unused:
                self._usage.launch_reduction(self.process_group)

    def _skipped(self, bucket: int) -> bool:
        """``skip_all_reduce_unused_params``: a bucket of only unused parameters is not reduced."""
        if not self.options.skip_all_reduce_unused_params:
            return False
        unused = set(self._unused)
        return all(i in unused for i in self.plan.buckets[bucket])

    def launch_delayed(self) -> None:
        """``param_to_hook_all_reduce`` has its gradient: start the delayed all-reduce, once per
        synchronized backward (finalize completes it, or starts it if this never ran)."""
        if self.state is ReducerState.BACKWARD and not self.delayed.launched:
            self.delayed.launch(self._fence)

    def reduce_learned_graph(self) -> None:
        """Static graph, end of the first backward: learn who is unused, then reduce everything."""
        self._usage.launch_reduction(self.process_group)
        self._expected_fires = list(self._fires)
        self._unused = [i for i, fires in enumerate(self._fires) if fires == 0]
        self._unused_marked = True
        for index in range(len(self.params)):
            self._mark(index)
        self.finalize()

    def _fill(self, index: int) -> None:
        """Copy a complete bucket's gradients in, scaled as DDP scales them (batched, once per bucket)."""
        storage = self._storages[index]
        no_hook = self._comm_hook is None
        batched = self.options.batched_grad_copy
        if self._divide_by is None:  # token weighting: the global count is needed from here on
            self._divide_by = self.tokens.total(self.rank)
            self._scale = None if batched else 1.0 / self._divide_by
        self._fence.filling(index)
        storage.copy_in(
            [p.grad for p in storage.params],
            self._scale,
            divide_by=self._divide_by if batched and no_hook else None,
            alias_divide_by=self._divide_by if no_hook and not batched else None,
        )
        if self.options.gradient_as_bucket_view:
            storage.point_grads_at_views()
        elif self.gradient_write_watchers:
            self._taken[index] = [
                (i, p.grad, p.grad._version) for i, p in zip(self.plan.buckets[index], storage.params)
                if p.grad is not None
            ]
        self._fence.produced(index, storage.buffer)  # on the stream that wrote the bucket

    def _globally_used(self, index: int) -> bool:
        """Whether any rank produced this gradient; a globally unused gradient is left untouched."""
        return self._usage is None or self._usage.globally_used(index)

    def _world_size(self) -> int:
        return self.process_group.size()

    def _divisor(self) -> int:
        """The world size, or under ``Join`` the number of ranks still training when asked for."""
        if self._join_count is None:
            return self._world_size()
        work, self._join_count = self._join_count, None
        work.wait()
        return int(work.result()[0].item())

    def _launch(self, index: int) -> None:
        if self.check_finite:
            self._fence.order_after_produced(index)  # the check reads param.grad, maybe on another stream
            self._check_finite(index)
        storage = self._storages[index]
        bucket = self._bucket(index, storage.buffer)
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{index}.launch"):
            self._fence.launch(index, lambda: self._start_measured(bucket))

    def _start_measured(self, bucket: Bucket) -> torch.futures.Future:
        """Start the reduction; while the tuned plan calibrates, also time it for the tuner."""
        if self._tuner is None or not self._tuner.measuring:
            return self._start_reduction(bucket)
        started, launched = time.perf_counter(), self._tuner.now()
        future = self._start_reduction(bucket)
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        self._tuner.bucket_launched(nbytes, len(bucket.parameters()), started, launched, future)
        return future

    def _bucket(self, index: int, buffer: torch.Tensor) -> Bucket:
        storage = self._storages[index]
        return Bucket(
            index, buffer, storage.offsets, storage.lengths, storage.params,
            is_last=index == len(self._storages) - 1,
        )

    def _start_reduction(self, bucket: Bucket) -> torch.futures.Future:
        """Start one bucket's collective(s): the scaled sum, or the registered hook."""
        if self._comm_hook is None:
            return allreduce_sum(self.process_group, bucket)
        state, hook = self._comm_hook
        # Hook chains run one bucket at a time, see [Note: one hook chain at a time] in
        # comm_hook.py: bucket b's hook starts once bucket b-1's future (kept here from the
        # previous start of this iteration; finalize consumes it through the fence) is done.
        chained = bucket.index() > 0 and not is_unchained(hook)
        after = self._hook_future if chained else None
        self._hook_future = run_hook(hook, state, bucket, after)
        return self._hook_future

    def shadow_backward(self) -> None:
        """A joined rank's backward: the same collectives as the others', on zeros, in the same order."""
        futures = [
            self._start_reduction(self._bucket(index, torch.zeros_like(storage.buffer)))
            for index, storage in enumerate(self._storages)
        ]
        for future in futures:
            future.wait()
        if self._dynamic_unused:
            self._usage.shadow_reduction(self.process_group)
        if self._rebuild_pending and not self._ready_order:
            self._ready_order = list(range(len(self.params)))
        elif self._tuner is not None and self.has_rebuilt_buckets:
            self._tuner.shadow_iteration()

    def set_join_count(self, work: dist.Work, divide_by_initial_world_size: bool) -> None:
        """Under ``Join``: ``work`` sums 1 per rank still training; average over those ranks unless
        ``divide_by_initial_world_size``."""
        self._join_count = None if divide_by_initial_world_size else work

    def finalize(self) -> None:
        """Complete every bucket in order and write the reduced values into ``param.grad``."""
        self.state = ReducerState.FINALIZING
        self._fence.backward_ended()
        hook_name = "allreduce (default)" if self._comm_hook is None else _qualname(self._comm_hook[1])
        measuring = self._tuner is not None and self._tuner.measuring
        try:
            for index, storage in enumerate(self._storages):
                if self._skipped(index):
                    continue
                with torch.autograd.profiler.record_function(f"overlapddp.bucket_{index}.complete"):
                    value = self._complete(index)
                    reduced_at = self._tuner.now() if measuring else None
                    self._check_untouched(index)
                    write = [self._globally_used(i) for i in self.plan.buckets[index]]
                    result = hook_result(value, hook_name, index, storage.buffer)
                    storage.copy_out(result, write, as_view=self.options.gradient_as_bucket_view)
                    written = [p.grad for p in storage.params if p.grad is not None]
                    self._fence.consumed(index, "copy to param.grad", written)
                if self.after_bucket_reduced is not None:
                    self.after_bucket_reduced(storage.params)
                if measuring:
                    self._tuner.bucket_finalized(reduced_at, self._tuner.now())
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
            self._usage.reset()
        if self._rebuild_pending and self.options.static_graph and self._ready_order:
            # DDP appends the parameters that never fired to the recorded order at finalize.
            self._ready_order += [i for i in self._unused]
        self._fence.end_iteration()
        if self._tuner is not None:
            self._tuner.end_iteration()
        self.reductions += 1
        self.local_gradients_since_reduction = False
        self._require_finalize = False
        self.state = ReducerState.IDLE

    def _complete(self, index: int) -> object:
        """The bucket's reduced value, or an error that says which bucket and rank failed."""
        try:
            return self._fence.complete(index)
        except Exception as error:
            members = self.plan.buckets[index]
            names = ", ".join(self.names[i] for i in members[:4]) + (", ..." if len(members) > 4 else "")
            raise RuntimeError(
                f"The reduction of bucket {index} ({len(members)} parameters: {names}) failed on rank "
                f"{self.rank}: {error}. Another rank may have died or timed out. This iteration's gradients "
                "were not reduced; the process group may no longer be usable."
            ) from error

    def _check_untouched(self, index: int) -> None:
        """A gradient changed in place (or replaced) after it was copied into its bucket would be
        silently overwritten by the reduced value: stop instead (guarded optimizers only)."""
        taken = self._taken.pop(index, [])
        changed = [self.names[i] for i, grad, version in taken
                   if self.params[i].grad is not grad or grad._version != version]
        if changed:
            raise RuntimeError(
                f"The gradients of {', '.join(changed)} (bucket {index}) were changed on rank {self.rank} while "
                "the bucket was being reduced (clip_grad_norm_, zero_grad or another write from inside "
                "backward); the reduced values would silently replace that change. Change gradients only "
                "after loss.backward() has returned."
            )

    def _check_finite(self, index: int) -> None:
        """Before bucket ``index`` is reduced, make every rank stop if any rank's gradients there are
        not finite, naming those ranks and parameters (one extra all-reduce per bucket; a debug option).

        The flags are computed on the device; the host reads one count per bucket."""
        storage = self._storages[index]
        present = [(i, p.grad) for i, p in zip(self.plan.buckets[index], storage.params) if p.grad is not None]
        device = storage.buffer.device
        flags = torch.stack([torch.isfinite(_values(g)).all().logical_not() for _, g in present]) if present else \
            torch.zeros(0, dtype=torch.bool, device=device)
        count = flags.sum(dtype=torch.int64).reshape(1)
        dist.all_reduce(count, group=self.process_group)
        if count.item() == 0:
            return
        bad = [self.names[i] for (i, _), flag in zip(present, flags.tolist()) if flag]
        everyone = gather_objects(bad, self.process_group, device)
        found = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in enumerate(everyone) if names)
        self._abandon()
        raise FloatingPointError(
            f"Non-finite gradients (NaN or Inf) in bucket {index} before its reduction ({found}). "
            "Nothing was reduced, so no rank received them; the wrapper has been reset."
        )

    # -- errors -------------------------------------------------------------------------------

    def _ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
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
        self._require_finalize = False
        self._ready_order = []
        self._taken = {}
        if self._tuner is not None:
            self._tuner.discard_iteration()
        if self._dynamic_unused:
            self._usage.reset()
        self._reset_iteration()
        self.state = ReducerState.IDLE


def _values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a dense or sparse gradient."""
    return grad._values() if grad.is_sparse else grad


def _qualname(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
