"""The tuned plan's clocks without a GPU: ``CudaClock`` against a recording stand-in for torch.cuda.

What it must do on a GPU: stamp a collective's completion after a wait made on one stream of its
own (never the communication stream, never a new stream per stamp), and read event times, which
CUDA gives in milliseconds, as seconds.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from overlapddp.clock import CudaClock, HostClock, clock_for


class _Cuda:
    """torch.cuda's streams and events, recorded: which stream is current, what was made, when."""

    def __init__(self) -> None:
        self.current: Any = "compute"
        self.streams: list[_Cuda.Stream] = []
        self.synchronized = 0
        self.ms = 0.0  # the device's clock

    class Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

    def make_stream(self, device: torch.device) -> Stream:
        stream = _Cuda.Stream(device)
        self.streams.append(stream)
        return stream

    def event(self, enable_timing: bool = False) -> Any:
        cuda = self

        class Event:
            def record(self, stream: Any) -> None:
                self.stream, self.ms = stream, cuda.ms

            def elapsed_time(self, other: Any) -> float:
                return other.ms - self.ms

        assert enable_timing
        return Event()

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved


class _Future:
    def __init__(self, cuda: _Cuda) -> None:
        self.cuda = cuda
        self.waited_on: list[Any] = []

    def wait(self) -> None:
        self.waited_on.append(self.cuda.current)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> _Cuda:
    fake = _Cuda()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: fake.make_stream(device))
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: fake.current)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: setattr(fake, "synchronized", fake.synchronized + 1))
    return fake


def test_cuda_stamps_wait_on_one_stream_of_their_own_and_read_in_seconds(cuda: _Cuda) -> None:
    clock = CudaClock(torch.device("cuda", 0))
    origin = clock.now()
    futures = [_Future(cuda), _Future(cuda)]
    cuda.ms = 250.0
    first = clock.done(futures[0])
    cuda.ms = 1500.0
    second = clock.done(futures[1])
    assert len(cuda.streams) == 1, "one stamping stream for the clock's life"
    stamping = cuda.streams[0]
    assert stamping.device == torch.device("cuda", 0)
    assert [f.waited_on for f in futures] == [[stamping], [stamping]], "each wait on the stamping stream"
    assert first.stream is stamping and second.stream is stamping  # type: ignore[union-attr]
    assert cuda.current == "compute", "the current stream is restored"
    assert clock.seconds(origin, [first, second]) == [0.25, 1.5]
    assert cuda.synchronized == 1, "the read waits for the device once"


def test_host_clock_counts_a_completion_not_seen_yet_as_now() -> None:
    clock = HostClock()
    origin = clock.now()
    pending = clock.done(torch.futures.Future())
    finished: torch.futures.Future = torch.futures.Future()
    stamp = clock.done(finished)
    finished.set_result(None)
    before = clock.now()
    seen, not_seen = clock.seconds(origin, [stamp, pending])
    assert 0 <= seen <= before - origin <= not_seen  # type: ignore[operator]
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)
    assert type(clock_for(torch.device("mps"))) is HostClock, "only CUDA devices are timed by events"
    assert type(clock_for(torch.device("meta"))) is HostClock
