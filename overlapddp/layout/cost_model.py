"""A bucket layout sized from a measured backward, a measured link and the measured work after each
reduction (``bucket_plan="tuned"``).

DDP closes buckets by byte caps, so its last bucket (the first layers' gradients) is often large and
can only start when backward ends; its reduction is then exposed, and so is the work that follows it
(copying it into ``param.grad`` and, with an overlapped optimizer, updating its parameters). Here the
layout is chosen to make that work end as early as possible, given

- when each gradient became ready (median over calibration iterations, relative to the first),
- the link: a bucket of ``n`` bytes occupies it ``alpha + n / bytes_per_s`` seconds, one bucket at
  a time (from the calibration iterations' launch and completion times, see :func:`fit_link`), and
- the work after a bucket is reduced: ``per_tensor_s`` per gradient plus ``per_byte_s`` per byte
  (see :func:`fit_finalize`); it runs on one thread, bucket after bucket, from the end of backward.

Buckets are consecutive runs of the gradients in ready order; bucket ``k`` launches when its last
gradient is ready and starts on the link once bucket ``k-1`` has left it. The step's work after
backward then ends at ``max(E + W_0, max_k(finish_k + W_k))``: ``E`` the end of backward, ``finish_k``
bucket ``k``'s completion and ``W_k`` the work of bucket ``k`` and every later one (the work of one
gradient does not depend on its bucket, so ``W_k`` depends only on where bucket ``k`` starts).
Dynamic programming over the run boundaries keeps, per prefix, the layouts not beaten on both
(completion so far, largest ``finish_k + W_k`` so far), and picks the earliest end. A bucket holds at
most ``MAX_BUCKET_TENSORS`` gradients and at most ``FRONT_LIMIT`` layouts are kept per prefix, which
bounds the planning time on rank 0 (the other ranks wait for it once; about 5 s for 4,000 gradients
on a 2-core machine). Pure: no collectives, no autograd, so every rule is unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from overlapddp.layout.plan import BucketPlan, explicit_plan

MAX_BUCKET_TENSORS = 256
# Layouts kept per prefix (see tuned_plan): enough for the optimum on every brute-forced case in the
# tests, and it keeps planning a 4,000-gradient model to a few seconds.
FRONT_LIMIT = 6


@dataclass(frozen=True)
class LinkFit:
    """Time a bucket of ``n`` bytes occupies the link: ``alpha_s + n / bytes_per_s``."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class FinalizeFit:
    """Work after a bucket is reduced (copy-out, an overlapped update): per gradient and per byte."""

    per_tensor_s: float
    per_byte_s: float

    def seconds(self, tensors: int, nbytes: int) -> float:
        return self.per_tensor_s * tensors + self.per_byte_s * nbytes


NO_FINALIZE_WORK = FinalizeFit(0.0, 0.0)


@dataclass(frozen=True)
class BucketTiming:
    """One reduced bucket of a calibration iteration: its size, launch and completion times, how
    long starting its collective kept the launching (backward) thread busy, and how long the work
    after its reduction took (writing ``param.grad``, an overlapped update)."""

    nbytes: int
    launched: float
    finished: float
    host_s: float = 0.0
    tensors: int = 0
    finalize_s: float = 0.0


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


def fit_finalize(iterations: Sequence[Sequence[BucketTiming]]) -> FinalizeFit:
    """Per-gradient and per-byte cost of the work after each reduction, by least squares through
    the origin over the calibration buckets; a coefficient that comes out negative is dropped and
    the other refitted alone (copying costs bytes; a CPU optimizer's update costs mostly calls)."""
    samples = [(b.tensors, b.nbytes, b.finalize_s) for buckets in iterations for b in buckets]
    tt = sum(n * n for n, _, _ in samples)
    bb = sum(float(m) * m for _, m, _ in samples)
    tb = sum(float(n) * m for n, m, _ in samples)
    ty = sum(n * y for n, _, y in samples)
    by = sum(m * y for _, m, y in samples)
    determinant = tt * bb - tb * tb
    if determinant > 1e-9 * tt * bb:
        per_tensor, per_byte = (ty * bb - by * tb) / determinant, (by * tt - ty * tb) / determinant
        if per_tensor >= 0 and per_byte >= 0:
            return FinalizeFit(per_tensor, per_byte)
    alone = [FinalizeFit(max(ty, 0.0) / tt, 0.0) if tt else NO_FINALIZE_WORK,
             FinalizeFit(0.0, max(by, 0.0) / bb) if bb else NO_FINALIZE_WORK]
    return min(alone, key=lambda fit: sum((fit.seconds(n, m) - y) ** 2 for n, m, y in samples))


