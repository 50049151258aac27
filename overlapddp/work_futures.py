"""How does a collective without a future get one? gloo's reduce-scatter ``Work`` has no ``get_future()``.

The fence orders every bucket through a future, so a work without one is waited on by one helper
thread, in launch order, which then completes the future (or fails it with the work's error).
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist


class WorkFutures:
    """Futures for works that lack them; one daemon thread per instance waits on them in order."""

    def __init__(self) -> None:
        # Works launched and not yet waited: put by ``future_of`` (the autograd hook thread), taken
        # by the waiter thread, which completes each future.
        self._pending: queue.SimpleQueue[tuple[dist.Work, torch.Tensor, torch.futures.Future]] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None

    def future_of(self, work: dist.Work, output: torch.Tensor) -> torch.futures.Future:
        """The work's own future, or one completed with ``[output]`` (the tensor the work writes) when the
        work is done."""
        try:
            return work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce-scatter)
            pass
        future: torch.futures.Future = torch.futures.Future()
        self._pending.put((work, output, future))
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_in_order, name="overlapddp-work-waiter", daemon=True)
            self._waiter.start()
        return future

    def _wait_in_order(self) -> None:
        while True:
            work, output, future = self._pending.get()
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)
            else:
                future.set_result([output])
