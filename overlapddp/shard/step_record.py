"""Which ranks reached this ``step()``, so that a broadcast that fails can name the ranks that did not?

Each rank of a sharded optimizer writes, in the process group's store, how many steps it has
entered (one write per step, before its first broadcast). When a broadcast then fails (a rank died,
or the process group's timeout passed while one lagged), the error lists every other rank with the
step it last entered. Only the store is touched: no collective, no wait. Kept on the host (gloo)
only: with NCCL the device waits, not the host.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as dist

from overlapddp.torch_compat import group_store

_optimizers = itertools.count()  # one key space per sharded optimizer, in attach order (the same on every rank)


class StepRecord:
    """This rank's count of entered steps in the store, and the others' when a broadcast failed."""

    def __init__(self, group: dist.ProcessGroup, on_host: bool) -> None:
        self._store: Any | None = group_store(group) if on_host else None
        self._rank, self._size = dist.get_rank(group), group.size()
        self._prefix = f"overlapddp/shard-step/{next(_optimizers)}/"
        self.entered = 0

    def enter(self) -> None:
        """This rank starts its next step."""
        self.entered += 1
        if self._store is None:
            return
        try:
            self._store.set(self._prefix + str(self._rank), str(self.entered))
        except Exception:  # a store that is gone leaves the broadcasts to report the failure
            self._store = None

    def others(self) -> str:
        """The other ranks and the step each last entered, for an error message."""
        if self._store is None:
            return "the ranks' step records are not kept on this device"
        said = []
        try:
            for rank in (r for r in range(self._size) if r != self._rank):
                key = self._prefix + str(rank)
                step = int(self._store.get(key)) if self._store.check([key]) else 0
                where = "in this step or done with it" if step == self.entered else f"last entered step {step}"
                said.append(f"rank {rank}: {where}")
        except Exception as error:  # the store went with a rank that died
            return f"the ranks' step records could not be read ({error})"
        return f"this rank entered step {self.entered}; " + "; ".join(said)
