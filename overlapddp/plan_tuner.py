"""Measure, then agree: the stateful half of ``bucket_plan="tuned"`` (the planning is tuned_plan.py).

After DDP's own rebuild, the reducer reports a few synchronized iterations here: when each gradient
was marked ready, when each bucket launched and completed, and how long the work after each
reduction took (writing ``param.grad``; with an overlapped optimizer, its update). Then, at a
forward that every rank reaches at the same iteration count, the ranks share their ready times (a
gradient counts as ready when the slowest rank had it), rank 0 plans from them and its own link and
work measurements, and broadcasts the layout, so all ranks adopt the same buckets. A rank that joined (uneven inputs)
counts the iterations it shadows, so the broadcast is issued by every rank at the same point.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import BucketPlan, explicit_plan
from overlapddp.tuned_plan import BucketTiming, fit_finalize, fit_link, tuned_plan

CALIBRATION_ITERATIONS = 2  # measured synchronized iterations after DDP's rebuild


class PlanTuner:
    """Collects calibration timings on this rank and agrees on the tuned plan from rank 0."""

    def __init__(self, params: Sequence[torch.Tensor], iterations: int = CALIBRATION_ITERATIONS) -> None:
        self._params = list(params)
        self._iterations = iterations
        self.done = False  # the tuned plan is installed (or was restored from a checkpoint)
        self._seen = 0  # synchronized iterations after the rebuild, shadowed ones included
        self._ready: list[list[float]] = []  # per measured iteration: each gradient's time from the first
        self._buckets: list[list[BucketTiming]] = []
        # The iteration being measured: ready times; per bucket (bytes, gradients, launch time,
        # completion box, seconds the launch took on backward's thread); per bucket in the same
        # order, seconds of work after its reduction.
        self._current_ready: list[float] | None = None
        self._current_buckets: list[tuple[int, int, float, list[float], float]] = []
        self._current_finalize: list[float] = []

    @property
    def due(self) -> bool:
        """Every rank has seen enough iterations: the next forward agrees on the plan."""
        return not self.done and self._seen >= self._iterations

    def start_iteration(self) -> None:
        """A synchronized backward follows; measure it unless tuning is over."""
        if not self.done:
            self._current_ready = [math.nan] * len(self._params)
            self._current_buckets = []
            self._current_finalize = []

    def gradient_ready(self, index: int) -> None:
        if self._current_ready is not None:
            self._current_ready[index] = time.perf_counter()

    @property
    def measuring(self) -> bool:
        """An iteration is being measured (the reducer times its launches and finalize work)."""
        return self._current_ready is not None

    def bucket_launched(self, nbytes: int, tensors: int, started: float, future: torch.futures.Future) -> None:
        """Note a launch of ``tensors`` gradients that began at ``started`` and returned ``future``;
        the completion time is written by the future's callback (called only while measuring)."""
        finished: list[float] = []
        now = time.perf_counter()
        self._current_buckets.append((nbytes, tensors, now, finished, now - started))
        future.add_done_callback(lambda _: finished.append(time.perf_counter()))

    def bucket_finalized(self, seconds: float) -> None:
        """The next launched bucket's work after its reduction took ``seconds`` (called only while
        measuring)."""
        self._current_finalize.append(seconds)

    def end_iteration(self) -> None:
        """Every bucket was completed (finalize); keep this iteration's timings."""
        if self._current_ready is None:
            return
        now = time.perf_counter()  # a completion callback may run just after the waiter woke
        first = min((t for t in self._current_ready if not math.isnan(t)), default=now)
        self._ready.append([t - first for t in self._current_ready])
        finalize = self._current_finalize + [0.0] * (len(self._current_buckets) - len(self._current_finalize))
        self._buckets.append([
            BucketTiming(n, launched, min(done, default=now), host_s, tensors, work)
            for (n, tensors, launched, done, host_s), work in zip(self._current_buckets, finalize)
        ])
        self._current_ready = None
        self._seen += 1

    def shadow_iteration(self) -> None:
        """A joined rank shadowed one synchronized iteration: count it, measure nothing."""
        if not self.done:
            self._seen += 1

    def discard_iteration(self) -> None:
        """The iteration failed: forget its partial timings."""
        self._current_ready = None

    def agree(self, process_group: dist.ProcessGroup, device: torch.device) -> BucketPlan | None:
        """Rank 0 plans from every rank's ready times, every rank adopts its layout (collectives).
        None: keep the current plan (rank 0 measured nothing usable, e.g. it had joined).

        Each gradient counts as ready when the slowest rank had it: a bucket's collective can only
        proceed once every rank has launched it."""
        count = len(self._params)
        ready = torch.tensor(self._median_ready(), dtype=torch.float64, device=device)
        dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=process_group)
        layout = torch.zeros(2, count, dtype=torch.int64, device=device)  # [order; bucket lengths]
        if dist.get_rank(process_group) == 0:
            plan = self._plan(ready.tolist())
            if plan is not None:
                order = [i for members in plan.buckets for i in members]
                layout[0] = torch.tensor(order)
                layout[1, : len(plan.buckets)] = torch.tensor([len(m) for m in plan.buckets])
        dist.broadcast(layout, src=dist.get_global_rank(process_group, 0), group=process_group)
        self.done = True
        self._ready, self._buckets = [], []
        order, lengths = layout[0].tolist(), [n for n in layout[1].tolist() if n > 0]
        if not lengths:
            return None
        buckets, position = [], 0
        for n in lengths:
            buckets.append(tuple(order[position: position + n]))
            position += n
        return explicit_plan(self._params, buckets)

    def _median_ready(self) -> list[float]:
        """Each gradient's median ready time over the measured iterations, from the first gradient
        (zeros if none was measured, e.g. this rank had joined). A gradient never marked in a measured
        iteration (unused there) counts as ready first, as DDP's layout treats unused parameters."""
        if not self._ready:
            return [0.0] * len(self._params)
        return [statistics.median(0.0 if math.isnan(t) else t for t in times) for times in zip(*self._ready)]

    def _plan(self, ready: list[float]) -> BucketPlan | None:
        if not self._ready or not any(self._buckets):
            return None
        return tuned_plan(self._params, ready, fit_link(self._buckets), fit_finalize(self._buckets))
