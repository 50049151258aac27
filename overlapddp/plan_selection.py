"""Which layout is fastest? Run each candidate for a few iterations and keep the fastest.

The model-based plan (tuned_plan.py) can be wrong, so it is only one candidate. The others are the
layouts a user could pick by hand, over the same gradient-ready order (DDP's rebuild): the one in
force (the user's caps), DDP's default (a 1 MiB first bucket, then 25 MiB), and caps of 1 and 5 MiB;
each layout counted once. The loop, driven from the reducer at every grad-enabled forward:

    for round in range(ITERATIONS_PER_CANDIDATE):
        for candidate in candidates:               # install it between two iterations
            run one iteration, time it on every rank
    times = max over ranks of each iteration       # one all-reduce: a step is its slowest rank's
    rank 0 picks the lowest median, broadcasts it  # every rank adopts the same layout

The candidates take turns, so a slow spell of the machine or the link (another job, a data-loader
stall) falls on all of them rather than on one.

An iteration's time is from one grad-enabled forward that follows a synchronized backward to the
next one: forward, backward, the reductions and the optimizer (and any no_sync micro-steps between).
Cost: at most ``MAX_CANDIDATES`` (5) x ``ITERATIONS_PER_CANDIDATE`` (3) = 15 iterations after the
tuner's calibration iterations; fewer where layouts coincide (small models), none for a single one.
"""

from __future__ import annotations

import statistics
from typing import Sequence

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import MIB, BucketCaps, BucketPlan, rebuilt_plan
from overlapddp.clock import HostClock, Stamp

ITERATIONS_PER_CANDIDATE = 3  # the median of 3 ignores one disturbed iteration
# (first bucket, later buckets) in MiB over the ready order: DDP's default, then caps of 1 and 5 MiB.
FIXED_CAPS_MB = ((1, 25), (1, 1), (5, 5))
MAX_CANDIDATES = len(FIXED_CAPS_MB) + 2  # with the model's plan and the layout in force
MAX_SELECTION_ITERATIONS = MAX_CANDIDATES * ITERATIONS_PER_CANDIDATE


def candidate_layouts(
    model_plan: BucketPlan | None,
    in_force: BucketPlan,
    params: Sequence[torch.Tensor],
    sparse_gradient: Sequence[bool],
    ready_order: Sequence[int],
) -> list[BucketPlan]:
    """The model's plan (if any), the layout in force and DDP's fixed layouts over ``ready_order``,
    each membership once, in that order (the same list on every rank: the inputs are shared)."""
    fixed = [
        rebuilt_plan(params, sparse_gradient, BucketCaps(int(first * MIB), int(rest * MIB)), ready_order)
        for first, rest in FIXED_CAPS_MB
    ]
    layouts: list[BucketPlan] = []
    for plan in ([model_plan] if model_plan is not None else []) + [in_force] + fixed:
        if all(plan.buckets != kept.buckets for kept in layouts):
            layouts.append(plan)
    return layouts


def fastest(seconds: Sequence[Sequence[float]]) -> int:
    """The candidate whose median iteration time is lowest (the earliest of equals)."""
    medians = [statistics.median(times) for times in seconds]
    return min(range(len(medians)), key=lambda c: (medians[c], c))


def agree_on_fastest(local: Sequence[Sequence[float]], process_group: dist.ProcessGroup, device: torch.device) -> int:
    """Every rank's times in, one candidate index out, the same on every rank (collectives).

    Each iteration counts as its slowest rank's time; rank 0 picks and broadcasts its pick."""
    times = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=process_group)
    choice = torch.zeros(1, dtype=torch.int64, device=device)
    if dist.get_rank(process_group) == 0:
        choice[0] = fastest(times.tolist())
    dist.broadcast(choice, src=dist.get_global_rank(process_group, 0), group=process_group)
    return int(choice.item())


class PlanSelection:
    """The loop above, one step per grad-enabled forward: which layout runs, and which one won."""

    def __init__(
        self, candidates: Sequence[BucketPlan], clock: HostClock, iterations: int = ITERATIONS_PER_CANDIDATE
    ) -> None:
        if not candidates or iterations < 1:
            raise ValueError(f"A selection needs candidates and iterations; got {len(candidates)} and {iterations}.")
        self.candidates = list(candidates)
        self._clock = clock
        self._iterations = iterations
        # Per candidate: the (start, end) stamps of each of its timed iterations, read at the end.
        self._timed: list[list[tuple[Stamp, Stamp]]] = [[] for _ in self.candidates]
        self._count = 0  # iterations timed so far, all candidates together
        self._started: Stamp | None = None  # the forward that began the iteration being timed

    @property
    def candidate(self) -> int:
        """The index of the candidate running now (they take turns)."""
        return self._count % len(self.candidates)

    @property
    def measured(self) -> bool:
        """Every candidate ran its iterations: the next step is :meth:`agree`."""
        return self._count == len(self.candidates) * self._iterations

    def forward(self, iteration_ended: bool) -> BucketPlan | None:
        """A grad-enabled forward is about to run; ``iteration_ended``: a synchronized backward ran
        since the last one. Returns the layout to switch to before it, or None to keep the current
        one; call :meth:`started` once that layout is installed."""
        if self._started is None or not iteration_ended:
            return None
        self._timed[self.candidate].append((self._started, self._clock.now()))
        self._count += 1
        self._started = None
        return None if self.measured else self.candidates[self.candidate]

    def started(self) -> None:
        """Called after every :meth:`forward`: a timed iteration begins here unless one is running
        (a no_sync micro-step's forward is part of it); a layout switch is not included."""
        if self._started is None:
            self._started = self._clock.now()

    def interrupted(self) -> None:
        """The iteration failed: its time is not counted (the next one starts at the next forward)."""
        self._started = None

    def local_seconds(self) -> list[list[float]]:
        """This rank's time of each timed iteration, per candidate (blocks on CUDA until they ran)."""
        return [[self._clock.seconds(start, [end])[0] for start, end in timed] for timed in self._timed]

    def agree(self, process_group: dist.ProcessGroup, device: torch.device) -> BucketPlan:
        """The fastest candidate, the same on every rank (collectives; every rank calls)."""
        if not self.measured:
            raise RuntimeError(
                f"The selection can only agree once every candidate ran {self._iterations} iterations; "
                f"{self._count} of {len(self.candidates) * self._iterations} are timed."
            )
        return self.candidates[agree_on_fastest(self.local_seconds(), process_group, device)]
