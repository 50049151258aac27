"""Which layout is fastest? Run each candidate for a few iterations and keep the fastest.

The model-based plan (cost_model.py) can be wrong, so it is only one candidate. The others are the
layouts a user could pick by hand, over the same gradient-ready order (DDP's rebuild): the one in
force (the user's caps), DDP's default (a 1 MiB first bucket, then 25 MiB), and caps of 1 and 5 MiB;
each layout counted once. The loop, driven from the reducer at every grad-enabled forward:

    running = every candidate                      # the screen (skipped for two or fewer)
    for round in range(SCREENING_ITERATIONS):
        for candidate in running:                  # install it between two iterations
            run one iteration, time it on every rank
    running = the FINALISTS whose fastest iterations were fastest  # agreed by every rank (below)
    the same for FINAL_ITERATIONS rounds, timed afresh
    winner = the finalist with the lowest median   # agreed by every rank

Agreement: each iteration counts as its slowest rank's (one all-reduce MAX of the times: a step is
its slowest rank's); rank 0 ranks the candidates and broadcasts the ranking.

Why two phases: one candidate whose layout is clearly wrong shows in two iterations, but the close
ones differ by a few percent, less than one iteration's noise. The finalists therefore get more
iterations, all measured later in the run (the first iterations of a process run slower while its
caches and allocator warm up) and taking turns, so that a slow spell of the machine or the link
(another job, a data-loader stall) falls on both. The screen ranks by each candidate's fastest
iteration: a disturbance only ever slows an iteration down, so one disturbed iteration (the
warm-up falls on the first candidate's first) cannot knock a candidate out.

An iteration's time is from one grad-enabled forward that follows a synchronized backward to the
next one: forward, backward, the reductions and the optimizer (and any no_sync micro-steps between).
Cost: at most ``MAX_CANDIDATES`` (5) x ``SCREENING_ITERATIONS`` (2) + ``FINALISTS`` (2) x
``FINAL_ITERATIONS`` (4) = 18 iterations after the tuner's calibration; 8 for two candidates, none
for a single one.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from overlapddp.clock import HostClock, Stamp
from overlapddp.layout.plan import MIB, BucketCaps, BucketPlan, rebuilt_plan
from overlapddp.module_sync import broadcast_from

SCREENING_ITERATIONS = 2  # enough to drop a layout that is clearly slower
FINALISTS = 2
FINAL_ITERATIONS = 4  # the median of 4 ignores one disturbed iteration on either side
# (first bucket, later buckets) in MiB over the ready order: DDP's default, then caps of 1 and 5 MiB.
FIXED_CAPS_MB = ((1, 25), (1, 1), (5, 5))
MAX_CANDIDATES = len(FIXED_CAPS_MB) + 2  # with the model's plan and the layout in force
MAX_SELECTION_ITERATIONS = MAX_CANDIDATES * SCREENING_ITERATIONS + FINALISTS * FINAL_ITERATIONS


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


Summary = Callable[[Sequence[float]], float]  # a candidate's iteration times to one figure


def ranking(seconds: Sequence[Sequence[float]], summary: Summary = statistics.median) -> list[int]:
    """Candidate indices from the lowest ``summary`` of their iteration times up (the earlier of
    equals first)."""
    figures = [summary(times) for times in seconds]
    return sorted(range(len(figures)), key=lambda c: (figures[c], c))


def agree_on_ranking(
    local: Sequence[Sequence[float]],
    process_group: dist.ProcessGroup,
    device: torch.device,
    summary: Summary = statistics.median,
) -> list[int]:
    """Every rank's times in, one ranking out, the same on every rank (collectives).

    Each iteration counts as its slowest rank's time; rank 0 ranks and broadcasts its ranking."""
    times = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=process_group)
    order = torch.zeros(len(local), dtype=torch.int64, device=device)
    if dist.get_rank(process_group) == 0:
        order[:] = torch.tensor(ranking(times.tolist(), summary))
    broadcast_from(order, 0, process_group)
    return order.tolist()


class PlanSelection:
    """The loop above, one step per grad-enabled forward: which layout runs, and which one won.

    Read-only for callers: ``running`` (the candidate indices taking turns in this phase),
    ``iterations`` (each one's, in this phase), ``final_phase`` and ``winner`` (None until the end).
    """

    def __init__(
        self,
        candidates: Sequence[BucketPlan],
        clock: HostClock,
        screening: int = SCREENING_ITERATIONS,
        final: int = FINAL_ITERATIONS,
    ) -> None:
        if not candidates or screening < 1 or final < 1:
            raise ValueError(
                f"A selection needs candidates and iterations; got {len(candidates)} candidates, "
                f"{screening} screening and {final} final iterations."
            )
        self.candidates = list(candidates)
        self._clock = clock
        self._final_iterations = final
        self.winner: BucketPlan | None = None  # set by the final agreement
        everyone = list(range(len(self.candidates)))
        if len(everyone) > FINALISTS:
            self._begin_phase(everyone, screening, final_phase=False)
        else:
            self._begin_phase(everyone, final, final_phase=True)

    def _begin_phase(self, running: list[int], iterations: int, final_phase: bool) -> None:
        self.running = running  # the candidate indices taking turns in this phase
        self.iterations = iterations  # per running candidate
        self.final_phase = final_phase
        # Per running candidate: the (start, end) stamps of each of its timed iterations.
        self._timed: list[list[tuple[Stamp, Stamp]]] = [[] for _ in running]
        self._count = 0  # iterations timed in this phase, all candidates together
        self._started: Stamp | None = None  # the forward that began the iteration being timed

    @property
    def candidate(self) -> int:
        """The index (into ``candidates``) of the candidate running now (they take turns)."""
        return self.running[self._count % len(self.running)]

    @property
    def measured(self) -> bool:
        """Every running candidate ran this phase's iterations: the next step is :meth:`agree`."""
        return self._count == len(self.running) * self.iterations

    def forward(self, iteration_ended: bool) -> BucketPlan | None:
        """A grad-enabled forward is about to run; ``iteration_ended``: a synchronized backward ran
        since the last one. Returns the layout to switch to before it, or None to keep the current
        one; call :meth:`started` once that layout is installed."""
        if self._started is None or not iteration_ended:
            return None
        self._timed[self._count % len(self.running)].append((self._started, self._clock.now()))
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
        """This rank's time of each timed iteration of this phase, per running candidate (blocks on
        CUDA until they ran)."""
        return [[self._clock.seconds(start, [end])[0] for start, end in timed] for timed in self._timed]

    def agree(self, process_group: dist.ProcessGroup, device: torch.device) -> BucketPlan:
        """End the phase, the same on every rank (collectives; every rank calls). After the screen:
        the finalists run next, and the first of them is returned to install. After the final
        phase: the winner, also kept in :attr:`winner`."""
        if not self.measured:
            raise RuntimeError(
                f"The selection can only agree once every candidate ran {self.iterations} iterations; "
                f"{self._count} of {len(self.running) * self.iterations} are timed."
            )
        summary = statistics.median if self.final_phase else min
        order = agree_on_ranking(self.local_seconds(), process_group, device, summary)
        ranked = [self.running[i] for i in order]
        if self.final_phase:
            self.winner = self.candidates[ranked[0]]
            return self.winner
        self._begin_phase(ranked[:FINALISTS], self._final_iterations, final_phase=True)
        return self.candidates[self.candidate]
