"""The sharded step on one real rank that plays rank 0 of two (no spawn): what it updates, in which
order it launches the broadcasts, what it keeps, and what it tells about ownership."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from overlapddp import OverlapDDP
from overlapddp.shard.checks import ShardRequest
from overlapddp.shard.optimizer import ShardedOptimizer
from tests.support import models


def _as_rank_0_of_2(model: OverlapDDP, optimizer: torch.optim.Optimizer) -> tuple[ShardedOptimizer, list]:
    """A sharded optimizer that believes it is rank 0 of 2, its broadcasts recorded instead of sent."""
    request = ShardRequest(names={id(p): n for n, p in model.module.named_parameters()},
                           reduced=frozenset(id(p) for p in model.parameters()), taken={}, switches={}, rank=0,
                           world_size=2)
    sharded = ShardedOptimizer(model._reducer, optimizer, request, dist.group.WORLD)
    events: list[tuple[str, Any]] = []
    update = sharded._update

    def recorded_update(**kwargs: Any) -> None:
        events.append(("update", [p for g in optimizer.param_groups for p in g["params"]]))
        update(**kwargs)

    sharded._update = recorded_update  # type: ignore[method-assign]
    sharded.gather_start = lambda tensor, owner: events.append(("launch", (tensor, owner))) or _Done()
    return sharded, events


class _Done:
    def wait(self) -> bool:
        return True


def _backward(model: OverlapDDP, step: int = 0) -> None:
    inputs, target = models.batch("transformer", 0, step)
    models.loss_of(model(inputs), target).backward()


def test_each_owned_update_is_launched_at_once_and_the_others_are_left_to_their_owners(one_rank):
    model = OverlapDDP(models.build("transformer"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded, events = _as_rank_0_of_2(model, opt)
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    _backward(model)
    opt.step()
    names = {id(p): n for n, p in model.module.named_parameters()}
    mine = {n for n, owner in sharded.owners.items() if owner == 0}
    assert mine and mine != set(sharded.owners), "both ranks own parameters"
    # Every update lists parameters of this rank's only, and is followed at once by the launch of
    # exactly them: in place for one, as one flat copy for several.
    updates = [k for k, (kind, _) in enumerate(events) if kind == "update"]
    for k in updates:
        updated = events[k][1]
        assert {names[id(p)] for p in updated} <= mine
        kind, (tensor, owner) = events[k + 1]
        assert kind == "launch" and owner == 0
        if len(updated) == 1:
            assert tensor.data_ptr() == updated[0].data_ptr()
        else:
            packed = torch.cat([p.detach().reshape(-1) for p in updated])  # in the optimizer's order, not the schedule's
            assert torch.equal(tensor.sort().values, packed.sort().values)
    launches = [what for kind, what in events if kind == "launch"]
    assert sum(t.numel() for t, _ in launches) == sum(p.numel() for p in model.parameters()), "each sent once"
    assert [owner for _, owner in launches][:2] == [0, 1], "the ranks take turns"
    assert sum(len(events[k][1]) for k in updates) == len(mine), "each owned parameter updated once"
    assert len(launches) < len(sharded.owners), "small parameters share a broadcast"
    # (The others' parameters receive what the recording stand-in delivers: nothing.)
    assert all(not torch.equal(p, before[n]) for n, p in model.module.named_parameters() if n in mine)
    assert {names[id(p)] for p in opt.state} == mine, "state only for the owned parameters"


def test_ownership_is_inspectable_by_name_and_balanced_by_the_optimizers_cost(one_rank):
    model = OverlapDDP(models.build("transformer"))
    hidden = [p for n, p in model.module.named_parameters() if p.ndim == 2 and not n.startswith(("embed", "head"))]
    sharded, _ = _as_rank_0_of_2(model, torch.optim.Muon(hidden))
    assert set(sharded.owners.values()) == {0, 1}
    assert len(sharded.loads) == 2 and sum(sharded.loads) > 0
    assert max(sharded.loads) / min(sharded.loads) < 1.5, f"Newton-Schulz FLOPs split evenly: {sharded.loads}"
    assert all(name.startswith("blocks.") for name in sharded.owners)


def test_state_a_stepped_optimizer_holds_for_others_parameters_is_dropped_at_attach(one_rank):
    model = OverlapDDP(models.build("transformer"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _backward(model)
    opt.step()  # plain: every parameter has state
    sharded, _ = _as_rank_0_of_2(model, opt)
    assert {id(p) for p in opt.state} == {id(p) for n, p in model.module.named_parameters()
                                          if sharded.owners[n] == 0}
