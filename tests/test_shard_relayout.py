"""Moving a sharded optimizer's state to new buckets, on one rank (a one-rank group): per-element
entries are cut to each parameter's new piece, and the other entries, tensors or not, are carried."""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlapddp.shard.layout import plan_bucket
from overlapddp.shard.relayout import HeldShard, moved_state


def test_state_moves_to_the_new_layout_with_its_plain_values(one_rank: None) -> None:
    # Parameter 2 comes first and has no state (never stepped), then parameters 0 and 1.
    old = plan_bucket(0, [2, 0, 1], [1, 2, 3], world_size=1, rank=0)
    entries = [
        (old.pieces[1], {"exp_avg": torch.tensor([1.0, 2.0]), "step": torch.tensor(4.0), "seen": 3}),
        (old.pieces[2], {"exp_avg": torch.tensor([5.0, 6.0, 7.0]), "step": torch.tensor(4.0), "seen": 3}),
    ]
    new = plan_bucket(0, [1, 0, 2], [3, 2, 1], world_size=1, rank=0)  # the rebuilt order
    moved = moved_state([HeldShard(old, [2, 0, 1], entries)], list(new.pieces), frozenset({"exp_avg"}),
                        torch.device("cpu"), dist.group.WORLD, "gloo")  # type: ignore[arg-type]
    assert sorted(moved) == [0, 1]
    assert torch.equal(moved[0]["exp_avg"], torch.tensor([1.0, 2.0]))
    assert torch.equal(moved[1]["exp_avg"], torch.tensor([5.0, 6.0, 7.0]))
    assert moved[0]["seen"] == 3 and torch.equal(moved[1]["step"], torch.tensor(4.0))
