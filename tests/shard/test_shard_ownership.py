"""Who owns which parameter (``shard/ownership.py``), planned alone: costs in, owners out."""

from __future__ import annotations

import torch

from overlapddp.shard.ownership import muon_flops, plan_ownership, update_cost


def test_the_most_expensive_go_first_each_to_the_least_loaded_rank():
    plan = plan_ownership([1.0, 8.0, 3.0, 3.0, 5.0], world_size=2)
    # 8 -> rank 0; 5 -> rank 1; 3 (index 2) -> rank 1 (5 < 8); 3 (index 3) -> rank 0 (8 = 8: the lower rank); 1 -> 1
    assert plan.owners == (1, 0, 1, 0, 1)
    assert plan.loads == (11.0, 9.0)
    assert plan.owned_by(0) == [1, 3] and plan.owned_by(1) == [0, 2, 4]


def test_the_plan_is_the_same_whenever_it_is_computed_and_covers_every_rank():
    costs = [float((7 * i) % 11) for i in range(40)]
    first = plan_ownership(costs, world_size=3)
    assert first == plan_ownership(list(costs), world_size=3)
    assert set(first.owners) == {0, 1, 2}
    assert max(first.loads) - min(first.loads) <= max(costs), "greedy: within one parameter's cost"


def test_one_rank_owns_everything_and_no_parameter_is_no_load():
    assert plan_ownership([2.0, 0.0], world_size=1).owners == (0, 0)
    assert plan_ownership([], world_size=4).loads == (0.0, 0.0, 0.0, 0.0)


def test_muon_is_balanced_by_newton_schulz_flops_and_elementwise_optimizers_by_elements():
    assert muon_flops((256, 1024), ns_steps=5) == 5 * (4 * 256 * 256 * 1024 + 2 * 256 ** 3)
    assert muon_flops((1024, 256), ns_steps=5) == muon_flops((256, 1024), ns_steps=5), "the smaller side is m"
    wide, square = torch.nn.Parameter(torch.zeros(64, 1024)), torch.nn.Parameter(torch.zeros(256, 256))
    muon = torch.optim.Muon([wide, square])
    # The same elements, but Newton-Schulz on the square matrix costs 4x more
    assert update_cost(muon, muon.param_groups[0], square) > 3 * update_cost(muon, muon.param_groups[0], wide)
    adamw = torch.optim.AdamW([wide, square])
    assert update_cost(adamw, adamw.param_groups[0], wide) == update_cost(adamw, adamw.param_groups[0], square)
    ns_steps_10 = torch.optim.Muon([square], ns_steps=10)
    assert update_cost(ns_steps_10, ns_steps_10.param_groups[0], square) == muon_flops((256, 256), 10)
