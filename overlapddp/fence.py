"""Who waits for what: one fence per reducer owns every happens-before edge of every bucket.

Edges, per bucket, in the order they must happen:

1. *produced*: the last gradient was copied into the bucket (on the producer stream).
2. *launched*: the collective started, ordered after 1 (on CUDA the communication stream waits on
   the producer's event).
3. *complete*: the collective's result is final and visible to the consumer (CPU: the work
   handle's future was waited; CUDA: the consumer stream waits on an event recorded after it).

Nothing may read the bucket or write ``param.grad`` from it before edge 3; :meth:`Fence.complete`
is the only way to get the reduced tensor, so that rule is structural.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.futures import Future


class Fence:
    """CPU fence: a bucket is complete when its collective's future has been waited on."""

    def __init__(self) -> None:
        # Future of each launched bucket's collective. Produced by ``launch`` (the autograd hook
        # thread), waited on by ``complete`` (the end-of-backward callback); cleared when consumed.
        self._in_flight: dict[int, Future] = {}

    def produced(self, bucket: int) -> None:
        """Edge 1: nothing to record on CPU, where the copy-in has already happened on this thread."""

    def launch(self, bucket: int, start: Callable[[], Future]) -> None:
        """Edge 2: start the collective after everything the producer did."""
        if bucket in self._in_flight:
            raise RuntimeError(f"Bucket {bucket} was launched twice without being completed in between.")
        self._in_flight[bucket] = start()

    def complete(self, bucket: int) -> object:
        """Edge 3: block until the collective is final, then hand over its value."""
        future = self._in_flight.pop(bucket, None)
        if future is None:
            raise RuntimeError(f"Bucket {bucket} was asked for its result but was never launched.")
        return future.wait()

    def in_flight(self) -> list[int]:
        """Buckets whose collective was launched and not yet completed."""
        return sorted(self._in_flight)

    def abandon(self) -> list[int]:
        """Forget every in-flight collective (after an error); returns the buckets it dropped."""
        dropped = self.in_flight()
        self._in_flight.clear()
        return dropped


class CudaFence(Fence):
    """CUDA fence: collectives run on a communication stream ordered by events, never by the host.

    ``work.wait()`` on the host is not enough on CUDA: the stream that reads the gradient must wait
    on an event recorded after the collective, which is what ``complete`` does.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        # Stream the collectives are issued on; waits on each bucket's ``_produced`` event and is
        # waited on by the consumer through each bucket's completion event.
        self._comm_stream = torch.cuda.Stream(device=device)
        # Event recorded on the producer (autograd) stream after a bucket's last copy-in;
        # the communication stream waits on it in ``launch``. Freed there.
        self._produced: dict[int, torch.cuda.Event] = {}

    def produced(self, bucket: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._comm_stream.device))
        self._produced[bucket] = event

    def launch(self, bucket: int, start: Callable[[], Future]) -> None:
        event = self._produced.pop(bucket, None)
        if event is None:
            raise RuntimeError(f"Bucket {bucket} was launched before it was produced.")
        with torch.cuda.stream(self._comm_stream):
            self._comm_stream.wait_event(event)
            super().launch(bucket, start)

    def complete(self, bucket: int) -> object:
        with torch.cuda.stream(self._comm_stream):
            value = super().complete(bucket)
            done = torch.cuda.Event()
            done.record(self._comm_stream)
        torch.cuda.current_stream(self._comm_stream.device).wait_event(done)
        return value

    def abandon(self) -> list[int]:
        self._produced.clear()
        return super().abandon()


def fence_for(device: torch.device) -> Fence:
    """The fence that matches where the gradients live."""
    return CudaFence(device) if device.type == "cuda" else Fence()
