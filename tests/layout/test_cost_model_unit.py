"""The tuned bucket planner's cost model, rule by rule, with hand-computed values.

``overlapddp/layout/cost_model.py`` is pure arithmetic (no collectives, no autograd), so every rule
is checked here in the test process: no process group, no spawned ranks, each test a few
milliseconds. test_tuned_plan.py checks the planner against brute force on random cases; here each
clamp, default, boundary and tie-break is pinned on a case small enough to work out by hand. Times
and sizes are powers of two or halves wherever possible, so the expected floats are exact and
compared with ``==``.

Gradients are ``uint8`` tensors, so a gradient of ``n`` elements is ``n`` bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from overlapddp.layout.cost_model import (
    MAX_BUCKET_TENSORS,
    NO_FINALIZE_WORK,
    BucketTiming,
    FinalizeFit,
    LinkFit,
    _pareto,
    fit_finalize,
    fit_link,
    predicted_end,
    tuned_plan,
)
from overlapddp.layout.plan import BucketPlan
from tests.support.partitions import all_partitions


def _grads(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


# -- the value types --------------------------------------------------------------------------


def test_link_and_finalize_seconds_add_their_fixed_and_per_byte_parts():
    assert LinkFit(alpha_s=0.5, bytes_per_s=4.0).seconds(8) == 2.5  # 0.5 + 8 / 4
    # 3 gradients at 0.5 s each plus 8 bytes at 0.25 s each.
    assert FinalizeFit(per_tensor_s=0.5, per_byte_s=0.25).seconds(3, 8) == 3.5
    assert NO_FINALIZE_WORK.seconds(7, 1000) == 0.0


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (LinkFit(1.0, 2.0), "alpha_s"),
        (FinalizeFit(1.0, 2.0), "per_byte_s"),
        (BucketTiming(8, 0.0, 1.0), "finished"),
    ],
    ids=["LinkFit", "FinalizeFit", "BucketTiming"],
)
def test_fits_and_timings_are_frozen(value: object, field: str):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, 3.0)


# -- fit_link ---------------------------------------------------------------------------------


def test_fit_link_counts_an_unmeasured_launch_cost_as_zero():
    # host_s defaults to 0: no overhead, so all 0.5 s of service time carries the 8 bytes.
    assert fit_link([[BucketTiming(8, 0.0, 0.5)]]) == LinkFit(alpha_s=0.0, bytes_per_s=16.0)


def test_fit_link_counts_a_service_time_below_the_overhead_as_no_transfer():
    # alpha = 0.5 (the cheaper launch). The first bucket's 0.25 s is below it: 0 s of transfer, not
    # -0.25 s; the second's 1.5 s leaves 1.0 s. 16 bytes over 1.0 s.
    timings = [BucketTiming(8, 0.0, 0.25, host_s=0.5), BucketTiming(8, 1.0, 2.5, host_s=1.0)]
    assert fit_link([timings]) == LinkFit(alpha_s=0.5, bytes_per_s=16.0)


def test_fit_link_counts_a_bucket_done_before_the_link_was_free_as_zero_seconds():
    # The second bucket launched at 0.5 while the first held the link until 2.0, yet completed at
    # 1.0: its service time is 0 s, not -1 s. Its bytes still count: 16 bytes over 2 s.
    timings = [BucketTiming(8, 0.0, 2.0), BucketTiming(8, 0.5, 1.0)]
    assert fit_link([timings]) == LinkFit(alpha_s=0.0, bytes_per_s=8.0)


def test_fit_link_of_empty_buckets_counts_one_byte():
    # No bytes carried: the throughput is max(0, 1) byte over the 0.5 s, never 0 (a zero throughput
    # would make every bucket infinitely slow).
    assert fit_link([[BucketTiming(0, 0.0, 0.5)]]) == LinkFit(alpha_s=0.0, bytes_per_s=2.0)


def test_fit_link_needs_a_bucket():
    with pytest.raises(ValueError, match="fit_link needs at least one reduced bucket"):
        fit_link([[], []])


# -- fit_finalize -----------------------------------------------------------------------------


def test_fit_finalize_solves_the_joint_fit_exactly():
    # y = 1 * tensors + 1 * bytes on (1 gradient, 1 byte) -> 2 s and (1, 2) -> 3 s. The normal
    # equations: tt = 2, bb = 5, tb = 3, determinant 1, both coefficients exactly 1.
    timings = [BucketTiming(1, 0.0, 0.0, tensors=1, finalize_s=2.0), BucketTiming(2, 0.0, 0.0, tensors=1, finalize_s=3.0)]
    assert fit_finalize([timings]) == FinalizeFit(per_tensor_s=1.0, per_byte_s=1.0)


def test_fit_finalize_per_byte_alone_when_no_gradient_count_was_measured():
    # tensors defaults to 0: only bytes explain the time, 0.125 s for 4 bytes -> by / bb = 0.5 / 16.
    assert fit_finalize([[BucketTiming(4, 0.0, 0.0, finalize_s=0.125)]]) == FinalizeFit(0.0, 2.0**-5)


def test_fit_finalize_without_gradient_counts_never_fits_a_per_gradient_cost():
    # y = bytes - 1 would be a per-byte cost of 1 with a negative intercept; with no gradient counts
    # (the default 0) there is no intercept to fit: per byte alone, by / bb = (0 + 2) / (1 + 4).
    timings = [BucketTiming(1, 0.0, 0.0, finalize_s=0.0), BucketTiming(2, 0.0, 0.0, finalize_s=1.0)]
    fit = fit_finalize([timings])
    assert fit.per_tensor_s == 0.0
    assert fit.per_byte_s == pytest.approx(0.4, rel=1e-12)


def test_fit_finalize_counts_an_unmeasured_bucket_as_no_work():
    # finalize_s defaults to 0: one gradient took 1 s, the other nothing -> 0.5 s per gradient, no
    # bytes (bb = 0, so no per-byte fit at all).
    timings = [BucketTiming(0, 0.0, 0.0, tensors=1, finalize_s=1.0), BucketTiming(0, 0.0, 0.0, tensors=1)]
    assert fit_finalize([timings]) == FinalizeFit(per_tensor_s=0.5, per_byte_s=0.0)


def test_fit_finalize_drops_a_slightly_negative_per_gradient_cost():
    # The exact joint fit is -0.5 per gradient + 1 per byte: negative, so dropped, whatever its size.
    # Alone: per gradient 2 / 2 = 1 (squared error 0.5), per byte 3.5 / 5 = 0.7 (0.05): per byte.
    timings = [BucketTiming(1, 0.0, 0.0, tensors=1, finalize_s=0.5), BucketTiming(2, 0.0, 0.0, tensors=1, finalize_s=1.5)]
    fit = fit_finalize([timings])
    assert fit.per_tensor_s == 0.0
    assert fit.per_byte_s == pytest.approx(0.7, rel=1e-12)


def test_fit_finalize_does_not_trust_a_joint_fit_of_nearly_collinear_columns():
    # Two buckets of one gradient each, 2**20 and 2**20 + 1 bytes: determinant 1, far below
    # 1e-9 * tt * bb (about 4.4e3), although the data fit 1 s per gradient + 2**-20 s per byte exactly.
    # So a coefficient is fitted alone: here per byte, by / bb.
    m = 2**20
    timings = [
        BucketTiming(m, 0.0, 0.0, tensors=1, finalize_s=2.0),
        BucketTiming(m + 1, 0.0, 0.0, tensors=1, finalize_s=2.0 + 2.0**-20),
    ]
    by = m * 2.0 + (m + 1) * (2.0 + 2.0**-20)
    bb = float(m * m + (m + 1) * (m + 1))
    fit = fit_finalize([timings])
    assert fit.per_tensor_s == 0.0
    assert fit.per_byte_s == pytest.approx(by / bb, rel=1e-12)


def test_fit_finalize_per_gradient_alone_clamps_a_negative_sum_to_zero():
    # No bytes; the gradient "took" -0.5 s (clock noise): no negative cost, no work at all.
    assert fit_finalize([[BucketTiming(0, 0.0, 0.0, tensors=1, finalize_s=-0.5)]]) == FinalizeFit(0.0, 0.0)


def test_fit_finalize_per_byte_alone_clamps_a_negative_sum_to_zero():
    # No gradient count; 1 byte "took" -0.5 s: no negative cost, no work at all.
    assert fit_finalize([[BucketTiming(1, 0.0, 0.0, finalize_s=-0.5)]]) == FinalizeFit(0.0, 0.0)


def test_fit_finalize_with_neither_gradients_nor_bytes_is_no_work():
    # tt = bb = 0: nothing can explain the 1 s, so both alone-fits are NO_FINALIZE_WORK.
    assert fit_finalize([[BucketTiming(0, 0.0, 0.0, finalize_s=1.0)]]) == NO_FINALIZE_WORK


# -- tuned_plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("ready", [[0.0], [0.0, 1.0, 2.0]], ids=["too-few", "too-many"])
def test_tuned_plan_needs_one_ready_time_per_parameter(ready: list[float]):
    with pytest.raises(ValueError, match=f"one ready time per parameter; got {len(ready)} for 2"):
        tuned_plan(_grads([1, 1]), ready, LinkFit(0.0, 1.0))


def test_tuned_plan_of_no_parameters_is_no_buckets():
    assert tuned_plan([], [], LinkFit(1.0, 1.0)) == BucketPlan((), ())


@pytest.mark.parametrize(
    ("alpha", "buckets"),
    [(3.5, ((0,), (1,))), (4.5, ((0, 1),))],
    ids=["overhead-below-the-gap", "overhead-above-the-gap"],
)
def test_tuned_plan_splits_exactly_when_the_overhead_is_below_the_wait(alpha: float, buckets: tuple):
    # Two 4-byte gradients ready at 0 and 4 s, 1 byte/s. Split: the first completes at alpha + 4
    # (after 4), the second at 2 * alpha + 8. One bucket: 4 + alpha + 8. Splitting wins iff alpha < 4:
    # 15 vs 15.5 at alpha 3.5, 17 vs 16.5 at alpha 4.5. Half a byte's time decides, so each bucket's
    # size must be its bytes exactly.
    params, ready, link = _grads([4, 4]), [0.0, 4.0], LinkFit(alpha, 1.0)
    plan = tuned_plan(params, ready, link)
    assert plan.buckets == buckets
    assert plan.size_limits == tuple(4 * len(b) for b in buckets)
    assert predicted_end(plan, params, ready, link) == min(2 * alpha + 8, 12 + alpha)


def test_tuned_plan_puts_256_gradients_ready_together_in_one_bucket():
    # Each bucket costs 1 s of overhead and the bytes almost nothing: one bucket, if the cap allows.
    plan = tuned_plan(_grads([1] * 256), [0.0] * 256, LinkFit(1.0, 2.0**30))
    assert MAX_BUCKET_TENSORS == 256
    assert plan.buckets == (tuple(range(256)),)


def test_tuned_plan_caps_a_bucket_at_256_gradients():
    # One more gradient: two buckets are needed, and every split into two ends at the same time
    # (2 s + 257 bytes); the longest last bucket is kept among equal layouts, so 1 + 256.
    plan = tuned_plan(_grads([1] * 257), [0.0] * 257, LinkFit(1.0, 2.0**30))
    assert plan.buckets == ((0,), tuple(range(1, 257)))


def test_tuned_plan_breaks_an_end_bounded_by_backward_and_all_work_towards_earlier_completion():
    # The work after reductions runs on one thread from the end of backward E = 8 s, 1 s per byte:
    # nothing ends before E + all work = 8 + 8 = 16 s. Two layouts reach 16 s:
    #   (0)(1)(2,3): reductions complete 5.5, 9, 12.5; work ends 10, 13, 16,
    #   (0)(1)(2)(3): reductions complete 5.5, 9, 11.5, 13; work ends 10, 13, 15, 16,
    # and the one whose reductions complete first is chosen. (On the link alone, (0,1)(2,3)
    # completes first, at 12 s, but its work ends at 16.5 s.)
    params, ready = _grads([2, 3, 2, 1]), [3.0, 3.0, 7.0, 8.0]
    link, work = LinkFit(alpha_s=0.5, bytes_per_s=1.0), FinalizeFit(per_tensor_s=0.0, per_byte_s=1.0)
    plan = tuned_plan(params, ready, link, work)
    assert plan.buckets == ((0,), (1,), (2, 3))
    assert predicted_end(plan, params, ready, link, work) == 16.0
    assert predicted_end(plan, params, ready, link) == 12.5
    # The chosen layout is the only one that is best on (work end, completion), in that order.
    ranked = sorted((predicted_end(p, params, ready, link, work), predicted_end(p, params, ready, link), p.buckets)
                    for p in all_partitions(list(range(4))))
    assert ranked[0] == (16.0, 12.5, plan.buckets) and ranked[1][:2] == (16.0, 13.0)
    assert tuned_plan(params, ready, link).buckets == ((0, 1), (2, 3))


@pytest.mark.parametrize("scale", [2.0**-60, 1.0, 2.0**40], ids=["tiny", "seconds", "huge"])
def test_tuned_plan_depends_only_on_ratios_of_times(scale: float):
    # Four 4-byte gradients ready at once, 0.5 s overhead, 1 byte/s, 4 s of work per gradient. On the
    # link alone one bucket completes first (16.5 s); with the work, four buckets end at 22 s (each
    # gradient's work overlaps the next one's reduction), every other split at 24.5 s or later.
    # Scaling every time by a power of two is exact in floating point, so the plan is the same in
    # any unit.
    params = _grads([4] * 4)
    ready = [0.0] * 4
    link = LinkFit(alpha_s=0.5 * scale, bytes_per_s=1.0 / scale)
    work = FinalizeFit(per_tensor_s=4.0 * scale, per_byte_s=0.0)
    plan = tuned_plan(params, ready, link, work)
    assert plan.buckets == ((0,), (1,), (2,), (3,))
    assert predicted_end(plan, params, ready, link, work) == 22.0 * scale
    assert tuned_plan(params, ready, link).buckets == ((0, 1, 2, 3),)


# -- _pareto ----------------------------------------------------------------------------------


def _staircase(count: int) -> list[tuple[float, float, int, int]]:
    """``count`` candidates none of which beats another: completion rises as the worst end falls."""
    return [(float(i), float(count - i), i, 0) for i in range(count)]


@pytest.mark.parametrize("count", [5, 6], ids=["five", "six"])
def test_pareto_keeps_a_front_of_at_most_front_limit_whole(count: int):
    candidates = _staircase(count)
    assert _pareto(list(reversed(candidates))) == candidates  # earliest completion first


def test_pareto_spreads_a_longer_front_from_earliest_completion_to_lowest_worst_end():
    # Seven non-dominated: six kept, front[round(k * 6 / 5)] for k = 0..5 = indices 0, 1, 2, 4, 5, 6
    # (round(3.6) = 4, round(4.8) = 5).
    front = _staircase(7)
    assert _pareto(front) == [front[i] for i in (0, 1, 2, 4, 5, 6)]


def test_pareto_drops_dominated_candidates():
    candidates = [(2.0, 2.0, 0, 0), (1.0, 3.0, 1, 0), (2.0, 4.0, 2, 0), (3.0, 2.0, 3, 0), (3.0, 1.0, 4, 0)]
    # (2, 4) is beaten by (2, 2); (3, 2) by (3, 1) and (2, 2); a later completion must lower the worst end.
    assert _pareto(candidates) == [(1.0, 3.0, 1, 0), (2.0, 2.0, 0, 0), (3.0, 1.0, 4, 0)]


def test_pareto_keeps_the_lower_worst_end_among_equal_completions():
    # Same completion: the lower worst end wins, whatever the bucket start (c[2]) says.
    assert _pareto([(1.0, 5.0, 0, 0), (1.0, 3.0, 1, 0)]) == [(1.0, 3.0, 1, 0)]


def test_pareto_keeps_one_of_equal_candidates_the_longest_last_bucket():
    # Equal times: only one is kept (a tie does not extend the front), the one whose last bucket
    # starts earliest (smallest c[2]), whatever the input order or the predecessor index c[3].
    assert _pareto([(1.0, 3.0, 1, 0), (1.0, 3.0, 0, 1)]) == [(1.0, 3.0, 0, 1)]
    # A later completion with an equal worst end is beaten too.
    assert _pareto([(2.0, 3.0, 0, 0), (1.0, 3.0, 1, 0)]) == [(1.0, 3.0, 1, 0)]


# -- predicted_end ----------------------------------------------------------------------------


def test_predicted_end_of_no_buckets_is_zero():
    assert predicted_end(BucketPlan((), ()), [], [], LinkFit(1.0, 1.0), FinalizeFit(1.0, 1.0)) == 0.0


def test_predicted_end_waits_for_backward_before_the_work_after_each_reduction():
    # Bucket (0) ready at 0 completes at 1 + 2 = 3 s; bucket (1) ready at 8 completes at 8 + 1 + 2 = 11.
    # Work (1 s per gradient + 0.5 s per byte = 2 s each) starts at the end of backward (8): 10, then
    # after the second completion: 13.
    params, ready = _grads([2, 2]), [0.0, 8.0]
    link, work = LinkFit(1.0, 1.0), FinalizeFit(1.0, 0.5)
    plan = BucketPlan(((0,), (1,)), (2, 2))
    assert predicted_end(plan, params, ready, link) == 11.0
    assert predicted_end(plan, params, ready, link, work) == 13.0
