"""A host clock whose stamps count: the order the fence stamps in, without reading time."""

from __future__ import annotations

from torch.futures import Future

from overlapddp.clock import HostClock

DONE = "done"  # what every collective's completion stamp reads


class Ticks(HostClock):
    """Each ``now()`` is the next integer; each completion stamp is :data:`DONE`."""

    def __init__(self) -> None:
        self.ticks = 0

    def now(self) -> int:  # type: ignore[override]
        self.ticks += 1
        return self.ticks

    def done(self, future: Future) -> str:  # type: ignore[override]
        return DONE
