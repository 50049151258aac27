"""Bucket planning alone: expected buckets recomputed by hand and by torch's own assignment."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from overlapddp.layout.plan import MIB, BucketCaps, assign_by_size, explicit_plan, initial_plan, rebuilt_plan


def floats(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype) for n in numels]


def torch_assignment(params, limits, order=None):
    """torch's C++ assignment, the ground truth our pure-Python planner must reproduce."""
    if order is None:
        buckets, caps = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    else:
        buckets, caps = dist._compute_bucket_assignment_by_size(
            [params[i] for i in order], limits, [False] * len(params), list(order)
        )
    return [(tuple(b), c) for b, c in zip(buckets, caps, strict=False)]


def test_bucket_closes_when_reaching_cap_and_includes_the_tensor_that_crossed_it():
    params = floats(100, 100, 100, 100, 100)  # 400 bytes each
    assert assign_by_size(params, [800], [False] * 5) == [((0, 1), 800), ((2, 3), 800), ((4,), 800)]
    assert assign_by_size(params, [700], [False] * 5) == [((0, 1), 700), ((2, 3), 700), ((4,), 700)]
    assert assign_by_size(params, [900], [False] * 5) == [((0, 1, 2), 900), ((3, 4), 900)]


def test_cap_list_advances_per_bucket_and_repeats_its_last_entry():
    params = floats(100, 100, 100, 100, 100, 100)
    assert assign_by_size(params, [400, 1200], [False] * 6) == [((0,), 400), ((1, 2, 3), 1200), ((4, 5), 1200)]


def test_each_dtype_has_its_own_accumulator_and_initial_buckets_sort_by_smallest_index():
    params = [torch.empty(100), torch.empty(100, dtype=torch.float64), torch.empty(100), torch.empty(100)]
    assert assign_by_size(params, [800], [False] * 4) == [((0, 2), 800), ((1,), 800), ((3,), 800)]


def test_rebuild_keeps_ready_order_inside_and_across_buckets():
    params = floats(50, 100, 150, 200)  # 200, 400, 600, 800 bytes
    order = [3, 1, 0, 2]
    assert assign_by_size(params, [1000], [False] * 4, order) == [((3, 1), 1000), ((0, 2), 1000)]


def test_sparse_gradient_parameters_sit_alone_with_no_limit():
    params = floats(10, 10, 10)
    assert assign_by_size(params, [sys.maxsize], [False, True, False]) == [
        ((0, 2), sys.maxsize), ((1,), 0)
    ]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("limits", [[sys.maxsize], [1024, 4096], [3000], [512, 2048, 100000]])
def test_matches_torch_assignment_initial_and_rebuilt(seed, limits):
    g = torch.Generator().manual_seed(seed)
    numels = torch.randint(1, 700, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
    params = floats(*numels)
    assert assign_by_size(params, limits, [False] * len(params)) == torch_assignment(params, limits)
    order = torch.randperm(len(params), generator=g).tolist()
    assert assign_by_size(params, limits, [False] * len(params), order) == torch_assignment(params, limits, order)


def test_default_caps_are_one_unlimited_bucket_then_1_and_25_mib():
    caps = BucketCaps.from_user(None, None)
    assert caps.initial_limits(searches_unused_each_forward=False) == [sys.maxsize]
    assert caps.rebuild_limits() == [1 * MIB, 25 * MIB]
    assert caps.initial_limits(searches_unused_each_forward=True) == [1 * MIB, 25 * MIB]


def test_explicit_cap_is_used_for_the_first_bucket_too():
    caps = BucketCaps.from_user(4, None)
    assert caps.rebuild_limits() == [4 * MIB, 4 * MIB]
    assert caps.initial_limits(searches_unused_each_forward=True) == [4 * MIB]


def test_cap_list_drives_initial_and_rebuilt_layouts():
    caps = BucketCaps.from_user(None, [1, 2])
    assert caps.initial_limits(False) == [MIB, 2 * MIB] == caps.rebuild_limits()
    assert caps.bytes_cap == 2 * MIB


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "25", True])
def test_invalid_cap_names_the_argument(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        BucketCaps.from_user(bad, None)
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[1\]"):
        BucketCaps.from_user(None, [1, bad])


def test_initial_plan_is_one_bucket_in_registration_order():
    params = floats(10, 20, 30)
    plan = initial_plan(params, [False] * 3, BucketCaps.from_user(None, None), False)
    assert plan.buckets == ((0, 1, 2),)


def test_initial_plan_with_unused_parameter_search_reverses_the_bucket_list():
    params = floats(300_000, 300_000, 300_000, 300_000)  # 1.2 MB each: the first cap closes bucket 0
    plan = initial_plan(params, [False] * 4, BucketCaps.from_user(None, None), True)
    assert plan.buckets == ((1, 2, 3), (0,))


def test_rebuilt_plan_puts_first_ready_gradients_in_bucket_zero():
    params = floats(200_000, 200_000, 200_000, 200_000)  # 800 kB each
    plan = rebuilt_plan(params, [False] * 4, BucketCaps.from_user(None, None), [3, 2, 1, 0])
    assert plan.buckets == ((3, 2), (1, 0))
    assert plan.locate()[1] == (1, 0)


def test_rebuilt_plan_rejects_an_incomplete_ready_order():
    with pytest.raises(ValueError, match="every parameter exactly once"):
        rebuilt_plan(floats(1, 1), [False, False], BucketCaps.from_user(None, None), [0])


def test_a_bucket_one_byte_under_its_cap_stays_open_and_each_bucket_counts_from_zero():
    """1024 + 1020 bytes is one byte under a 2045-byte cap: the third tensor closes the bucket, and the
    next bucket counts its bytes afresh (an off-by-one start closes either bucket a tensor early)."""
    params = floats(256, 255, 256, 256, 255, 256)
    assert assign_by_size(params, [2045], [False] * 6) == [((0, 1, 2), 2045), ((3, 4, 5), 2045)]


def test_a_bucket_never_closed_records_the_first_cap():
    assert assign_by_size(floats(10), [2045, 10**9], [False]) == [((0,), 2045)]


def test_caps_are_in_mebibytes():
    assert BucketCaps.from_user(1, None).bytes_cap == 1_048_576
    assert BucketCaps.from_user(None, None).rebuild_limits() == [1_048_576, 26_214_400]


def test_a_cap_list_starts_with_its_first_entry():
    assert BucketCaps.from_user(None, [3, 1, 2]).first_bytes == 3 * 1_048_576


@pytest.mark.parametrize("bad", [[], (), "25"])
def test_an_empty_or_string_cap_list_is_refused(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb_list must be a non-empty list"):
        BucketCaps.from_user(None, bad)


def test_an_explicit_plan_records_each_buckets_size_in_bytes():
    params = floats(10, 20, 30)
    assert explicit_plan(params, [[2], [0, 1]]).size_limits == (120, 120)


def test_rebuilt_plan_rejects_a_ready_order_with_a_repeated_parameter():
    with pytest.raises(ValueError, match="every parameter exactly once"):
        rebuilt_plan(floats(1, 1, 1), [False] * 3, BucketCaps.from_user(None, None), [0, 2, 2])
