"""Who waits for what: one fence per reducer owns every happens-before edge of every bucket.

Edges, per bucket and iteration, in the order they must happen:

1. *produced*: the bucket's buffer holds every local gradient (written on the producer stream).
2. *launched*: the collective started, ordered after 1 (on CUDA the communication stream waits on
   an event the producer recorded).
3. *completed*: the collective's result is final and visible to the consumer (CPU: its future was
   waited; CUDA: the consumer stream waits on an event recorded after the collective). The log
   records this edge when the consumer waited, with the time the collective actually finished.
4. *consumed*: a reader used the result (the copy into ``param.grad``, then the optimizer).

:meth:`Fence.complete` is the only way to obtain a bucket's reduced tensor, so "no read before
completion" holds by construction. A :class:`FenceLog` (a debug option) records every edge so tests
can check the order without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.futures import Future

EDGE_ORDER = ("produced", "launched", "completed", "consumed")
BACKWARD_END = "backward end"  # not a bucket edge: when the end-of-backward callback started


@dataclass(frozen=True)
class FenceEdge:
    """One recorded edge: which bucket, which edge, who acted, on which stream, through which event."""

    iteration: int
    bucket: int
    edge: str
    actor: str
    stream: str
    event: str | None
    buffer: int
    time: float


@dataclass
class FenceLog:
    """Every edge a fence records, in the order they happened, with the invariants they must obey."""

    edges: list[FenceEdge] = field(default_factory=list)

    def violations(self) -> list[str]:
        """Broken happens-before rules, each described; an empty list means every edge held.

        Per bucket and iteration: produced, launched, completed, consumed, in that order, each once;
        and no buffer is produced into again while a collective on it has not completed.
        """
        problems: list[str] = []
        seen: dict[tuple[int, int], list[str]] = {}
        busy: dict[int, tuple[int, int]] = {}  # buffer -> (iteration, bucket) of an uncompleted launch
        for e in self.edges:
            if e.edge == BACKWARD_END:
                continue
            history = seen.setdefault((e.iteration, e.bucket), [])
            expected = EDGE_ORDER[len(history)] if len(history) < len(EDGE_ORDER) else None
            if e.edge != expected and not (e.edge == "consumed" and history[-1:] == ["consumed"]):
                problems.append(
                    f"iteration {e.iteration} bucket {e.bucket}: '{e.edge}' by {e.actor} after {history or 'nothing'}"
                )
            history.append(e.edge)
            if e.edge == "produced" and e.buffer in busy:
                it, b = busy[e.buffer]
                problems.append(
                    f"iteration {e.iteration} bucket {e.bucket}: buffer reused while the collective of "
                    f"iteration {it} bucket {b} on it had not completed"
                )
            if e.edge == "launched":
                busy[e.buffer] = (e.iteration, e.bucket)
            if e.edge == "completed":
                busy.pop(e.buffer, None)
        return problems


class Fence:
    """CPU fence: a bucket is complete when its collective's future has been waited on."""

    # Whether a collective's future completes when its result is final (CPU backends); NCCL's
    # completes at enqueue, so on CUDA the log keeps the time the consumer waited instead.
    futures_complete_when_done = True

    def __init__(self) -> None:
        # Future of each launched bucket's collective. Produced by ``launch`` (the autograd hook
        # thread), waited on by ``complete`` (the end-of-backward callback); cleared when consumed.
        self._in_flight: dict[int, Future] = {}
        # Buffer each bucket's collective reads and writes, for the log; set by ``produced``.
        self._buffers: dict[int, torch.Tensor] = {}
        self.log: FenceLog | None = None
        self.iteration = 0
        # While logging: when each launched bucket's collective finished, written by its future's
        # callback (any thread), so a timeline shows completions during backward where they happened.
        self._finished_at: dict[int, float] = {}
        self._launched_at: dict[int, float] = {}

    def _record(self, bucket: int, edge: str, actor: str, event: str | None = None, at: float | None = None) -> None:
        if self.log is not None:
            buffer = self._buffers.get(bucket)
            self.log.edges.append(
                FenceEdge(
                    self.iteration, bucket, edge, actor, self._stream_name(), event,
                    0 if buffer is None else buffer.data_ptr(), time.perf_counter() if at is None else at,
                )
            )

    def _stream_name(self) -> str:
        return "cpu"

    def produced(self, bucket: int, buffer: torch.Tensor) -> None:
        """Edge 1: the producer has written ``buffer``; on CPU that already happened on this thread."""
        self._buffers[bucket] = buffer
        self._record(bucket, "produced", "autograd hook")

    def launch(self, bucket: int, start: Callable[[], Future]) -> None:
        """Edge 2: start the collective after everything the producer did."""
        if bucket in self._in_flight:
            raise RuntimeError(f"Bucket {bucket} was launched twice without being completed in between.")
        future = self._in_flight[bucket] = start()
        if self.log is not None and self.futures_complete_when_done:
            self._launched_at[bucket] = time.perf_counter()
            self._finished_at.pop(bucket, None)
            future.add_done_callback(lambda _: self._finished_at.setdefault(bucket, time.perf_counter()))
        self._record(bucket, "launched", "collective", at=self._launched_at.get(bucket))

    def complete(self, bucket: int) -> object:
        """Edge 3: block until the collective is final, then hand over its value."""
        future = self._in_flight.pop(bucket, None)
        if future is None:
            raise RuntimeError(f"Bucket {bucket} was asked for its result but was never launched.")
        value = future.wait()
        finished = None
        if bucket in self._launched_at:  # logging with host-visible completion
            now = time.perf_counter()
            # The callback may run just after the waiter woke; never before the launch was recorded.
            finished = max(min(self._finished_at.pop(bucket, now), now), self._launched_at.pop(bucket))
        self._record(bucket, "completed", "finalize", at=finished)
        return value

    def consumed(self, bucket: int, consumer: str) -> None:
        """Edge 4: a reader used the completed result (logged only; completion already ordered it)."""
        self._record(bucket, "consumed", consumer)

    def backward_ended(self) -> None:
        """Mark when backward's compute ended (the finalize callback started), for timelines."""
        self._record(-1, BACKWARD_END, "autograd engine")

    def end_iteration(self) -> None:
        """Every bucket of this iteration was completed and consumed."""
        self.iteration += 1

    def make_visible(self, strict: bool) -> None:
        """Order the caller after every completed reduction; on CPU completion already did."""

    def in_flight(self) -> list[int]:
        """Buckets whose collective was launched and not yet completed."""
        return sorted(self._in_flight)

    def abandon(self) -> list[int]:
        """Forget every in-flight collective (after an error); returns the buckets it dropped."""
        dropped = self.in_flight()
        self._in_flight.clear()
        self.iteration += 1
        return dropped


