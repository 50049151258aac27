"""Which rank updates which parameter? A pure plan: each parameter's cost in, its owner out.

Each parameter is owned whole by one rank, which alone runs the optimizer's update of it and keeps
its state. Owners are chosen so that the ranks' estimated update costs are as even as a greedy
plan makes them: the most expensive parameter first, each to the least loaded rank (the lowest rank
on a tie), so every rank computes the same plan from the same shapes, without a collective.

The cost of an update: Newton-Schulz FLOPs for ``torch.optim.Muon`` (its orthogonalization
dominates), the number of elements for every elementwise optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def muon_flops(shape: Sequence[int], ns_steps: int) -> float:
    """Newton-Schulz FLOPs of one ``m x n`` matrix: per step a gram matrix (2 m^2 n), its polynomial
    (2 m^3) and the product with the matrix (2 m^2 n), with m the smaller side."""
    if len(shape) != 2:
        return float(max(1, _numel(shape)))
    m, n = sorted(shape)
    return float(ns_steps * (4 * m * m * n + 2 * m ** 3))


def update_cost(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> float:
    """The estimated cost of ``optimizer``'s update of ``param`` in ``group`` (only ratios matter)."""
    if isinstance(optimizer, torch.optim.Muon):
        return muon_flops(tuple(param.shape), int(group.get("ns_steps", 5)))
    return float(param.numel())


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass(frozen=True)
class Ownership:
    """The owner of every parameter, and the estimated load this puts on each rank."""

    owners: tuple[int, ...]  # per parameter, in the order given to plan_ownership
    loads: tuple[float, ...]  # per rank: the sum of its parameters' costs

    def owned_by(self, rank: int) -> list[int]:
        """The indices of the parameters ``rank`` owns, in their given order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]


def plan_ownership(costs: Sequence[float], world_size: int) -> Ownership:
    """Give each parameter to the least loaded rank, the most expensive first (ties: the lower index
    first, the lower rank wins): deterministic, so every rank computes the same plan."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return Ownership(tuple(owners), tuple(loads))
