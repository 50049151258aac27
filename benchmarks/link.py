"""An emulated slow link for benchmarks: the stock all-reduce hook, delivered no earlier than a
serialized link of a given bandwidth would deliver it.

The model, per process (each rank keeps its own link):

- The link carries one bucket at a time. A bucket occupies it from ``start = max(launch,
  free_at)`` (launch: when the hook is called; ``free_at``: when the previous bucket left the
  link) for ``2 * (ws - 1) / ws * nbytes * 8 / (gbps * 1e9)`` seconds: the bytes a ring
  all-reduce sends per rank over ``ws`` ranks, at ``gbps`` gigabits per second.
- The bucket's future completes at ``max(deliver_at, when the real all-reduce finished)``, with
  ``deliver_at = start + duration``; a timer thread sets the result, so neither the caller nor the
  collective's worker thread sleeps. ``free_at`` becomes ``deliver_at``.

Latency, congestion and the other ranks' links are not modelled; the arithmetic is exactly
``allreduce_hook``'s (divide by the world size, SUM all-reduce), so a model using this hook stays
bit-equal to one using ``allreduce_hook``.

Example::

    >>> ddp.register_comm_hook(LinkState(gbps=1.0), link_allreduce_hook)
    >>> overlap_ddp.register_comm_hook(LinkState(gbps=1.0), link_allreduce_hook)  # its own link

Note: OverlapDDP runs a hook that is not one of torch's single-collective stock hooks one bucket
at a time (bucket b's hook is called once bucket b-1's future is done; see ``overlapddp/bucket/comm_hook.py``,
[Note: one hook chain at a time]), and stock DDP does not. With this hook that wait is where the
link delay shows up in OverlapDDP's backward.
"""

# No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the
# objects ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` and rejects strings.

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def ring_allreduce_seconds(nbytes: int, world_size: int, gbps: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` keeps one rank's link busy at ``gbps`` Gbit/s."""
    return 2 * (world_size - 1) / world_size * nbytes * 8 / (gbps * 1e9)


@dataclass
class LinkState:
    """One process's emulated link (the hook's ``state``); give every wrapped model its own.

    ``free_at`` is a ``time.perf_counter()`` time, written by the hook when a bucket is launched
    (under ``_lock``: the hook runs on autograd's thread, possibly more than one).
    """

    gbps: float
    process_group: dist.ProcessGroup | None = None  # None: the default group
    free_at: float = 0.0
    busy_s: float = 0.0  # total seconds the link was occupied, for reports
    sent_bytes: int = 0  # total bucket bytes carried
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"LinkState: gbps must be positive, got {self.gbps!r}.")

    def occupy(self, nbytes: int, world_size: int, now: float) -> float:
        """Queue a bucket launched at ``now`` on the link; returns when the link delivers it."""
        duration = ring_allreduce_seconds(nbytes, world_size, self.gbps)
        with self._lock:
            start = max(now, self.free_at)
            self.free_at = start + duration
            self.busy_s += duration
            self.sent_bytes += nbytes
            return self.free_at


def link_allreduce_hook(state: LinkState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``allreduce_hook`` whose future completes no earlier than ``state``'s link delivers the bucket."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())  # before the sum, as allreduce_hook does
    reduced = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    deliver_at = state.occupy(tensor.numel() * tensor.element_size(), group.size(), time.perf_counter())
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[tensor.device] if tensor.is_cuda else None
    )

    def deliver(done: torch.futures.Future) -> None:
        # Runs on whichever thread finished the collective; never sleeps there.
        try:
            value = done.value()[0]
        except Exception as error:  # the collective failed: the caller sees its error
            result.set_exception(error)
            return
        delay = deliver_at - time.perf_counter()
        if delay <= 0:
            result.set_result(value)
            return
        timer = threading.Timer(delay, result.set_result, args=(value,))
        timer.daemon = True
        timer.start()

    reduced.add_done_callback(deliver)
    return result


# One all-reduce, issued by the call itself: OverlapDDP need not wait for the previous bucket's
# hook before starting this one (see overlapddp.bucket.comm_hook.is_unchained); stock DDP ignores this.
link_allreduce_hook.issues_one_collective = True
