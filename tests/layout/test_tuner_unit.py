"""The tuner of ``bucket_plan="tuned"`` alone, driven by hand with a fake clock on one rank: what one
measured iteration records, when it measures at all, how ranks agree on the model's layout, and how
many synchronized iterations calibration and selection take (spawned ranks: test_tuned_plan.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch
import torch.distributed as dist

from overlapddp import clock as clock_module
from overlapddp.clock import BucketStamps, HostClock, LaunchStamps, Stamp
from overlapddp.layout import tuner as tuner_module
from overlapddp.layout.cost_model import BucketTiming
from overlapddp.layout.plan import MIB, BucketCaps, BucketPlan, explicit_plan, rebuilt_plan
from overlapddp.layout.selection import MAX_SELECTION_ITERATIONS
from overlapddp.layout.tuner import CALIBRATION_ITERATIONS, TUNING_ITERATIONS, PlanTuner


class FakeClock(HostClock):
    """Stamps are whatever time the test has set; a collective completes at ``completes``."""

    def __init__(self) -> None:
        self.time = 0.0
        self.completes = 0.0

    def now(self) -> float:
        return self.time

    def done(self, future: torch.futures.Future) -> float:
        return self.completes

    def seconds(self, origin: Stamp, stamps: Sequence[Stamp]) -> list[float]:
        return [s - origin for s in stamps]  # type: ignore[operator]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(tuner_module, "clock_for", lambda device: fake)
    return fake


def _params(count: int, mib: float = 0.001) -> list[torch.Tensor]:
    return [torch.empty(max(1, int(mib * MIB) // 4)) for _ in range(count)]


def _plan_of(sizes: Sequence[int]) -> BucketPlan:
    """A layout of consecutive parameters in buckets of these sizes (the tuner reads the sizes)."""
    buckets, start = [], 0
    for size in sizes:
        buckets.append(tuple(range(start, start + size)))
        start += size
    return BucketPlan(tuple(buckets), tuple(4 * size for size in sizes))


def _measure(tuner: PlanTuner, clock: FakeClock, ready: dict[int, float], buckets: int = 1) -> None:
    """One synchronized backward on the fake clock, stamped as the fence stamps it: gradients ready at
    the given times, then each bucket launched, completed and consumed one second apart (stamped only
    while the tuner measures, as the fence stamps only then)."""
    stamps = tuner.start_iteration(_plan_of([1] * max(buckets, 1)))
    if stamps is None:
        tuner.end_iteration()
        return
    for index, at in ready.items():
        clock.time = at
        stamps.gradient_ready(index)
    for bucket in range(buckets):
        clock.time += 1.0
        clock.completes = clock.time + 1.0
        stamps.launches.append(LaunchStamps(bucket, 4, 0.0, clock.now(), clock.completes))
        stamps.completed[bucket], stamps.consumed[bucket] = clock.completes, clock.completes + 0.5
    tuner.end_iteration()


def test_one_measured_iteration_records_ready_times_from_the_first_and_each_buckets_timing(clock):
    tuner = PlanTuner(_params(3), [False] * 3)
    assert tuner.measuring is False
    clock.time = 10.0
    stamps = tuner.start_iteration(_plan_of([2, 1]))
    assert tuner.measuring is True and stamps is not None and stamps.origin == 10.0
    clock.time = 11.0
    stamps.gradient_ready(2)
    clock.time = 12.0
    stamps.gradient_ready(0)  # gradient 1 is never ready (unused this iteration)
    stamps.launches.append(LaunchStamps(0, 8, 0.5, 12.5, 14.0))
    stamps.completed[0], stamps.consumed[0] = 14.0, 14.25
    # done before its launch was stamped: counts as done when launched; no consumer work: zero
    stamps.launches.append(LaunchStamps(1, 4, 0.25, 13.0, 11.0))
    tuner.end_iteration()
    assert tuner.measuring is False
    [ready] = tuner._ready
    assert ready[0] == 1.0 and math.isnan(ready[1]) and ready[2] == 0.0
    assert tuner._buckets == [[BucketTiming(8, 2.5, 4.0, 0.5, 2, 0.25), BucketTiming(4, 3.0, 3.0, 0.25, 1, 0.0)]]


def test_the_fence_stamps_a_launch_with_its_host_seconds_and_completion(clock, monkeypatch):
    stamps = BucketStamps(clock, 1)
    ticks = iter([100.0, 100.5])
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    clock.time, clock.completes = 3.0, 7.0
    future: torch.futures.Future = torch.futures.Future()
    assert stamps.launch(2, 16, lambda: future) is future
    assert stamps.launches == [LaunchStamps(2, 16, 0.5, 3.0, 7.0)]


def test_launches_with_no_finalize_work_still_count(clock):
    tuner = PlanTuner(_params(2), [False] * 2)
    stamps = tuner.start_iteration(_plan_of([1, 1]))
    assert stamps is not None
    stamps.launches += [LaunchStamps(0, 4, 0.0, 1.0, 1.0), LaunchStamps(1, 4, 0.0, 2.0, 2.0)]
    tuner.end_iteration()
    assert [b.finalize_s for b in tuner._buckets[0]] == [0.0, 0.0]


def test_calibration_measures_the_documented_iterations_and_nothing_outside_them(clock):
    assert CALIBRATION_ITERATIONS == 2  # docs/beyond_ddp_tuned.md: "Calibrate (2 iterations)"
    assert TUNING_ITERATIONS == 20  # ... "at most 5 candidates x 2 + 2 finalists x 4 = 18" after them
    plan = _plan_of([2])
    tuner = PlanTuner(_params(2), [False] * 2)
    tuner.end_iteration()  # outside a measured iteration: nothing to record, nothing fails
    tuner.discard_iteration()  # a failed iteration before any selection
    for _ in range(CALIBRATION_ITERATIONS):
        assert tuner.start_iteration(plan) is not None
        assert tuner.measuring
        tuner.end_iteration()
    assert tuner.start_iteration(plan) is None
    assert not tuner.measuring and len(tuner._ready) == CALIBRATION_ITERATIONS
    restored = PlanTuner(_params(2), [False] * 2, iterations=5)
    restored.restored()
    assert restored.start_iteration(plan) is None and not restored.measuring
    shadowed = PlanTuner(_params(1), [False])  # a model of one parameter
    shadowed.shadow_iteration()  # a joined rank counts the iterations it shadows, one each
    shadowed.start_iteration(_plan_of([1]))
    assert shadowed.measuring
    shadowed.discard_iteration()
    for _ in range(CALIBRATION_ITERATIONS):
        shadowed.shadow_iteration()
    shadowed.start_iteration(_plan_of([1]))
    assert not shadowed.measuring


def test_median_ready_times_count_unused_gradients_ready_first_and_zeros_without_measurements(clock):
    tuner = PlanTuner(_params(3), [False] * 3, iterations=3)
    assert tuner._median_ready() == [0.0, 0.0, 0.0]  # e.g. a rank that had joined
    assert tuner._plan([0.0, 0.0, 0.0]) is None
    _measure(tuner, clock, {0: 1.0, 1: 3.0}, buckets=0)
    assert tuner._plan(tuner._median_ready()) is None  # ready times but no bucket: nothing to fit
    _measure(tuner, clock, {0: 1.0, 1: 2.0, 2: 5.0})
    assert tuner._median_ready() == [0.0, 1.5, 2.0]  # gradient 2 unused once: 0.0 in its median


def _ready_order(count: int) -> list[int]:
    return list(reversed(range(count)))


def test_the_ranks_agree_on_rank_zeros_layout_buckets_of_one_gradient_included(clock, monkeypatch, one_rank):
    group = dist.group.WORLD
    params = _params(3)
    tuner = PlanTuner(params, [False] * 3)
    assert tuner.agree(group, torch.device("cpu")) is None  # nothing measured: no model layout
    _measure(tuner, clock, {0: 1.0, 1: 2.0, 2: 3.0})
    planned = explicit_plan(params, [(2,), (0, 1)])
    seen: list[list[float]] = []
    monkeypatch.setattr(tuner_module, "tuned_plan", lambda params, ready, link, finalize: seen.append(ready) or planned)
    agreed = tuner.agree(group, torch.device("cpu"))
    assert agreed is not None and agreed.buckets == ((2,), (0, 1))
    assert seen == [[0.0, 1.0, 2.0]]
    assert tuner._ready == [] and tuner._buckets == []  # measurements are spent


def _run_until_done(tuner: PlanTuner, clock: FakeClock, params: list[torch.Tensor], in_force: BucketPlan,
                    rounds: int, between_each: int = 1, buckets: int = 1) -> tuple[int, list[BucketPlan]]:
    """Synchronized iterations until the tuner's layout is final: how many, and each layout adopted."""
    adopted: list[BucketPlan] = []
    for iteration in range(rounds):
        for _ in range(between_each):  # several forwards before a backward: one iteration still
            tuner.between_iterations(dist.group.WORLD, torch.device("cpu"), _ready_order(len(params)),
                                     in_force, adopted.append)
        if tuner.done:
            return iteration, adopted
        _measure(tuner, clock, {i: float(i) for i in range(len(params))}, buckets)
        clock.time += 1.0
    raise AssertionError(f"not done after {rounds} iterations")


