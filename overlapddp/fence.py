"""Who waits for what: one fence per reducer owns every happens-before edge of every bucket.

Edges, per bucket and iteration, in the order they must happen:

0. *filling* (not logged): the producer is about to overwrite the buffer; on CUDA its stream first
   waits until the previous iteration's copy-out (on the consumer stream) has read it.
1. *produced*: the bucket's buffer holds every local gradient (written on the producer stream, the
   stream current when the bucket was filled).
2. *launched*: the collective started, ordered after 1 (on CUDA the communication stream waits on
   an event the producer recorded).
3. *completed*: the collective's result is final and visible to the consumer (CPU: its future was
   waited; CUDA: the consumer stream waits on an event recorded after the collective). The log
   records this edge when the consumer waited, with the time the collective actually finished.
4. *consumed*: a reader used the result (the copy into ``param.grad``, then the optimizer).

:meth:`Fence.launch` is the only way to start a collective (after the producer's fill, edges 0 and 1,
run in the same call or by an earlier :meth:`Fence.fill`) and :meth:`Fence.complete` the only way to
obtain a bucket's reduced tensor, so "no launch before the fill" and "no read before completion"
hold by construction. A :class:`FenceLog` (a debug
option) records every edge so tests can check the order without a GPU. The CUDA design (who records,
who waits) is in docs/cuda.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.futures import Future

from overlapddp.clock import BucketStamps, HostClock, Stamp
from overlapddp.device_streams import CudaKit

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

    def __init__(self, before_wait: Callable[[int, Future], None] | None = None) -> None:
        # Called with (bucket, future) before ``complete`` waits: the desync records note the wait.
        self._before_wait = before_wait
        # Future of each launched bucket's collective. Produced by ``launch`` (the autograd hook
        # thread), waited on by ``complete`` (the end-of-backward callback); cleared when consumed.
        self._in_flight: dict[int, Future] = {}
        # Buffer each bucket's collective reads and writes, for the log and the tuner's stamps; set
        # by ``_produced``.
        self._buffers: dict[int, torch.Tensor] = {}
        # Buckets filled (edge 1) and not launched yet: ``fill`` adds, ``launch`` takes; dropped by ``abandon``.
        self._filled: set[int] = set()
        self.log: FenceLog | None = None
        self.iteration = 0
        # While logging: when each launched bucket's collective finished, a host-clock stamp filled by
        # its future's callback (any thread), so a timeline shows completions during backward where
        # they happened; read by ``complete``.
        self._clock = HostClock()
        self._finished_at: dict[int, Stamp] = {}
        self._launched_at: dict[int, float] = {}
        # While the tuned plan measures an iteration: its stamps, attached and read by the tuner
        # (layout/lifecycle.py), taken here at each edge on the device's clock.
        self.stamps: BucketStamps | None = None

    def _record(self, bucket: int, edge: str, actor: str, event: str | None = None, at: float | None = None) -> None:
        if self.log is not None:
            buffer = self._buffers.get(bucket)
            self.log.edges.append(
                FenceEdge(
                    self.iteration, bucket, edge, actor, self._stream_name(), event,
                    _address(buffer), time.perf_counter() if at is None else at,
                )
            )

    def _stream_name(self) -> str:
        return "cpu"

    def gradient_ready(self, bucket: int, param: int | None = None) -> None:
        """Gradient ``param`` of ``bucket`` was accumulated on the current stream (CPU: on this thread)."""
        if self.stamps is not None and param is not None:
            self.stamps.gradient_ready(param)

    def fill(self, bucket: int, fill: Callable[[], torch.Tensor]) -> None:
        """Edges 0 and 1: ``fill`` writes every local gradient into the bucket's buffer once nothing
        reads it any more (edge 0) and returns that buffer, which is then produced (edge 1)."""
        self._filling(bucket)
        buffer = fill()
        self._produced(bucket, buffer)
        self._filled.add(bucket)

    def launch(self, bucket: int, fill: Callable[[], torch.Tensor] | None, start: Callable[[], Future]) -> None:
        """Edge 2, the only way to start a collective: ``start`` runs it after everything the producer
        did, ``fill`` first (edges 0 and 1) unless the bucket was filled already (:meth:`fill`)."""
        if bucket in self._in_flight:
            raise RuntimeError(f"Bucket {bucket} was launched twice without being completed in between.")
        if fill is not None:
            self.fill(bucket, fill)
        if bucket not in self._filled:
            raise RuntimeError(f"Bucket {bucket} was launched before it was filled.")
        self._filled.discard(bucket)
        self._start(bucket, start)

    def _filling(self, bucket: int) -> None:
        """Edge 0: the producer is about to overwrite the bucket; on CPU every read of it is over."""

    def _produced(self, bucket: int, buffer: torch.Tensor) -> None:
        """Edge 1: the producer has written ``buffer``; on CPU that already happened on this thread."""
        self._buffers[bucket] = buffer
        self._record(bucket, "produced", "autograd hook")

    def _start(self, bucket: int, start: Callable[[], Future]) -> None:
        """Edge 2: start the collective (timed while the tuned plan measures)."""
        stamps = self.stamps
        if stamps is not None and bucket >= 0:
            buffer = self._buffers[bucket]
            future = self._in_flight[bucket] = stamps.launch(bucket, buffer.numel() * buffer.element_size(), start)
        else:
            future = self._in_flight[bucket] = start()
        if self.log is not None and self.futures_complete_when_done:
            self._launched_at[bucket] = time.perf_counter()
            self._finished_at[bucket] = self._clock.done(future)
        self._record(bucket, "launched", "collective", at=self._launched_at.get(bucket))

    def complete(self, bucket: int) -> object:
        """Edge 3: block until the collective is final, then hand over its value."""
        value = self._wait_for(bucket)
        self._stamp_completed(bucket)
        return value

    def _stamp_completed(self, bucket: int) -> None:
        """The consumer may read the result from here (stamped on the consumer's stream)."""
        if self.stamps is not None and bucket >= 0:
            self.stamps.bucket_completed(bucket)

    def _wait_for(self, bucket: int) -> object:
        """Pop the bucket's collective and wait for it (on CUDA: on the stream in use)."""
        future = self._in_flight.pop(bucket, None)
        if future is None:
            raise RuntimeError(f"Bucket {bucket} was asked for its result but was never launched.")
        if self._before_wait is not None:
            self._before_wait(bucket, future)
        value = self._wait(future)
        finished = None
        if bucket in self._launched_at:  # logging with host-visible completion
            now = time.perf_counter()
            # The callback may run just after the waiter woke; never before the launch was recorded.
            finished = max(min(self._clock.host_time(self._finished_at.pop(bucket), now), now),
                           self._launched_at.pop(bucket))
        self._record(bucket, "completed", "finalize", at=finished)
        return value

    def _wait(self, future: Future) -> Any:
        return future.wait()

    def consumed(self, bucket: int, consumer: str, written: Sequence[torch.Tensor] = ()) -> None:
        """Edge 4: every reader used the completed result (the copy into ``param.grad``, then an
        optimizer's update), writing ``written`` (on CUDA those are kept for this stream)."""
        self._record(bucket, "consumed", consumer)
        if self.stamps is not None and bucket >= 0:
            self.stamps.bucket_consumed(bucket)

    def backward_ended(self) -> None:
        """Mark when backward's compute ended (the finalize callback started), for timelines."""
        self._record(-1, BACKWARD_END, "autograd engine")

    def end_iteration(self) -> None:
        """Every bucket of this iteration was completed and consumed (a skipped one only filled)."""
        self.iteration += 1
        self._filled.clear()

    def make_visible(self, strict: bool, gradients: Sequence[torch.Tensor] = ()) -> None:
        """Order the caller, about to read or write ``gradients``, after every completed reduction
        and copy-out; on CPU completion already did."""

    def keep_for_current_stream(self, tensors: Sequence[torch.Tensor]) -> None:
        """The host is about to drop ``tensors``, which the current stream used; on CPU that work is done."""

    def in_flight(self) -> list[int]:
        """Buckets whose collective was launched and not yet completed."""
        return sorted(self._in_flight)

    def abandon(self) -> list[int]:
        """Forget every in-flight collective (after an error); returns the buckets it dropped. On CPU
        their buffers may be replaced at once: gloo's work keeps its tensors until it is done, and a
        hook's callback the tensors it writes."""
        dropped = self.in_flight()
        self._in_flight.clear()
        self._filled.clear()
        self.iteration += 1
        return dropped


class CudaFence(Fence):
    """CUDA fence: collectives run on a communication stream ordered by events, never by the host.

    ``work.wait()`` on the host is not enough on CUDA: the stream that reads the gradient must wait
    on an event recorded after the collective, which is what ``complete`` does. Streams, events and
    waits come from ``kit`` (a recording fake in tests).
    """

    futures_complete_when_done = False

    def __init__(
        self, device: torch.device, kit: CudaKit | None = None, before_wait: Callable[[int, Future], None] | None = None
    ) -> None:
        super().__init__(before_wait)
        self._kit = CudaKit(device) if kit is None else kit
        # Stream the collectives are issued on; it waits on each bucket's produced event (recorded on the
        # producer stream after the copy-in, in the same ``launch``), and
        # the consumer waits on it through the event ``complete`` records after the collective. High
        # priority, so that its short launches are not queued behind compute on the default priority.
        self._comm_stream = self._kit.new_stream(high_priority=True)
        # One event per bucket and edge, made once and recorded again each iteration: each record is
        # waited on (or dropped, after an error) before the same event is recorded again.
        self._events: dict[tuple[int, str], Any] = {}
        # Event recorded on the consumer stream after a bucket's consumers (``consumed``); the next
        # iteration's producer stream waits on it in ``_filling`` before overwriting the buffer.
        self._released: dict[int, Any] = {}
        # Stream that ran the last copy-out (current in ``complete``); a reader on another stream
        # (an optimizer on a side stream) waits on all of it in ``make_visible``.
        self._consumer: Any | None = None
        # Per bucket being filled: the stream of its last accumulated gradient (``gradient_ready``), and
        # an event on each stream it switched away from; the filling stream waits on them in ``_filling``.
        # Backward accumulates a gradient on the stream its forward op ran on, so one bucket's gradients
        # can come from several streams; with one stream (the usual case) no event is made.
        self._last_producer: dict[int, Any] = {}
        self._other_producers: dict[int, list[Any]] = {}

    def _stream_name(self) -> str:
        return f"cuda stream {self._kit.current_stream().stream_id}"

    def gradient_ready(self, bucket: int, param: int | None = None) -> None:
        super().gradient_ready(bucket, param)
        current = self._kit.current_stream()
        last = self._last_producer.get(bucket)
        if last is not None and last != current:
            self._other_producers.setdefault(bucket, []).append(self._event_on(last))
        self._last_producer[bucket] = current

    def _event_on(self, stream: Any) -> Any:
        event = self._kit.new_event()
        event.record(stream)
        return event

    def _filling(self, bucket: int) -> None:
        current = self._kit.current_stream()
        last = self._last_producer.pop(bucket, None)
        producers = self._other_producers.pop(bucket, [])
        if last is not None and last != current:
            producers.append(self._event_on(last))
        for event in producers:
            self._kit.wait_event(current, event, "gradient")
        released = self._released.pop(bucket, None)
        if released is not None:
            self._kit.wait_event(current, released, "released")

    def _event(self, bucket: int, edge: str) -> Any:
        event = self._events.get((bucket, edge))
        if event is None:
            event = self._events[(bucket, edge)] = self._kit.new_event()
        return event

    def _produced(self, bucket: int, buffer: torch.Tensor) -> None:
        producer = self._kit.current_stream()
        event = self._event(bucket, "produced")
        event.record(producer)
        # The buffer may be dropped (a rebuild, an error) while the fill is still queued.
        self._kit.record_stream(buffer, producer)
        super()._produced(bucket, buffer)

    def _start(self, bucket: int, start: Callable[[], Future]) -> None:
        with self._kit.use(self._comm_stream):
            self._kit.wait_event(self._comm_stream, self._event(bucket, "produced"), "produced")
            super()._start(bucket, start)
            self._kit.record_stream(self._buffers[bucket], self._comm_stream)

    def _wait(self, future: Future) -> Any:
        return self._kit.wait_future(future, "collective")

    def complete(self, bucket: int) -> object:
        with self._kit.use(self._comm_stream):
            value = self._wait_for(bucket)
            done = self._event(bucket, "completed")
            done.record(self._comm_stream)
        consumer = self._kit.current_stream()
        self._kit.wait_event(consumer, done, "completed")
        # The consumer reads the result (the bucket's buffer, or a tensor a hook made on another
        # stream): neither may be reused before the copy-out has run, even if dropped before that.
        for tensor in _tensors_of(value):
            self._kit.record_stream(tensor, consumer)
        self._consumer = consumer
        self._stamp_completed(bucket)
        return value

    def consumed(self, bucket: int, consumer: str, written: Sequence[torch.Tensor] = ()) -> None:
        stream = self._kit.current_stream()
        released = self._event(bucket, "released")
        released.record(stream)
        self._released[bucket] = released
        # The gradients were allocated on the producer stream and written here: a zero_grad that
        # drops them must not let that stream reuse their memory before this write has run.
        for tensor in written:
            self._kit.record_stream(tensor, stream)
        super().consumed(bucket, consumer, written)

    def make_visible(self, strict: bool, gradients: Sequence[torch.Tensor] = ()) -> None:
        current = self._kit.current_stream()
        if self._consumer is None or current == self._consumer:
            return
        if strict:
            raise RuntimeError(
                f"The optimizer runs on CUDA stream {current.stream_id}, but the reduced gradients were made "
                f"visible to stream {self._consumer.stream_id} only; make it wait on that stream, or attach the "
                "optimizer with strict=False to let the guard insert the wait."
            )
        # The copy-out into param.grad ran on the consumer stream after the collectives: wait for it
        # all, not only for the collectives' events.
        self._kit.wait_stream(current, self._consumer, "reader")
        for gradient in gradients:
            self._kit.record_stream(gradient, current)

    def keep_for_current_stream(self, tensors: Sequence[torch.Tensor]) -> None:
        current = self._kit.current_stream()
        for tensor in tensors:
            self._kit.record_stream(tensor, current)

    def abandon(self) -> list[int]:
        """Also order the communication stream after each dropped collective and its hook's callbacks
        (NCCL's future is done at enqueue, so keeping it proves nothing): the buffers, recorded for
        that stream at launch, then return to the allocator only after those writes."""
        self._last_producer.clear()
        self._other_producers.clear()
        with self._kit.use(self._comm_stream):
            for bucket in self.in_flight():
                try:
                    self._kit.wait_future(self._in_flight[bucket], "collective")
                except Exception:  # noqa: BLE001 - the iteration is dropped; its collective's error with it
                    pass
        return super().abandon()


def _address(buffer: torch.Tensor | None) -> int:
    """What names a bucket's buffer in the log: its memory, or a sparse gradient's own identity (it has
    no data pointer, and a gloo worker may be replacing its indices and values while it reduces)."""
    if buffer is None:
        return 0
    return id(buffer) if buffer.is_sparse else buffer.data_ptr()


def _tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors a collective's future resolved to (a tensor or a list of them)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [t for t in items if isinstance(t, torch.Tensor)]


def fence_for(device: torch.device, before_wait: Callable[[int, Future], None] | None = None) -> Fence:
    """The fence that orders the streams of ``device``, where every reduced gradient lives (one device
    per wrapper: construction refuses a module spread over several)."""
    return CudaFence(device, before_wait=before_wait) if device.type == "cuda" else Fence(before_wait)
