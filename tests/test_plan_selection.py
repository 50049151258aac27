"""The selection loop of ``bucket_plan="tuned"`` alone: candidates, schedule and choice, driven by hand
with a fake clock (no spawned ranks; agreement across ranks is in test_tuned_plan.py)."""

from __future__ import annotations

import pytest
import torch

from overlapddp.bucket_plan import MIB, BucketCaps, BucketPlan, explicit_plan, rebuilt_plan
from overlapddp.clock import HostClock
from overlapddp.plan_selection import ITERATIONS_PER_CANDIDATE, PlanSelection, candidate_layouts, fastest


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


def test_fastest_is_the_lowest_median_and_the_earliest_of_equals():
    assert fastest([[3.0, 1.0, 1.0], [2.0, 2.0, 2.0]]) == 0  # medians 1 and 2; a mean would say 1
    assert fastest([[1.0, 9.0, 2.0], [2.0, 2.0, 2.0]]) == 0  # one slow iteration does not count
    assert fastest([[2.0], [1.0], [1.0]]) == 1


def _drive(selection: PlanSelection, clock: FakeClock, seconds: dict[int, list[float]]) -> list[int]:
    """Run the loop as the reducer does: per iteration a no_sync micro-step (a forward with no
    iteration ended, not timed), then the synchronized one; returns the candidate each iteration ran."""
    ran, installed = [], selection.candidates[0]
    selection.started()
    while not selection.measured:
        candidate = selection.candidate
        assert installed == selection.candidates[candidate]  # the layout in force is the one being timed
        ran.append(candidate)
        clock.time += seconds[candidate][ran.count(candidate) - 1] / 2
        assert selection.forward(iteration_ended=False) is None  # a no_sync micro-step's forward
        selection.started()  # the reducer calls it after every forward
        clock.time += seconds[candidate][ran.count(candidate) - 1] / 2
        switch = selection.forward(iteration_ended=True)
        if switch is not None:
            installed = switch
        clock.time += 100.0  # switching layouts costs time that no candidate is charged for
        selection.started()
    return ran


def test_the_candidates_take_turns_and_the_fastest_is_chosen(one_rank):
    plans = [BucketPlan(((i,),), (0,)) for i in range(3)]
    clock = FakeClock()
    selection = PlanSelection(plans, clock)
    seconds = {0: [0.5, 0.3, 0.3], 1: [0.1, 0.2, 0.9], 2: [0.4, 0.4, 0.4]}
    ran = _drive(selection, clock, seconds)
    assert ran == [c for _ in range(ITERATIONS_PER_CANDIDATE) for c in range(3)]  # they take turns
    assert selection.local_seconds() == [pytest.approx(seconds[c]) for c in range(3)]
    assert selection.agree(torch.distributed.group.WORLD, torch.device("cpu")) is plans[1]


def test_an_interrupted_iteration_is_not_timed():
    clock = FakeClock()
    selection = PlanSelection([BucketPlan(((0,),), (0,)), BucketPlan(((1,),), (0,))], clock, iterations=1)
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
    with pytest.raises(RuntimeError, match="0 of 6 are timed"):
        selection.agree(torch.distributed.group.WORLD, torch.device("cpu"))


def test_a_selection_needs_candidates_and_iterations():
    with pytest.raises(ValueError, match="needs candidates and iterations"):
        PlanSelection([], FakeClock())
    with pytest.raises(ValueError, match="needs candidates and iterations"):
        PlanSelection([BucketPlan(((0,),), (0,))], FakeClock(), iterations=0)
