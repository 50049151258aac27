"""A bucket layout sized from a measured backward and a measured link (``bucket_plan="tuned"``).

DDP closes buckets by byte caps, so its last bucket (the first layers' gradients) is often large and
can only start when backward ends; its reduction is then exposed. Here the layout is chosen to make
the last reduction finish as early as possible, given

- when each gradient became ready (median over calibration iterations, relative to the first), and
- the link: a bucket of ``n`` bytes occupies it ``alpha + n / bytes_per_s`` seconds, one bucket at
  a time (from the calibration iterations' launch and completion times, see :func:`fit_link`).

Buckets are consecutive runs of the gradients in ready order; bucket ``k`` launches when its last
gradient is ready and starts on the link once bucket ``k-1`` has left it. Dynamic programming over
the run boundaries finds the layout whose last bucket finishes first (ties: the longer last bucket).
A bucket holds at most ``MAX_BUCKET_TENSORS`` gradients, which bounds the planning time on rank 0
(the other ranks wait for it once) to about a second per 4,000 gradients. Pure: no collectives, no
autograd, so every rule is unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from overlapddp.bucket_plan import BucketPlan, explicit_plan

MAX_BUCKET_TENSORS = 256


@dataclass(frozen=True)
class LinkFit:
    """Time a bucket of ``n`` bytes occupies the link: ``alpha_s + n / bytes_per_s``."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class BucketTiming:
    """One reduced bucket of a calibration iteration: its size, launch and completion times, and how
    long starting its collective kept the launching (backward) thread busy."""

    nbytes: int
    launched: float
    finished: float
    host_s: float = 0.0


def fit_link(iterations: Sequence[Sequence[BucketTiming]]) -> LinkFit:
    """The link as the calibration iterations saw it.

    A bucket's service time is its completion minus when it could start: its launch, or the previous
    bucket's completion if the link was still busy. ``alpha_s`` is the shortest time a launch kept
    backward's thread busy (a bucket costs that much even on an idle link, which keeps the plan from
    tiny buckets); the throughput is what remains of the service times over the bytes carried. A
    regression of time on size would also estimate a latency, but with the few, noisy samples of two
    iterations it proved unstable (an overhead of several milliseconds fitted on a link that has
    almost none), so the latency beyond the launch is left to the throughput.
    """
    samples: list[tuple[int, float]] = []
    for buckets in iterations:
        link_free = float("-inf")
        for b in sorted(buckets, key=lambda t: t.launched):
            start = max(b.launched, link_free)
            samples.append((b.nbytes, max(b.finished - start, 0.0)))
            link_free = max(link_free, b.finished)
    if not samples:
        raise ValueError("fit_link needs at least one reduced bucket.")
    alpha = min(b.host_s for buckets in iterations for b in buckets)
    total_bytes = sum(n for n, _ in samples)
    transfer_s = sum(max(t - alpha, 0.0) for _, t in samples)
    return LinkFit(alpha, max(total_bytes, 1) / max(transfer_s, 1e-9))


def tuned_plan(params: Sequence[torch.Tensor], ready_s: Sequence[float], link: LinkFit) -> BucketPlan:
    """The layout whose last bucket finishes earliest under ``link``, gradients ready at ``ready_s``.

    ``ready_s[i]`` is when parameter ``i``'s gradient is ready (seconds, any origin). Each bucket
    holds one dtype on one device, as in DDP.
    """
    if len(ready_s) != len(params):
        raise ValueError(f"tuned_plan needs one ready time per parameter; got {len(ready_s)} for {len(params)}.")
    order = sorted(range(len(params)), key=lambda i: (ready_s[i], i))
    nbytes = [params[i].numel() * params[i].element_size() for i in order]
    kind = [(params[i].dtype, params[i].device) for i in order]
    count = len(order)
    # finish[k]: earliest completion of the first k gradients (in ready order) in whole buckets;
    # start[k]: where the last of those buckets begins. Completion only grows with the previous
    # bucket's completion, so the earliest prefix is always the best one to extend.
    finish = [float("-inf")] + [float("inf")] * count
    start = [0] * (count + 1)
    for end in range(1, count + 1):
        size, ready = 0, float("-inf")
        for first in range(end - 1, max(end - 1 - MAX_BUCKET_TENSORS, -1), -1):
            if kind[first] != kind[end - 1]:
                break
            size += nbytes[first]
            ready = max(ready, ready_s[order[first]])
            done = max(ready, finish[first]) + link.seconds(size)
            if done <= finish[end]:  # '<=': on a tie the longer bucket (found later) wins
                finish[end], start[end] = done, first
    bounds: list[tuple[int, int]] = []
    end = count
    while end > 0:
        bounds.append((start[end], end))
        end = start[end]
    bounds.reverse()
    return explicit_plan(params, [order[a:b] for a, b in bounds])


def predicted_finish(plan: BucketPlan, params: Sequence[torch.Tensor], ready_s: Sequence[float], link: LinkFit) -> float:
    """When the last bucket of ``plan`` would complete under ``link``, launched in index order."""
    link_free = float("-inf")
    launch = float("-inf")
    for members in plan.buckets:
        launch = max(launch, max(ready_s[i] for i in members))
        size = sum(params[i].numel() * params[i].element_size() for i in members)
        link_free = max(launch, link_free) + link.seconds(size)
    return link_free
