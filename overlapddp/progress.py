"""Where each rank is, so that a rank whose collective never completes can say which ranks are behind.

Each rank keeps one record in the process group's store, rewritten twice per synchronized iteration
(after its forward, after its reduction): its iteration (synchronized forwards so far), the backwards
it has reduced, and the forwards that ran without a backward. A bucket whose collective is not done
when this rank starts waiting for it adds that (one more write). When the collective then fails (the
process group's timeout, a rank that died or left), the error names the ranks behind this one and
where each is. Only the store is touched: no collective is added, no reduced value changes, and no
wait is added (the fence's is the only one). On CUDA devices (NCCL) no record is kept: a host never
waits there, the device does.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from overlapddp.torch_compat import group_store

GRACE_S = 2.0  # after a failed wait, how long a rank at the same position may take to report the same failure

_wrappers = itertools.count()  # one key space per wrapper, in construction order (the same on every rank)


@dataclass(frozen=True)
class Position:
    """One rank's record."""

    iteration: int  # synchronized forwards run
    reductions: int  # backwards reduced
    dropped: int  # forwards followed by another forward instead of a backward (GAN steps have some)
    last_dropped: int | None  # the iteration of the last of them
    waiting: tuple[int, int] | None  # (backward, bucket) this rank waits for

    def describe(self, mine: Position) -> str:
        if self.waiting is not None:
            where = f"waiting for bucket {self.waiting[1]} of backward {self.waiting[0]}"
        elif self.reductions < self.iteration:
            where = "forward ran, its backward not reduced, not waiting on a bucket"
        else:
            where = "reduced, the next synchronized forward not reached"
        said = f"iteration {self.iteration} ({where}; {self.reductions} backwards reduced)"
        if self.dropped > mine.dropped:
            said += (
                f"; it ran {self.dropped - mine.dropped} more forward(s) without a backward than this rank, the "
                f"last at iteration {self.last_dropped}: a skipped backward makes each later backward of it pair "
                "with the other ranks' previous one"
            )
        return said


class ProgressRecord:
    """This rank's record in the store, and the others' when a wait goes wrong (disabled without a group)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, parameters: int = 0,
                 device: torch.device | None = None) -> None:
        on_host = device is None or device.type == "cpu"
        self._store: Any | None = None
        self._rank, self._size = 0, 1
        if process_group is not None and on_host:
            self._store = group_store(process_group)
            self._rank, self._size = dist.get_rank(process_group), process_group.size()
        self._prefix = f"overlapddp/progress/{next(_wrappers)}-{parameters}/"
        self._mine = Position(0, 0, 0, None, None)

    def forward(self, iteration: int, reductions: int, dropped: bool) -> None:
        """A synchronized forward ran; ``dropped``: the previous one's backward never came."""
        mine = self._mine
        if dropped:
            self._write(Position(iteration, reductions, mine.dropped + 1, iteration - 1, None))
        else:
            self._write(Position(iteration, reductions, mine.dropped, mine.last_dropped, None))

    def reduced(self, iteration: int, reductions: int) -> None:
        self._write(Position(iteration, reductions, self._mine.dropped, self._mine.last_dropped, None))

    def wait_for(self, bucket: int, future: Any) -> None:
        """The fence is about to wait for ``bucket``: if its collective is not done, say so in the store
        (one write; the fence's own wait does the waiting, so nothing here orders a read)."""
        if self._store is None or future.done():
            return
        mine = self._mine
        waiting = (mine.reductions + 1, bucket)
        self._write(Position(mine.iteration, mine.reductions, mine.dropped, mine.last_dropped, waiting))

    def behind(self, bucket: int, after_reduction: bool = False) -> str:
        """For an error on this rank's wait for ``bucket``: the ranks behind it and where each is.

        ``after_reduction``: the wait belongs to the backward this rank last reduced (a sharded
        optimizer's all-gather of the updated parameters), not to the one in progress. A rank at this
        rank's position that is not waiting may be about to fail the same wait: it gets ``GRACE_S`` to
        say so before it is counted as behind."""
        if self._store is None:
            return ""
        mine = self._mine
        backward = mine.reductions + (0 if after_reduction else 1)
        self._write(Position(mine.iteration, mine.reductions, mine.dropped, mine.last_dropped, (backward, bucket)))
        if self._store is None:  # that write failed: the store went with a rank that died
            return " The ranks' progress records could not be read (the store took no write)."
        deadline = time.monotonic() + GRACE_S
        while True:
            try:
                others = self._others()
            except Exception as error:  # the store went with a rank that died
                return f" The ranks' progress records could not be read ({error})."
            # A rank waiting in the same backward's reduction is at the same collective, unless this
            # wait comes after that reduction.
            late = {
                r: p for r, p in others.items()
                if p is None or (p.reductions < backward and (
                    after_reduction or p.waiting is None or p.waiting[0] != backward))
            }
            here = (mine.iteration, mine.reductions, mine.dropped)
            unsure = [p for p in late.values()
                      if p is not None and p.waiting is None and (p.iteration, p.reductions, p.dropped) == here]
            if not unsure or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        what = "the all-gather of the updated parameters of bucket" if after_reduction else "bucket"
        waited = f"rank {self._rank} waited for {what} {bucket} of backward {backward} (iteration {mine.iteration})"
        if not late:
            return f" Every other rank recorded reaching that backward ({waited})."
        listed = "; ".join(
            f"rank {r}: " + ("no progress record (no synchronized forward of this model)" if p is None else
                             f"at {p.describe(mine)}")
            for r, p in sorted(late.items())
        )
        return (
            f" Ranks behind: {listed} ({waited}). A rank not waiting on a bucket is stuck outside OverlapDDP, "
            "has finished its loop, or died."
        )

    def _write(self, position: Position) -> None:
        self._mine = position
        if self._store is None:
            return
        value = [position.iteration, position.reductions, position.dropped, position.last_dropped, position.waiting]
        try:
            self._store.set(self._prefix + str(self._rank), json.dumps(value))
        except Exception:  # a store that is gone leaves the collectives to report the failure
            self._store = None

    def _others(self) -> dict[int, Position | None]:
        store = self._store
        found: dict[int, Position | None] = {}
        for rank in range(self._size):
            if rank == self._rank or store is None:
                continue
            key = self._prefix + str(rank)
            if not store.check([key]):
                found[rank] = None
                continue
            iteration, reductions, dropped, last_dropped, waiting = json.loads(store.get(key))
            found[rank] = Position(iteration, reductions, dropped, last_dropped, tuple(waiting) if waiting else None)
        return found
