"""Measure, model, then select: the stateful half of ``bucket_plan="tuned"`` (the planning is
cost_model.py, the selection selection.py).

After DDP's own rebuild, the fence stamps a few synchronized iterations for it (calibration): when
each gradient was marked ready, when each bucket launched and completed, and how long the work after
each reduction took (writing ``param.grad``; with an overlapped optimizer, its update), stamped by
the device's clock (clock.py: CUDA events on GPUs). Then, at a forward that every rank reaches at the
same iteration count, the ranks share their ready times (a gradient counts as ready when the slowest
rank had it), rank 0 plans from them and its own link and work measurements, and broadcasts the
layout. That plan is one candidate of a selection that runs each candidate layout for a few real
iterations and keeps the fastest (selection.py), agreed by every rank. A rank that joined
(uneven inputs) counts the iterations it shadows, so every collective is issued by every rank at the
same point.

Drift: the chosen layout stays for the rest of the run (see docs/beyond_ddp_tuned.md for why).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist

from overlapddp.clock import BucketStamps, Stamp, clock_for
from overlapddp.layout.cost_model import BucketTiming, fit_finalize, fit_link, tuned_plan
from overlapddp.layout.plan import BucketPlan, explicit_plan
from overlapddp.layout.selection import MAX_SELECTION_ITERATIONS, PlanSelection, candidate_layouts
from overlapddp.module_sync import broadcast_from

CALIBRATION_ITERATIONS = 2  # measured synchronized iterations after DDP's rebuild
# Synchronized iterations after DDP's rebuild until the layout is final, at the latest.
TUNING_ITERATIONS = CALIBRATION_ITERATIONS + MAX_SELECTION_ITERATIONS


class PlanTuner:
    """Collects calibration timings on this rank, agrees on the model's plan from rank 0, then on the
    fastest candidate layout."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        sparse_gradient: Sequence[bool],
        iterations: int = CALIBRATION_ITERATIONS,
    ) -> None:
        self._params = list(params)
        self._sparse_gradient = list(sparse_gradient)
        self._iterations = iterations
        self._clock = clock_for(self._params[0].device)
        self.done = False  # the chosen layout is installed (or was restored from a checkpoint)
        self._seen = 0  # synchronized iterations after the rebuild, shadowed ones included
        self._ended = False  # a synchronized iteration ended (or was shadowed) since the last forward
        self._selection: PlanSelection | None = None  # running once calibration is over
        self._ready: list[list[float]] = []  # per measured iteration: each gradient's time from the first
        self._buckets: list[list[BucketTiming]] = []
        # The iteration being measured: the stamps the fence takes for it (read at its end), and the
        # layout it runs (how many gradients each launched bucket holds).
        self._stamps: BucketStamps | None = None
        self._measured_plan: BucketPlan | None = None

    @property
    def measuring(self) -> bool:
        """A calibration iteration is being measured (the fence stamps its gradients and buckets)."""
        return self._stamps is not None

    def start_iteration(self, in_force: BucketPlan) -> BucketStamps | None:
        """A synchronized backward of ``in_force`` follows; while calibrating, the stamps the fence is
        to take for it (else None)."""
        if not self.done and self._selection is None and self._seen < self._iterations:
            self._stamps, self._measured_plan = BucketStamps(self._clock, len(self._params)), in_force
        return self._stamps

    def end_iteration(self) -> None:
        """Every bucket was completed (finalize); keep this iteration's timings if measured."""
        self._ended = True
        stamps, plan = self._stamps, self._measured_plan
        if stamps is None or plan is None:
            return

        def read(taken: list[Stamp]) -> list[float]:
            return self._clock.seconds(stamps.origin, taken)

        launches = stamps.launches
        marked = [i for i, stamp in enumerate(stamps.ready) if stamp is not None]
        ready = [math.nan] * len(self._params)
        for i, seconds in zip(marked, read([cast(Stamp, stamps.ready[i]) for i in marked]), strict=True):
            ready[i] = seconds
        launched, finished = read([b.launched for b in launches]), read([b.done for b in launches])
        worked = [b.bucket for b in launches if b.bucket in stamps.consumed and b.bucket in stamps.completed]
        spans = dict(zip(worked, zip(read([stamps.completed[b] for b in worked]),
                                     read([stamps.consumed[b] for b in worked]), strict=True), strict=True))
        work = [spans[b.bucket][1] - spans[b.bucket][0] if b.bucket in spans else 0.0 for b in launches]
        first = min((t for t in ready if not math.isnan(t)), default=0.0)
        self._ready.append([t - first for t in ready])
        self._buckets.append([
            BucketTiming(b.nbytes, start, max(done, start), b.host_seconds, len(plan.buckets[b.bucket]), seconds)
            for b, start, done, seconds in zip(launches, launched, finished, work, strict=False)
        ])
        self._stamps = self._measured_plan = None
        self._seen += 1

    def shadow_iteration(self) -> None:
        """A joined rank shadowed one synchronized iteration: count it, measure nothing."""
        self._ended = True
        if not self.done:
            self._seen += 1

    def restored(self) -> None:
        """A checkpoint's layout is in force: nothing is measured or selected any more."""
        self.done, self._selection, self._stamps = True, None, None

    def discard_iteration(self) -> None:
        """The iteration failed: forget its partial timings."""
        self._stamps = None
        if self._selection is not None:
            self._selection.interrupted()

    def between_iterations(
        self,
        process_group: dist.ProcessGroup,
        device: torch.device,
        ready_order: Sequence[int],
        in_force: BucketPlan,
        adopt: Callable[[BucketPlan], None],
    ) -> None:
        """At every grad-enabled forward (every rank): once calibrated, start the selection among
        the model's plan and the fixed layouts over ``ready_order``; during it, time iterations and
        switch layouts (agreeing on the finalists after the screen); at its end, ``adopt`` the
        fastest. Collectives at the same forward on every rank: the counts they depend on are shared."""
        if self.done:
            return
        ended, self._ended = self._ended, False
        if self._selection is None:
            if self._seen < self._iterations:
                return
            model = self.agree(process_group, device)
            layouts = candidate_layouts(model, in_force, self._params, self._sparse_gradient, ready_order)
            self._selection = PlanSelection(layouts, self._clock)
            if len(layouts) == 1:
                self._finish(layouts[0], adopt)
                return
            adopt(layouts[0])
        else:
            next_plan = self._selection.forward(ended)
            if self._selection.measured:  # a phase ended: the finalists' first, or the winner
                next_plan = self._selection.agree(process_group, device)
                if self._selection.winner is not None:
                    self._finish(next_plan, adopt)
                    return
            if next_plan is not None:
                adopt(next_plan)
        self._selection.started()

    def _finish(self, plan: BucketPlan, adopt: Callable[[BucketPlan], None]) -> None:
        adopt(plan)
        self.done, self._selection = True, None

    def agree(self, process_group: dist.ProcessGroup, device: torch.device) -> BucketPlan | None:
        """Rank 0 plans from every rank's ready times, every rank adopts its layout (collectives).
        None: rank 0 measured nothing usable (e.g. it had joined); the model offers no candidate.

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
        broadcast_from(layout, 0, process_group)
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
        per_gradient = zip(*self._ready, strict=False)
        return [statistics.median(0.0 if math.isnan(t) else t for t in times) for times in per_gradient]

    def _plan(self, ready: list[float]) -> BucketPlan | None:
        if not self._ready or not any(self._buckets):
            return None
        return tuned_plan(self._params, ready, fit_link(self._buckets), fit_finalize(self._buckets))
