"""When each thing happens: the reducer's state machine, driven by ``mark_ready(i)`` and ``finalize()``.

It knows tensors, buckets and collectives, never ``nn.Module`` or autograd hooks, so it can be
driven by hand in tests. The wrapper calls, per iteration:

``prepare_for_forward()`` (grad-enabled forward: apply a pending rebuild) ->
``prepare_for_backward()`` (synchronized forward: expect gradients) ->
``mark_ready(i)`` once per parameter (copy in; launch complete buckets in index order) ->
``finalize()`` once, at the end of backward (complete every bucket; write ``param.grad``).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import BucketCaps, BucketPlan, initial_plan, rebuilt_plan
from overlapddp.bucket_storage import BucketStorage
from overlapddp.comm_hook import Bucket, CommHook, allreduce_sum, hook_result, run_hook
from overlapddp.fence import Fence


class ReducerState(enum.Enum):
    """Where the reducer is in an iteration."""

    IDLE = "idle"  # no synchronized backward expected: before the first forward, or after finalize
    BACKWARD = "backward"  # a synchronized forward ran; gradients are copied in and buckets launched
    FINALIZING = "finalizing"  # the end-of-backward callback is completing buckets


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
        find_unused_parameters: bool = False,
        batched_grad_copy: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self._fence = fence
        self._caps = caps
        self._sparse_gradient = list(sparse_gradient)
        self._batched_grad_copy = batched_grad_copy
        self._comm_hook: tuple[Any, CommHook] | None = None
        self.state = ReducerState.IDLE
        # DDP rebuilds once, from rank 0's gradient-ready order, unless it searches unused parameters.
        self._scale: float | None = None  # set per backward by prepare_for_backward
        # Read by the optimizer guard: completed reductions so far, and whether a backward outside
        # synchronization (no_sync) has accumulated local gradients since the last one.
        self.reductions = 0
        self.local_gradients_since_reduction = False
        self._rebuild_pending = not find_unused_parameters
        self._ready_order: list[int] = []
        # True from the first mark_ready of a backward until finalize: an unfinished reduction.
        self._require_finalize = False
        self._install_plan(
            initial_plan(self.params, self._sparse_gradient, caps, find_unused_parameters, static_graph=False)
        )

    # -- plan ---------------------------------------------------------------------------------

    def _install_plan(self, plan: BucketPlan) -> None:
        self.plan = plan
        located = plan.locate()
        self._locate = [located[i][0] for i in range(len(self.params))]
        self._storages = [
            BucketStorage(b, [self.params[i] for i in members]) for b, members in enumerate(plan.buckets)
        ]
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._pending = [len(members) for members in self.plan.buckets]
        self._marked = [False] * len(self.params)
        self._next_launch = 0

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

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the scaled sum."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook = (state, hook)

    # -- the iteration ------------------------------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Apply the one rebuild once a synchronized backward has recorded the ready order."""
        if self._rebuild_pending and self._ready_order:
            self._ensure_prior_reduction_finished()
            order = torch.tensor(self._ready_order, dtype=torch.int64, device=self._storages[0].buffer.device)
            dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
            self._rebuild_pending = False
            self._ready_order = []
            self._install_plan(rebuilt_plan(self.params, self._sparse_gradient, self._caps, order.tolist()))

    def prepare_for_backward(self) -> None:
        """A synchronized forward ran: the next backward's gradients are to be reduced."""
        self._ensure_prior_reduction_finished()
        self._reset_iteration()
        # Scale while copying, as DDP's default path does; a hook or batched copy divides later.
        no_scaling = self._comm_hook is not None or self._batched_grad_copy
        self._scale = None if no_scaling else 1.0 / self._world_size()
        self.state = ReducerState.BACKWARD

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index`` has its gradient; returns True when every bucket has launched.

        The caller then queues :meth:`finalize` to run at the end of this backward.
        """
        if self.state is not ReducerState.BACKWARD:
            self.local_gradients_since_reduction = True
            return False
        if self._marked[index]:
            raise RuntimeError(
                f"Expected to mark a variable ready only once. Parameter {self.names[index]} (index {index}) "
                f"received its gradient twice in one backward on rank {self.rank}. This happens when a "
                "parameter is used outside forward, in reentrant backward, or in several backwards of "
                "one forward; use no_sync() for all but the last backward."
            )
        self._marked[index] = True
        self._require_finalize = True
        if self._rebuild_pending:
            self._ready_order.append(index)
        bucket = self._locate[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._fill(bucket)
        while self._next_launch < len(self._storages) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1
        return self._next_launch == len(self._storages)

    def _fill(self, index: int) -> None:
        """Copy a complete bucket's gradients in, scaled as DDP scales them (batched, once per bucket)."""
        storage = self._storages[index]
        divide_by = self._world_size() if self._batched_grad_copy and self._comm_hook is None else None
        storage.copy_in([p.grad for p in storage.params], self._scale, divide_by)

    def _world_size(self) -> int:
        return self.process_group.size()

    def _launch(self, index: int) -> None:
        storage = self._storages[index]
        bucket = Bucket(
            index, storage.buffer, storage.offsets, storage.lengths, storage.params,
            is_last=index == len(self._storages) - 1,
        )
        self._fence.produced(index, storage.buffer)
        if self._comm_hook is None:
            self._fence.launch(index, lambda: allreduce_sum(self.process_group, bucket))
        else:
            state, hook = self._comm_hook
            # Hook chains run one bucket at a time, see [Note: one hook chain at a time] in
            # comm_hook.py: bucket b's hook starts once bucket b-1's future (stored here by the
            # previous launch of this iteration; finalize consumes it through the fence) is done.
            after = self._hook_future if index > 0 else None

            def start() -> torch.futures.Future:
                self._hook_future = run_hook(hook, state, bucket, after)
                return self._hook_future

            self._fence.launch(index, start)

    def finalize(self) -> None:
        """Complete every bucket in order and write the reduced values into ``param.grad``."""
        self.state = ReducerState.FINALIZING
        hook_name = "allreduce (default)" if self._comm_hook is None else _qualname(self._comm_hook[1])
        try:
            for index, storage in enumerate(self._storages):
                value = self._fence.complete(index)
                storage.copy_out(hook_result(value, hook_name, index, storage.buffer))
                self._fence.consumed(index, "copy to param.grad")
        except BaseException:
            self._abandon()
            raise
        self._fence.end_iteration()
        self.reductions += 1
        self.local_gradients_since_reduction = False
        self._require_finalize = False
        self.state = ReducerState.IDLE

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
            members = self.plan.buckets[index]
            self._storages[index] = BucketStorage(index, [self.params[i] for i in members])
        self._require_finalize = False
        self._ready_order = []
        self._reset_iteration()
        self.state = ReducerState.IDLE


def _qualname(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