def test_tuning_takes_at_most_the_iterations_the_layout_lifecycle_counts(clock, monkeypatch, one_rank):
    params = _params(100, 0.3)  # 30 MiB: every candidate layout differs, the most there can be
    order = _ready_order(100)
    monkeypatch.setattr(tuner_module, "tuned_plan",
                        lambda params, ready, link, finalize: explicit_plan(params, [order[:3], order[3:]]))
    in_force = rebuilt_plan(params, [False] * 100, BucketCaps.from_user(2, None), order)
    tuner = PlanTuner(params, [False] * 100)
    iterations, adopted = _run_until_done(tuner, clock, params, in_force, rounds=TUNING_ITERATIONS + 5)
    assert iterations == TUNING_ITERATIONS == CALIBRATION_ITERATIONS + MAX_SELECTION_ITERATIONS
    assert adopted[0].buckets == (tuple(order[:3]), tuple(order[3:]))  # the model's plan runs first
    # Forwards without a backward between them (evaluation, no_sync micro-steps) time nothing more.
    again = PlanTuner(params, [False] * 100)
    assert _run_until_done(again, clock, params, in_force, TUNING_ITERATIONS + 5, between_each=3)[0] == iterations


def test_one_candidate_is_adopted_at_once_also_after_more_shadowed_iterations(clock, one_rank):
    params = _params(3)  # far below every fixed cap: a single layout, and no bucket timed: no model plan
    in_force = rebuilt_plan(params, [False] * 3, BucketCaps.from_user(None, None), _ready_order(3))
    tuner = PlanTuner(params, [False] * 3)
    iterations, adopted = _run_until_done(tuner, clock, params, in_force, rounds=10, buckets=0)
    assert iterations == CALIBRATION_ITERATIONS and [p.buckets for p in adopted] == [in_force.buckets]

    shadowed = PlanTuner(params, [False] * 3)
    for _ in range(CALIBRATION_ITERATIONS + 1):  # a joined rank, one more shadow before the forward
        shadowed.shadow_iteration()
    shadowed.between_iterations(dist.group.WORLD, torch.device("cpu"), _ready_order(3), in_force, adopted.append)
    assert shadowed.done


