"""Every bucket layout of consecutive runs: the brute force the tuned planner is checked against."""

from __future__ import annotations

import itertools

from overlapddp.layout.plan import BucketPlan


def all_partitions(order: list[int]) -> list[BucketPlan]:
    """Every split of ``order`` into consecutive runs."""
    plans = []
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        buckets, current = [], [order[0]]
        for cut, index in zip(cuts, order[1:], strict=True):
            if cut:
                buckets.append(tuple(current))
                current = []
            current.append(index)
        buckets.append(tuple(current))
        plans.append(BucketPlan(tuple(buckets), tuple(0 for _ in buckets)))
    return plans
