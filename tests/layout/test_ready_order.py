"""Ranks whose gradients become ready in different orders still share rank 0's bucket layout.

DDP rebuilds the buckets once, from rank 0's gradient-ready order, broadcast to every rank. If a
rank rebuilt from its own order, bucket 0 would sum ``b``'s gradients on rank 0 with ``a``'s on the
others: a silent wrong result. ``models.RankOrdered`` computes ``b(a(x))`` on rank 0 and ``a(b(x))``
elsewhere, so only the broadcast keeps the layouts, and the values, equal to DDP's.
"""

from __future__ import annotations

import functools

import pytest

from tests.support.parity import Outcome, Scenario, outcomes_by_scenario

TINY = 0.001  # ~1 KiB caps: one bucket per layer after the rebuild
SCENARIOS = [Scenario("rank_ordered", "sgd", TINY), Scenario("rank_ordered", "adam", None)]
# The layouts rebuilt from rank 0's ready order (b.bias, b.weight, a.bias, a.weight are 3, 2, 1, 0);
# the other ranks' own order (1, 0, 3, 2) would give [[1, 0], [3, 2]] and [[1, 0, 3, 2]].
RANK_0_LAYOUTS = {TINY: [[3, 2], [1, 0]], None: [[3, 2, 1, 0]]}


@functools.cache
def outcomes(world_size: int) -> dict[Scenario, list[Outcome]]:
    return outcomes_by_scenario(world_size, SCENARIOS)


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_ranks_with_different_ready_orders_stay_bit_equal_to_ddp(world_size, scenario):
    for rank, outcome in enumerate(outcomes(world_size)[scenario]):
        assert all(outcome.equal) and len(outcome.equal) == scenario.steps, (
            f"rank {rank}: first difference at {outcome.first_difference}"
        )


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_rank_uses_the_layout_built_from_rank_0s_ready_order(world_size, scenario):
    for rank, outcome in enumerate(outcomes(world_size)[scenario]):
        assert outcome.ddp_layouts[1:] == [RANK_0_LAYOUTS[scenario.bucket_cap_mb]] * (scenario.steps - 1)
        assert all(outcome.layouts_equal), f"rank {rank}: DDP's layouts per step {outcome.ddp_layouts}"