def test_a_discarded_iteration_during_the_selection_is_not_timed(clock, monkeypatch, one_rank):
    params = _params(100, 0.3)
    order = _ready_order(100)
    in_force = rebuilt_plan(params, [False] * 100, BucketCaps.from_user(2, None), order)
    tuner = PlanTuner(params, [False] * 100)
    for _ in range(CALIBRATION_ITERATIONS):
        _measure(tuner, clock, {0: 0.0})
    group, cpu = dist.group.WORLD, torch.device("cpu")
    clock.time = 100.0
    tuner.between_iterations(group, cpu, order, in_force, lambda plan: None)  # an iteration starts
    assert tuner._selection is not None
    clock.time = 101.0
    tuner.discard_iteration()  # ... and its backward raised
    clock.time = 102.0
    tuner.between_iterations(group, cpu, order, in_force, lambda plan: None)  # the next one starts here
    _measure(tuner, clock, {0: 103.0})
    clock.time = 110.0
    tuner.between_iterations(group, cpu, order, in_force, lambda plan: None)
    assert tuner._selection._timed[0] == [(102.0, 110.0)]


def test_a_shadowed_iteration_is_timed_in_the_selection_like_a_run_one(clock, one_rank):
    params = _params(100, 0.3)
    order = _ready_order(100)
    in_force = rebuilt_plan(params, [False] * 100, BucketCaps.from_user(2, None), order)
    tuner = PlanTuner(params, [False] * 100)
    for _ in range(CALIBRATION_ITERATIONS):
        tuner.shadow_iteration()
    group, cpu = dist.group.WORLD, torch.device("cpu")
    tuner.between_iterations(group, cpu, order, in_force, lambda plan: None)
    assert tuner._selection is not None
    clock.time = 3.0
    tuner.shadow_iteration()  # the joined rank issues this iteration's collectives with the others
    tuner.between_iterations(group, cpu, order, in_force, lambda plan: None)
    assert tuner._selection._count == 1


def test_a_bucket_stamped_at_only_one_end_of_its_finalize_work_counts_none(clock):
    tuner = PlanTuner(_params(2), [False] * 2)
    stamps = tuner.start_iteration(_plan_of([1, 1]))
    assert stamps is not None
    stamps.launches += [LaunchStamps(0, 4, 0.0, 1.0, 2.0), LaunchStamps(1, 4, 0.0, 1.5, 2.5)]
    stamps.completed[0] = 2.0  # never consumed
    stamps.consumed[1] = 3.0  # never completed
    tuner.end_iteration()
    assert [b.finalize_s for b in tuner._buckets[0]] == [0.0, 0.0]


def test_an_iteration_ending_after_a_discarded_one_and_a_restored_layout_measures_nothing(clock):
    plan = _plan_of([2])
    tuner = PlanTuner(_params(2), [False] * 2)
    assert tuner.start_iteration(plan) is not None
    tuner.discard_iteration()  # the calibration iteration failed ...
    tuner.restored()  # ... and a checkpoint's layout was loaded
    assert tuner.start_iteration(plan) is None
    tuner.end_iteration()  # nothing measured, nothing fails
    assert tuner._ready == [] and tuner._buckets == [] and not tuner.measuring
