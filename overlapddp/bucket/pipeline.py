"""How is one bucket reduced, start to end? Its pipeline: fill and launch -> complete -> hand over.

The object that owns a bucket's storage also owns its fill, its launch, its completion and its
hand-over to the consumers, with every fence edge it passes on the way. The reducer only counts
gradients and decides *when* (its state machine); it never touches a bucket's buffer or the hook's
result. Per synchronized backward, one bucket goes through:

``launch()`` once every member's gradient is accumulated and every bucket before it has launched
(the fence fills the buffer, scaled as DDP scales it, edges 0 and 1, then starts the scaled sum or
the comm hook on a ``Bucket``, edge 2; a bucket complete ahead of its turn is filled by ``fill()``
then, and launched without a second fill) ->
``write_back(write, consumers)`` (the fence completes it, edge 3; each consumer takes it, the first
being DDP's copy into ``param.grad``: reduction.py; edge 4). What every bucket of one reducer shares
(the fence, the divisor and hook, the guard's write watch, the desync records) is one
:class:`SharedStages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch

from overlapddp.bucket.comm_hook import Bucket
from overlapddp.bucket.consumer import BucketConsumer, ReducedBucket
from overlapddp.bucket.gradient_checks import GradientWriteWatch, nonfinite_error
from overlapddp.bucket.reduction import BucketReduction
from overlapddp.bucket.sparse_storage import SparseBucketStorage
from overlapddp.bucket.storage import BucketStorage
from overlapddp.fence import Fence
from overlapddp.progress import ProgressRecord


@dataclass
class SharedStages:
    """What every bucket pipeline of one reducer uses, one of each (replacing ``fence`` reaches them all)."""

    fence: Fence  # orders every edge; race-forcing tools replace it between iterations
    reduction: BucketReduction  # the divisor, the comm hook and its chaining
    write_watch: GradientWriteWatch  # gradients written while their bucket reduced (guarded optimizers)
    progress: ProgressRecord  # where this rank is, named when a bucket's wait fails
    names: list[str]  # parameter names, by reducer index
    gradient_as_bucket_view: bool
    check_nonfinite: bool = False  # in each fill (a debug option): see gradient_checks.nonfinite_error


class BucketPipeline:
    """Bucket ``index`` (parameters ``members``) from its fill to its ``param.grad`` writes."""

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

    @property
    def params(self) -> list[torch.Tensor]:
        return self.storage.params

    def fill(self) -> None:
        """Every member's gradient is accumulated, but the bucket may not launch yet (an earlier one
        is incomplete, or it is skipped): fill the buffer now, scaled as DDP scales it (edges 0 and 1),
        so that with ``gradient_as_bucket_view`` the gradients are the scaled views as in DDP. Never
        checked for non-finite values: that check is a collective, run by the launches (the reducer
        fills ahead only without it, and a skipped bucket launches nothing on any rank)."""
        self._shared.fence.fill(self.index, partial(self._shared.reduction.copy_in, self.storage))
        self._filled()

    def launch(self, filled: bool) -> None:
        """Start the collective (edge 2), after filling the buffer in the same fence call unless it was
        ``filled`` at its completion (usually it was not: a bucket launches as it completes).

        With the non-finite check on, a bad gradient raises ``FloatingPointError`` on every rank
        instead (nothing launched)."""
        shared, storage = self._shared, self.storage
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{self.index}.launch"):
            shared.fence.launch(
                self.index, None if filled else self._fill(),
                lambda: shared.reduction.start(self.hook_bucket(storage.buffer)),
            )
        if not filled:
            self._filled()

    def _fill(self) -> Callable[[], torch.Tensor]:
        """What the fence runs between edges 0 and 1: DDP's scaled copy-in (then the non-finite check)."""
        fill = partial(self._shared.reduction.copy_in, self.storage)
        return partial(self._fill_checked, fill) if self._shared.check_nonfinite else fill

    def _filled(self) -> None:
        """After the fill: the gradients become the bucket's views, or the guard notes their versions."""
        shared, storage = self._shared, self.storage
        if shared.gradient_as_bucket_view:
            # The fill may still be reading the replaced gradients on this stream (they were made on theirs).
            shared.fence.keep_for_current_stream(storage.point_grads_at_views())
        elif shared.write_watch.watchers:
            shared.write_watch.taken(self.index, self.members, storage.params)

    def _fill_checked(self, fill: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fill``, then the non-finite check of what it read (on the stream that filled)."""
        buffer = fill()
        shared = self._shared
        error = nonfinite_error(
            self.index, self.members, self.storage.params, shared.names, self.storage.buffer.device,
            shared.reduction.process_group,
        )
        if error is not None:
            raise error
        return buffer

    def hook_bucket(self, buffer: torch.Tensor) -> Bucket:
        """This bucket over ``buffer`` as the comm-hook adapter a hook receives."""
        storage = self.storage
        return Bucket(self.index, buffer, storage.offsets, storage.lengths, storage.params, is_last=self._is_last)

    def write_back(self, write: Sequence[bool], consumers: Sequence[BucketConsumer]) -> None:
        """Complete the collective and hand the bucket to each consumer in order (``write``: per
        member, whether some rank produced its gradient; a globally unused one is left alone)."""
        shared = self._shared
        with torch.autograd.profiler.record_function(f"overlapddp.bucket_{self.index}.complete"):
            try:
                value = shared.fence.complete(self.index)
            except Exception as error:
                raise self._failed(error) from error
            shared.write_watch.check(self.index)
            reduced = ReducedBucket(self.index, self.storage, value, write)
            try:
                for consumer in consumers:
                    consumer.take(reduced)
            finally:  # also when a consumer refused: its reads are ordered before the next fill all the same
                written = [p.grad for p in self.storage.params if p.grad is not None]
                shared.fence.consumed(self.index, ", then ".join(c.name for c in consumers), written)

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

