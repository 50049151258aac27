"""The selection loop of ``bucket_plan="tuned"`` alone: candidates, schedule and choice, driven by hand
with a fake clock (no spawned ranks; agreement across ranks is in test_tuned_plan.py)."""

from __future__ import annotations

import pytest
import torch

from overlapddp.clock import HostClock
from overlapddp.layout.plan import MIB, BucketCaps, BucketPlan, explicit_plan, rebuilt_plan
from overlapddp.layout.selection import (
    FINAL_ITERATIONS,
    FINALISTS,
    MAX_CANDIDATES,
    MAX_SELECTION_ITERATIONS,
    SCREENING_ITERATIONS,
    PlanSelection,
    candidate_layouts,
    ranking,
)


class FakeClock(HostClock):
    """Stamps are whatever time the test has set."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time


def _params(count: int, mib: float) -> list[torch.Tensor]:
    return [torch.empty(int(mib * MIB) // 4) for _ in range(count)]


def test_candidates_are_the_model_plan_the_layout_in_force_and_ddps_fixed_caps_each_once():
    params = _params(40, 0.3)  # 12 MiB: caps of 1, 5 and 25 MiB give three different layouts
    order = list(reversed(range(40)))
    sparse = [False] * 40

    def by_caps(cap_mb: float | None) -> BucketPlan:  # as DDP resolves bucket_cap_mb
        return rebuilt_plan(params, sparse, BucketCaps.from_user(cap_mb, None), order)

    model = explicit_plan(params, [order[:3], order[3:]])
    in_force = by_caps(2)
    got = candidate_layouts(model, in_force, params, sparse, order)
    assert [c.buckets for c in got] == [p.buckets for p in (model, in_force, by_caps(None), by_caps(1), by_caps(5))]
    # The same layout twice is run once: here the layout in force is DDP's default, and the model
    # offers nothing (rank 0 measured nothing).
    got = candidate_layouts(None, by_caps(None), params, sparse, order)
    assert [c.buckets for c in got] == [p.buckets for p in (by_caps(None), by_caps(1), by_caps(5))]
    # A model far smaller than 1 MiB: every fixed cap gives one bucket.
    small = _params(5, 0.01)
    got = candidate_layouts(None, rebuilt_plan(small, sparse[:5], BucketCaps.from_user(None, None), range(5)),
                            small, sparse[:5], range(5))
    assert [c.buckets for c in got] == [(tuple(range(5)),)]


def test_a_model_past_25_mib_gets_ddps_default_layout_among_as_many_candidates_as_announced(one_rank):
    params = _params(100, 0.3)  # 30 MiB: DDP's 25 MiB cap closes a bucket inside it
    order = list(reversed(range(100)))
    sparse = [False] * 100
    ddp_default = rebuilt_plan(params, sparse, BucketCaps.from_user(None, None), order)
    assert len(ddp_default.buckets) == 3  # 1 MiB, then 25 MiB, then the rest
    model = explicit_plan(params, [order[:3], order[3:]])
    in_force = rebuilt_plan(params, sparse, BucketCaps.from_user(2, None), order)
    got = candidate_layouts(model, in_force, params, sparse, order)
    assert got[2].buckets == ddp_default.buckets
    assert len(got) == MAX_CANDIDATES  # every candidate differs here: the most there can be
    # The most iterations a selection takes, as the tuner's budget counts them.
    clock = FakeClock()
    selection = PlanSelection(got, clock)
    screen = {c: [1.0 + c] * SCREENING_ITERATIONS for c in range(len(got))}
    final = {c: [1.0 + c] * FINAL_ITERATIONS for c in range(FINALISTS)}
    ran = _drive(selection, clock, [screen, final])
    assert len(ran) == MAX_SELECTION_ITERATIONS and selection.winner is got[0]


def test_one_candidate_is_only_timed_in_the_final_phase():
    selection = PlanSelection([BucketPlan(((0,),), (0,))], FakeClock())
    assert selection.final_phase and selection.running == [0] and selection.iterations == FINAL_ITERATIONS


def test_ranking_is_by_median_unless_told_and_the_earlier_of_equals_first():
    assert ranking([[3.0, 1.0, 1.0], [2.0, 2.0, 2.0]]) == [0, 1]  # medians 1 and 2; a mean would say 1
    assert ranking([[1.0, 9.0, 2.0], [2.0, 2.0, 2.0]]) == [0, 1]  # one slow iteration does not count
    assert ranking([[2.0], [1.0], [1.0]]) == [1, 2, 0]
    assert ranking([[9.0, 1.0], [2.0, 2.0]], min) == [0, 1]  # the screen: each one's fastest iteration


def _drive(selection: PlanSelection, clock: FakeClock, phases: list[dict[int, list[float]]]) -> list[int]:
    """Run the loop as the reducer does, to the end: per iteration a no_sync micro-step (a forward
    with no iteration ended, not timed), then the synchronized one; ``phases[p][c]``: candidate c's
    iteration times in phase p. Returns the candidate each iteration ran."""
    ran, installed = [], selection.candidates[0]
    selection.started()
    for seconds in phases:
        in_phase: list[int] = []
        while not selection.measured:
            candidate = selection.candidate
            assert installed == selection.candidates[candidate]  # the layout in force is the one being timed
            in_phase.append(candidate)
            clock.time += seconds[candidate][in_phase.count(candidate) - 1] / 2
            assert selection.forward(iteration_ended=False) is None  # a no_sync micro-step's forward
            selection.started()  # the reducer calls it after every forward
            clock.time += seconds[candidate][in_phase.count(candidate) - 1] / 2
            switch = selection.forward(iteration_ended=True)
            if switch is not None:
                installed = switch
            clock.time += 100.0  # switching layouts costs time that no candidate is charged for
            selection.started()
        assert selection.local_seconds() == [pytest.approx(seconds[c]) for c in selection.running]
        installed = selection.agree(torch.distributed.group.WORLD, torch.device("cpu"))
        clock.time += 100.0
        selection.started()
        ran += in_phase
    assert selection.winner is installed
    return ran


def test_all_take_turns_in_the_screen_then_the_two_fastest_again_and_their_final_times_decide(one_rank):
    plans = [BucketPlan(((i,),), (0,)) for i in range(3)]
    clock = FakeClock()
    selection = PlanSelection(plans, clock)
    # Fastest iterations 0.3, 0.1, 0.35: 1 and 0 go on (by the median, 0.4 and 0.45, 2 would go on).
    screen = {0: [0.5, 0.3], 1: [0.1, 0.2], 2: [0.4, 0.35]}
    final = {1: [0.4, 0.4, 0.4, 0.4], 0: [0.3, 9.0, 0.3, 0.3]}  # the final times alone; one outlier ignored
    ran = _drive(selection, clock, [screen, final])
    assert ran == [0, 1, 2] * SCREENING_ITERATIONS + [1, 0] * FINAL_ITERATIONS
    assert selection.winner is plans[0]


def test_two_candidates_skip_the_screen(one_rank):
    plans = [BucketPlan(((i,),), (0,)) for i in range(2)]
    clock = FakeClock()
    selection = PlanSelection(plans, clock)
    ran = _drive(selection, clock, [{0: [0.5] * FINAL_ITERATIONS, 1: [0.4] * FINAL_ITERATIONS}])
    assert ran == [0, 1] * FINAL_ITERATIONS and selection.winner is plans[1]


def test_an_interrupted_iteration_is_not_timed():
    clock = FakeClock()
    selection = PlanSelection([BucketPlan(((0,),), (0,)), BucketPlan(((1,),), (0,))], clock, final=1)
    selection.started()
    clock.time += 50.0
    selection.interrupted()  # the backward failed; the next forward starts a fresh timing
    assert selection.forward(iteration_ended=True) is None and selection.candidate == 0
    selection.started()
    clock.time += 1.0
    assert selection.forward(iteration_ended=True) is selection.candidates[1]
    assert selection.local_seconds()[0] == [1.0]


def test_agreeing_before_every_candidate_ran_is_refused(one_rank):
    selection = PlanSelection([BucketPlan(((0,),), (0,)), BucketPlan(((1,),), (0,))], FakeClock())
    with pytest.raises(RuntimeError, match=f"0 of {2 * FINAL_ITERATIONS} are timed"):
        selection.agree(torch.distributed.group.WORLD, torch.device("cpu"))


def test_a_selection_needs_candidates_and_iterations():
    with pytest.raises(ValueError, match="needs candidates and iterations"):
        PlanSelection([], FakeClock())
    with pytest.raises(ValueError, match="needs candidates and iterations"):
        PlanSelection([BucketPlan(((0,),), (0,))], FakeClock(), screening=0)
    with pytest.raises(ValueError, match="needs candidates and iterations"):
        PlanSelection([BucketPlan(((0,),), (0,))], FakeClock(), final=0)


def test_an_iteration_interrupted_at_the_start_of_the_final_phase_is_not_timed(one_rank):
    clock = FakeClock()
    plans = [BucketPlan(((i,),), (0,)) for i in range(3)]
    selection = PlanSelection(plans, clock, screening=1, final=1)
    selection.started()
    for seconds in (0.3, 0.1, 0.2):  # the screen: 1 and 2 go on
        clock.time += seconds
        selection.forward(iteration_ended=True)
        selection.started()
    assert selection.agree(torch.distributed.group.WORLD, torch.device("cpu")) is plans[1]
    selection.started()
    clock.time += 50.0
    selection.interrupted()  # the first finalist's first iteration failed
    assert selection.forward(iteration_ended=True) is None and selection.candidate == 1
    selection.started()
    clock.time += 0.4
    assert selection.forward(iteration_ended=True) is plans[2]
    assert selection.local_seconds() == [[pytest.approx(0.4)], []]