class CudaFence(Fence):
    """CUDA fence: collectives run on a communication stream ordered by events, never by the host.

    ``work.wait()`` on the host is not enough on CUDA: the stream that reads the gradient must wait
    on an event recorded after the collective, which is what ``complete`` does.
    """

    futures_complete_when_done = False

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        # Stream the collectives are issued on; it waits on each bucket's ``_produced`` event and
        # the consumer waits on it through each bucket's completion event.
        self._comm_stream = torch.cuda.Stream(device=device)
        # Event recorded on the producer (autograd) stream after a bucket's copy-in; the
        # communication stream waits on it in ``launch``, which then drops it.
        self._produced: dict[int, torch.cuda.Event] = {}
        # Event recorded on the communication stream after each bucket's collective, and the stream
        # that consumed it in ``complete``; another stream (an optimizer on a side stream) waits on
        # them in ``make_visible``. Replaced every iteration.
        self._completed: dict[int, torch.cuda.Event] = {}
        self._consumer: torch.cuda.Stream | None = None

    def _stream_name(self) -> str:
        return f"cuda stream {torch.cuda.current_stream(self._comm_stream.device).stream_id}"

    def produced(self, bucket: int, buffer: torch.Tensor) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._comm_stream.device))
        self._produced[bucket] = event
        super().produced(bucket, buffer)

    def launch(self, bucket: int, start: Callable[[], Future]) -> None:
        event = self._produced.pop(bucket, None)
        if event is None:
            raise RuntimeError(f"Bucket {bucket} was launched before it was produced.")
        with torch.cuda.stream(self._comm_stream):
            self._comm_stream.wait_event(event)
            super().launch(bucket, start)
            # The buffer is used on the communication stream: keep its memory from being reused
            # by the caching allocator before that stream's work on it is done (a sparse gradient's
            # memory is its indices and values).
            buffer = self._buffers[bucket]
            for tensor in (buffer._indices(), buffer._values()) if buffer.is_sparse else (buffer,):
                tensor.record_stream(self._comm_stream)

    def complete(self, bucket: int) -> object:
        with torch.cuda.stream(self._comm_stream):
            value = super().complete(bucket)
            done = torch.cuda.Event()
            done.record(self._comm_stream)
        self._consumer = torch.cuda.current_stream(self._comm_stream.device)
        self._consumer.wait_event(done)
        self._completed[bucket] = done
        return value

    def make_visible(self, strict: bool) -> None:
        current = torch.cuda.current_stream(self._comm_stream.device)
        if self._consumer is None or current == self._consumer:
            return
        if strict:
            raise RuntimeError(
                f"The optimizer runs on CUDA stream {current.stream_id}, but the reduced gradients were made "
                f"visible to stream {self._consumer.stream_id} only; make it wait on that stream, or attach the "
                "optimizer with strict=False to let the guard insert the wait."
            )
        for event in self._completed.values():
            current.wait_event(event)

    def abandon(self) -> list[int]:
        self._produced.clear()
        return super().abandon()


def fence_for(device: torch.device) -> Fence:
    """The fence that matches where the gradients live."""
    return CudaFence(device) if device.type == "cuda" else Fence()
