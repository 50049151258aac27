"""Has this stream seen that happen? Vector clocks of streams, events and the host.

Each stream (the host is one, ``HOST``) keeps a clock: for every other stream, or every collective,
how far of it this stream is ordered after. A stream's own counter ticks as it works; a wait on an
event or another stream merges that clock into the waiter's; whatever the host has seen finish (a
``synchronize``, a blocking copy to the host, a gloo work waited on) orders every later access of
every stream, so a stream merges the host's clock before each check.

One model for two users: the race detector (``overlapddp.sanitize``) asks whether the stream that
reads a tensor has seen its collective complete, and the test suite's CUDA model (``tests/support/streams``)
asks whether one access is ordered after another.
"""

from __future__ import annotations

Clock = dict[str, int]
HOST = "host"
# Where device collectives run, as one stream (NCCL's): a device-wide synchronize sees them complete.
COLLECTIVES = "collectives"


def merge(into: Clock, other: Clock) -> None:
    """``into`` is now ordered after everything ``other`` is."""
    for name, tick in other.items():
        if into.get(name, 0) < tick:
            into[name] = tick


class StreamClocks:
    """Every stream's clock, by name; the host's is ``HOST``'s."""

    def __init__(self) -> None:
        self._clocks: dict[str, Clock] = {HOST: {HOST: 0}}

    @property
    def host(self) -> Clock:
        return self._clocks[HOST]

    def of(self, stream: str) -> Clock:
        """``stream``'s clock (the same dict each time: callers may update it)."""
        clock = self._clocks.get(stream)
        if clock is None:
            clock = self._clocks[stream] = {stream: 0}
        return clock

    def merge_host(self, stream: str) -> None:
        """Work queued on ``stream`` from now on runs after what the host has seen finish."""
        if stream != HOST:
            merge(self.of(stream), self.host)

    def tick(self, stream: str) -> int:
        """``stream`` does one more thing; its number."""
        self.merge_host(stream)
        clock = self.of(stream)
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def wait(self, stream: str, clock: Clock) -> None:
        """``stream`` waits for an event (the clock it recorded) or a completion."""
        merge(self.of(stream), clock)

    def wait_stream(self, stream: str, other: str) -> None:
        self.merge_host(other)
        merge(self.of(stream), self.of(other))

    def host_sees(self, clock: Clock) -> None:
        merge(self.host, clock)

    def host_sees_every_stream(self) -> None:
        """The host waited for every stream (``torch.cuda.synchronize()``)."""
        for clock in list(self._clocks.values()):
            merge(self.host, clock)

    def ordered_after(self, stream: str, other: str, tick: int) -> bool:
        """Whether ``stream``, as it is now, runs after ``other``'s ``tick``-th step."""
        return other == stream or self.of(stream).get(other, 0) >= tick

    def forget(self, name: str) -> None:
        """``name`` (a retired collective) no longer matters to any check: drop it from every clock."""
        for clock in self._clocks.values():
            clock.pop(name, None)
        self._clocks.pop(name, None)
