"""A slow link for torchft's process group: every all-reduce completes no earlier than ``delay_s`` after it
was issued, as if each collective crossed a link with that fixed latency.

The delays of collectives in flight run concurrently (a timer thread completes each one), so a
wrapper that launches its buckets and waits at the end pays about one delay per step, and one that
waits for each bucket before backward goes on pays one per bucket. The arithmetic is the real
gloo all-reduce's: results stay bit-equal to the undelayed group.

Example::

    >>> pg = SlowProcessGroupGloo(delay_s=0.02, timeout=timedelta(seconds=10))
    >>> manager = torchft.Manager(pg=pg, ...)
    >>> pg.events  # (tag, time): ("launch", t), ("done", t) per all-reduce, for ordering checks
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torchft import ProcessGroupGloo


class SlowProcessGroupGloo(ProcessGroupGloo):
    """torchft's gloo group with each all-reduce's completion held back to ``delay_s`` after its launch."""

    def __init__(self, delay_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s
        self.events: list[tuple[str, float]] = []  # appended from the caller's and the timers' threads
        self._lock = threading.Lock()

    def _note(self, tag: str) -> float:
        now = time.perf_counter()
        with self._lock:
            self.events.append((tag, now))
        return now

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        launched = self._note("launch")
        work = super().allreduce(tensors, opts)
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

        def complete() -> None:
            try:
                work.wait()
            except Exception as error:  # the collective's own failure, passed on unchanged
                future.set_exception(error)
                return
            self._note("done")
            future.set_result(tensors)

        threading.Timer(max(0.0, launched + self.delay_s - time.perf_counter()), complete).start()
        return torch._C._distributed_c10d._create_work_from_future(future)
