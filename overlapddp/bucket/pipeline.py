"""How is one bucket reduced, start to end? Its pipeline: fill -> launch -> complete -> write back.

The object that owns a bucket's storage also owns its launch, its completion and its write-back,
with every fence edge it passes on the way. The reducer only counts gradients and decides *when*
(its state machine); it never touches a bucket's buffer, its fence edges or the hook's result. Per
synchronized backward, one bucket goes through:

``gradient_ready()`` once per member (the last one fills the buffer, scaled as DDP scales it: fence
edges 0 and 1) -> ``launch()`` (the scaled sum or the comm hook on a ``Bucket``: edge 2) ->
``write_back()`` (the fence completes it, edge 3; the hook's result is checked and copied into
``param.grad``, edge 4). What every bucket of one reducer shares (the fence, the divisor and hook,
the guard's write watch, the desync records) is one :class:`SharedStages`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch

from overlapddp.bucket.comm_hook import Bucket
from overlapddp.bucket.gradient_checks import GradientWriteWatch, nonfinite_error
from overlapddp.bucket.reduction import BucketReduction
from overlapddp.bucket.sparse_storage import SparseBucketStorage
from overlapddp.bucket.storage import BucketStorage
from overlapddp.fence import Fence
from overlapddp.progress import ProgressRecord

if TYPE_CHECKING:
    from overlapddp.layout.tuner import PlanTuner


@dataclass
class SharedStages:
    """What every bucket pipeline of one reducer uses, one of each (replacing ``fence`` reaches them all)."""

    fence: Fence  # orders every edge; race-forcing tools replace it between iterations
    reduction: BucketReduction  # the divisor, the comm hook and its chaining
    write_watch: GradientWriteWatch  # gradients written while their bucket reduced (guarded optimizers)
    progress: ProgressRecord  # where this rank is, named when a bucket's wait fails
    names: list[str]  # parameter names, by reducer index
    gradient_as_bucket_view: bool
    check_nonfinite: bool = False  # before each launch (a debug option): see gradient_checks.nonfinite_error
    # A sharded optimizer's update of one reduced bucket shard (bucket index, which members are written),
    # replacing the copy into param.grad; its buckets are reduce-scattered over their padded buffers.
    shard_sink: Callable[[int, list[bool]], None] | None = None


class BucketPipeline:
    """Bucket ``index`` (parameters ``members``) from its first gradient to its ``param.grad`` writes."""

    def __init__(
        self,
        index: int,
        members: Sequence[int],
        storage: BucketStorage | SparseBucketStorage,
        shared: SharedStages,
        is_last: bool,
    ) -> None:
        self.index = index
        self.members = list(members)
        self.storage = storage
        self._shared = shared
        self._is_last = is_last
        self.missing = len(self.members)  # gradients of this backward not yet accumulated

    @property
    def params(self) -> list[torch.Tensor]:
        return self.storage.params

    @property
    def filled(self) -> bool:
        """Every member's gradient is in the buffer: the bucket may launch."""
        return self.missing == 0

    def reset(self) -> None:
        """A new synchronized backward: no gradient of it has arrived."""
        self.missing = len(self.members)

    def gradient_ready(self) -> bool:
        """One member's gradient was accumulated (on the current stream); the last one fills the
        bucket. Returns whether the bucket is filled."""
        shared = self._shared
        shared.fence.gradient_ready(self.index)
        self.missing -= 1
        if self.missing:
            return False
        shared.fence.filling(self.index)
        shared.reduction.copy_in(self.storage)
        if shared.gradient_as_bucket_view:
            self.storage.point_grads_at_views()
        elif shared.write_watch.watchers:
            shared.write_watch.taken(self.index, self.members, self.storage.params)
        shared.fence.produced(self.index, self.storage.buffer)  # on the stream that wrote the bucket
        return True

    def launch(self, timing: PlanTuner | None) -> None:
        """Start the bucket's collective after its fill; ``timing``: the tuner while it measures.

        With the non-finite check on, a bad gradient raises ``FloatingPointError`` on every rank
        instead (nothing launched)."""
        shared = self._shared
        if shared.check_nonfinite:
            shared.fence.order_after_produced(self.index)  # the check reads param.grad, maybe on another stream
            error = nonfinite_error(
                self.index, self.members, self.storage.params, shared.names, self.storage.buffer.device,
                shared.reduction.process_group,
            )
            if error is not None:
                raise error
        sharded = shared.shard_sink is not None  # no sparse bucket is sharded
        bucket = self.hook_bucket(cast(BucketStorage, self.storage).padded if sharded else self.storage.buffer)
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{self.index}.launch"):
            shared.fence.launch(self.index, lambda: self._start(bucket, timing))

    def _start(self, bucket: Bucket, timing: PlanTuner | None) -> torch.futures.Future:
        """Run on the fence's launch stream: the reduction, timed for the tuner while it calibrates."""
        if timing is None:
            return self._shared.reduction.start(bucket)
        started, launched = time.perf_counter(), timing.now()
        future = self._shared.reduction.start(bucket)
        buffer = bucket.buffer()
        timing.bucket_launched(buffer.numel() * buffer.element_size(), len(self.members), started, launched, future)
        return future

    def hook_bucket(self, buffer: torch.Tensor) -> Bucket:
        """This bucket over ``buffer`` as the comm-hook adapter a hook receives."""
        storage = self.storage
        return Bucket(self.index, buffer, storage.offsets, storage.lengths, storage.params, is_last=self._is_last)

    def write_back(
        self, write: Sequence[bool], timing: PlanTuner | None, after: Callable[[list[torch.Tensor]], None] | None
    ) -> None:
        """Complete the collective and copy the reduced values into the ``.grad`` of each member
        marked in ``write`` (a globally unused gradient is left alone); then ``after`` (the overlapped
        optimizer's update of this bucket) with its parameters."""
        shared = self._shared
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{self.index}.complete"):
            try:
                value = shared.fence.complete(self.index)
            except Exception as error:
                raise self._failed(error) from error
            reduced_at = timing.now() if timing is not None else None
            shared.write_watch.check(self.index)
            if shared.shard_sink is not None:  # the reduced shard is the sink's: it updates its parameters
                shared.shard_sink(self.index, list(write))
                shared.fence.consumed(self.index, "sharded update")
                return  # (no tuner and no overlapped optimizer with a sharded one)
            result = hook_result(value, shared.reduction.hook_name, self.index, self.storage.buffer)
            self.storage.copy_out(result, write, as_view=shared.gradient_as_bucket_view)
            written = [p.grad for p in self.storage.params if p.grad is not None]
            shared.fence.consumed(self.index, "copy to param.grad", written)
        if after is not None:
            after(self.storage.params)
        if timing is not None and reduced_at is not None:
            timing.bucket_finalized(reduced_at, timing.now())

    def _failed(self, error: Exception) -> RuntimeError:
        """The error for a failed completion: which bucket and rank failed, and (from the progress
        records) which ranks are behind."""
        names = self._shared.names
        listed = ", ".join(names[i] for i in self.members[:4]) + (", ..." if len(self.members) > 4 else "")
        return RuntimeError(
            f"The reduction of bucket {self.index} ({len(self.members)} parameters: {listed}) failed on rank "
            f"{self._shared.reduction.rank}: {error}. Another rank may have died or timed out."
            f"{self._shared.progress.behind(self.index)} This iteration's gradients were not reduced; the "
            "process group may no longer be usable."
        )

    def shadow(self) -> torch.futures.Future:
        """A joined rank's part: the same collective as the others', on zeros."""
        return self._shared.reduction.start(self.hook_bucket(torch.zeros_like(self.storage.buffer)))


def hook_result(value: object, hook_name: str, bucket_index: int, expected: torch.Tensor) -> torch.Tensor:
    """The one tensor a hook's future must resolve to, checked against the bucket's size.

    DDP accepts a tensor or a one-element list; anything else, or a tensor of another size, is an
    error that names the hook and the bucket instead of a failed stride check later.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Communication hook {hook_name} returned a future whose value is {type(value).__name__} "
            f"for bucket {bucket_index}; expected one tensor of {expected.numel()} elements."
        )
    if value.numel() != expected.numel() or not value.is_floating_point() and not value.is_complex():
        raise ValueError(
            f"Communication hook {hook_name} returned a {tuple(value.shape)} {value.dtype} tensor for "
            f"bucket {bucket_index}; expected {expected.numel()} elements of a floating dtype "
            f"(the bucket holds {expected.dtype})."
        )
    return value
