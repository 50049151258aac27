"""When did it happen? Time stamps for the tuned plan: the host clock on CPU, CUDA events on GPUs.

On CPU a collective's future completes when its result is final, so the host clock times it. NCCL's
future completes at enqueue and CUDA kernels run after the host issued them, so on a GPU every stamp
is an event recorded on the stream doing the work (the communication stream for a collective, the
current stream otherwise), read as ``elapsed_time`` from an origin event once the work is done.
A stamp is taken now and read later (:meth:`HostClock.seconds`), so timing never blocks the host
except when the timings are read, once per measured iteration or selection phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence, Union, cast

import torch

Stamp = Union[float, list, "torch.cuda.Event"]


class HostClock:
    """Host time (``time.perf_counter``); a collective is done when its future's callback runs."""

    def now(self) -> Stamp:
        return time.perf_counter()

    def done(self, future: torch.futures.Future) -> Stamp:
        """A stamp of when ``future`` completes (filled by its callback, on any thread)."""
        box: list[float] = []
        future.add_done_callback(lambda _: box.append(time.perf_counter()))
        return box

    def seconds(self, origin: Stamp, stamps: Sequence[Stamp]) -> list[float]:
        """Each stamp's time from ``origin``; a completion whose callback has not run yet counts as
        now (it may run just after the waiter woke)."""
        now = time.perf_counter()
        return [self.host_time(s, now) - origin for s in stamps]  # type: ignore[operator]

    @staticmethod
    def host_time(stamp: Stamp, now: float) -> float:
        """The host time of a stamp of this clock; a completion not seen yet counts as ``now``."""
        return min(stamp, default=now) if isinstance(stamp, list) else stamp  # type: ignore[return-value]


class CudaClock(HostClock):
    """GPU time: an event per stamp, on the stream that is current when it is taken."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stamps: torch.cuda.Stream | None = None  # made at the first ``done``; see there

    def now(self) -> Stamp:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def done(self, future: torch.futures.Future) -> Stamp:
        """Waiting on a CUDA future makes the current stream wait for the collective (NCCL's future is
        already complete on the host, so nothing blocks), and an event recorded after that wait
        completes when the collective does. The wait is made on a stream of its own: on the
        communication stream it would hold every later launch until this collective finished."""
        if self._stamps is None:
            self._stamps = torch.cuda.Stream(device=self._device)
        with torch.cuda.stream(self._stamps):
            future.wait()
            return self.now()

    def seconds(self, origin: Stamp, stamps: Sequence[Stamp]) -> list[float]:
        """Waits for every stamped event (the host blocks here, once per read)."""
        torch.cuda.synchronize(self._device)
        start = cast(torch.cuda.Event, origin)
        return [start.elapsed_time(cast(torch.cuda.Event, s)) / 1e3 for s in stamps]


def clock_for(device: torch.device) -> HostClock:
    """The clock that times work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


@dataclass(frozen=True)
class LaunchStamps:
    """One bucket's launch as the fence saw it: its bytes, the host seconds the launch took on
    backward's thread, a stamp before it and a stamp of its collective's completion."""

    bucket: int
    nbytes: int
    host_seconds: float
    launched: Stamp
    done: Stamp


class BucketStamps:
    """One measured iteration's stamps, taken by the fence as gradients and buckets pass its edges and
    read by the tuner once the iteration ended: the tuner observes the fence, it rides no call.

    Only buckets (keys >= 0) are stamped: the delayed all-reduce is no bucket of the layout.
    """

    def __init__(self, clock: HostClock, params: int) -> None:
        self.clock = clock
        self.origin = clock.now()
        self.ready: list[Stamp | None] = [None] * params  # per parameter: when its gradient was counted in
        self.launches: list[LaunchStamps] = []  # in launch order
        # Per bucket: when its result was complete for the consumer, and when every consumer was done.
        self.completed: dict[int, Stamp] = {}
        self.consumed: dict[int, Stamp] = {}

    def gradient_ready(self, param: int) -> None:
        self.ready[param] = self.clock.now()

    def launch(self, bucket: int, nbytes: int, start: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """Run ``start`` (the collective's launch), stamped before and at its completion."""
        started, launched = time.perf_counter(), self.clock.now()
        future = start()
        self.launches.append(LaunchStamps(bucket, nbytes, time.perf_counter() - started, launched,
                                          self.clock.done(future)))
        return future

    def bucket_completed(self, bucket: int) -> None:
        self.completed[bucket] = self.clock.now()

    def bucket_consumed(self, bucket: int) -> None:
        self.consumed[bucket] = self.clock.now()
