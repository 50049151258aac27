"""What does a comm hook receive, and when may it run? A GradBucket-compatible object, and hook chaining.

``dist.GradBucket`` cannot be built from Python, so :class:`Bucket` offers the same methods and the
stock hooks in ``torch.distributed.algorithms.ddp_comm_hooks`` run on it unmodified.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.futures import Future

from overlapddp.torch_compat import FUTURE_TYPES

# A user hook's future may resolve to anything; GradientCopy (bucket/reduction.py) checks it is the one tensor expected.
CommHook = Callable[[Any, "Bucket"], Future[Any]]


class Bucket:
    """What a communication hook sees of one bucket, with ``dist.GradBucket``'s methods."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        offsets: Sequence[int],
        lengths: Sequence[int],
        params: Sequence[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._offsets = offsets
        self._lengths = lengths
        self._params = params
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's index; 0 is the first bucket reduced."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor to reduce (the reducer's own storage unless ``set_buffer`` replaced it)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Contiguous per-parameter views into the buffer, in bucket order."""
        return [
            self._buffer.narrow(0, off, length).view(param.shape)
            for off, length, param in zip(self._offsets, self._lengths, self._params, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the buffer holds, in bucket order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (hooks count iterations with it)."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the tensor this object hands out; the reducer only uses the hook's future."""
        self._buffer = tensor


# Stock hooks that issue at most one collective, from the call itself and none from callbacks:
# their buckets need no chaining (see [Note: one hook chain at a time]) and keep full overlap.
UNCHAINED_HOOKS: frozenset[Any] = frozenset(
    {
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        debugging_hooks.noop_hook,
    }
)


def is_unchained(hook: CommHook) -> bool:
    """Whether bucket b's hook may start before bucket b-1's has finished: the stock hooks above,
    and any hook that declares ``hook.issues_one_collective = True`` (it issues at most one
    collective, from the call itself, and none from callbacks)."""
    return hook in UNCHAINED_HOOKS or getattr(hook, "issues_one_collective", False) is True


def run_hook(hook: CommHook, state: Any, bucket: Bucket, after: Future[Any] | None) -> Future[Any]:
    """Start ``hook(state, bucket)`` once ``after``, the previous bucket's hook future, is done.

    [Note: one hook chain at a time]
    PowerSGD and the quantization hooks issue their later collectives from ``.then`` callbacks,
    which run whenever the previous collective finishes. With two buckets' chains in flight, rank 0
    may issue bucket 1's all-reduce before bucket 0's second one while rank 1 does the opposite:
    gloo pairs collectives by issue order, so the sums mix buffers or abort (stock DDP does this
    with more than one bucket). Waiting for the previous chain to finish before starting the next
    makes the issue order the bucket order on every rank. The wait is on the host only (no stream
    is synchronized) and swallows the previous bucket's error, which finalize reports for that
    bucket. The default reduction and unchained hooks (see ``is_unchained``) never wait.
    """
    if after is not None:
        done = threading.Event()
        after.add_done_callback(lambda _: done.set())
        done.wait()
    future = hook(state, bucket)
    if not isinstance(future, FUTURE_TYPES):  # collectives' futures are the C type, not Future
        failed: Future[Any] = Future()
        failed.set_exception(
            TypeError(
                f"Communication hook {getattr(hook, '__qualname__', hook)!r} returned "
                f"{type(future).__name__} for bucket {bucket.index()}; it must return a torch.futures.Future."
            )
        )
        return failed
    return future