def tuned_plan(
    params: Sequence[torch.Tensor],
    ready_s: Sequence[float],
    link: LinkFit,
    finalize: FinalizeFit = NO_FINALIZE_WORK,
) -> BucketPlan:
    """The layout whose work after backward ends earliest, gradients ready at ``ready_s``.

    ``ready_s[i]`` is when parameter ``i``'s gradient is ready (seconds, any origin). Without
    ``finalize`` work this is the layout whose last bucket completes first. Each bucket holds one
    dtype on one device, as in DDP.
    """
    if len(ready_s) != len(params):
        raise ValueError(f"tuned_plan needs one ready time per parameter; got {len(ready_s)} for {len(params)}.")
    order = sorted(range(len(params)), key=lambda i: (ready_s[i], i))
    nbytes = [params[i].numel() * params[i].element_size() for i in order]
    kind = [(params[i].dtype, params[i].device) for i in order]
    count = len(order)
    work_from = [0.0] * (count + 1)  # W: the finalize work of gradients k.. in ready order
    for k in range(count - 1, -1, -1):
        work_from[k] = work_from[k + 1] + finalize.seconds(1, nbytes[k])
    # fronts[k]: layouts of the first k gradients as (completion, largest finish_j + W_j, first
    # gradient of the last bucket, index of the predecessor in fronts[first]), none beaten on both.
    fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 0)]]
    for end in range(1, count + 1):
        candidates = []
        size, ready = 0, float("-inf")
        for first in range(end - 1, max(end - 1 - MAX_BUCKET_TENSORS, -1), -1):
            if kind[first] != kind[end - 1]:
                break
            size += nbytes[first]
            ready = max(ready, ready_s[order[first]])
            seconds = link.seconds(size)
            for position, (finish, worst, _, _) in enumerate(fronts[first]):
                done = max(ready, finish) + seconds
                candidates.append((done, max(worst, done + work_from[first]), first, position))
        fronts.append(_pareto(candidates))
    backward_end = max(ready_s, default=0.0)
    best = min(fronts[count], key=lambda point: max(backward_end + work_from[0], point[1]))
    bounds: list[tuple[int, int]] = []
    end, point = count, best
    while end > 0:
        first, position = point[2], point[3]
        bounds.append((first, end))
        end, point = first, fronts[first][position]
    bounds.reverse()
    return explicit_plan(params, [order[a:b] for a, b in bounds])


def _pareto(candidates: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The candidates no other one beats on both completion and worst end, earliest completion first;
    at most ``FRONT_LIMIT`` of them, spread evenly from the earliest completion to the lowest worst end.

    Among equal candidates the longest last bucket is kept (fewer buckets for the same times)."""
    front: list[tuple[float, float, int, int]] = []
    for candidate in sorted(candidates, key=lambda c: (c[0], c[1], c[2])):
        if not front or candidate[1] < front[-1][1]:
            front.append(candidate)
    if len(front) <= FRONT_LIMIT:
        return front
    last = len(front) - 1
    return [front[round(k * last / (FRONT_LIMIT - 1))] for k in range(FRONT_LIMIT)]


def predicted_end(
    plan: BucketPlan,
    params: Sequence[torch.Tensor],
    ready_s: Sequence[float],
    link: LinkFit,
    finalize: FinalizeFit = NO_FINALIZE_WORK,
) -> float:
    """When the work after backward would end under ``plan``: buckets launched in index order, each
    bucket's finalize work after its completion, the end of backward and the previous bucket's work.
    Without finalize work, the last bucket's completion."""
    link_free = launch = float("-inf")
    work_end = max(ready_s, default=0.0)
    for members in plan.buckets:
        launch = max(launch, max(ready_s[i] for i in members))
        sizes = [params[i].numel() * params[i].element_size() for i in members]
        link_free = max(launch, link_free) + link.seconds(sum(sizes))
        work_end = max(work_end, link_free) + sum(finalize.seconds(1, n) for n in sizes)
    return work_end
