"""Which object takes over an optimizer given to ``attach_optimizer``, and may it?

The guard (``optim/guard.py``), the overlapped optimizer (``optim/overlap.py``, a consumer of reduced
buckets) or the sharded one (``shard/optimizer.py``, DDP's backward, its own ``step()``). A refused
combination with what is attached already is asked of the one refusal table first (refusals.py),
then the optimizer's own checks run; nothing is taken over before every check passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlapddp.optim.guard import OptimizerGuard
from overlapddp.optim.overlap import OverlappedOptimizer
from overlapddp.reducer import Reducer
from overlapddp.refusals import Feature, refuse_pairs
from overlapddp.shard.checks import ShardRequest, check_shardable
from overlapddp.shard.optimizer import ShardedOptimizer


@dataclass(frozen=True)
class AttachTo:
    """What of the wrapper an attachment needs: its reducer, group and parameter names, the features in
    force, and the sharded optimizers attached so far (the wrapper's list, appended to here)."""

    reducer: Reducer
    process_group: dist.ProcessGroup
    names: dict[int, str]  # id -> name of every parameter of the wrapped module
    features: set[Feature]
    sharded: list[ShardedOptimizer]


@dataclass(frozen=True)
class Switches:
    """``attach_optimizer``'s keyword arguments, as given."""

    overlap: bool = False
    shard: bool = False
    max_grad_norm: float | None = None
    scaler: torch.amp.GradScaler | None = None
    strict: bool = False
    allow_unsynced: bool = False


def attach(
    target: AttachTo, optimizer: torch.optim.Optimizer, switches: Switches
) -> OptimizerGuard | OverlappedOptimizer | ShardedOptimizer:
    """Check, then take ``optimizer`` over as ``switches`` ask (no collective)."""
    reducer = target.reducer
    if switches.shard:
        refuse_pairs(target.features, Feature.SHARDED_OPTIMIZER, rank=reducer.rank)
        return _shard(target, optimizer, switches)
    if switches.overlap:
        refuse_pairs(target.features, Feature.OVERLAPPED_OPTIMIZER, rank=reducer.rank)
        return OverlappedOptimizer(reducer, optimizer, max_grad_norm=switches.max_grad_norm, scaler=switches.scaler)
    if switches.max_grad_norm is not None:
        raise ValueError("max_grad_norm is for overlap=True; without overlap call clip_grad_norm_ before step().")
    return OptimizerGuard(reducer, optimizer, strict=switches.strict, allow_unsynced=switches.allow_unsynced,
                          scaler=switches.scaler)


def _shard(target: AttachTo, optimizer: torch.optim.Optimizer, switches: Switches) -> ShardedOptimizer:
    given = {"overlap": switches.overlap, "max_grad_norm": switches.max_grad_norm is not None,
             "allow_unsynced": switches.allow_unsynced, "scaler": switches.scaler is not None,
             "strict": switches.strict}
    request = ShardRequest(
        names=target.names,
        reduced=frozenset(id(p) for p in target.reducer.params),
        taken={id(p): type(s.optimizer).__name__ for s in target.sharded for p in s.parameters()},
        switches=given,
        rank=target.reducer.rank,
        world_size=target.process_group.size(),
    )
    check_shardable(optimizer, request)
    sharded = ShardedOptimizer(target.reducer, optimizer, request, target.process_group, switches.strict,
                               switches.scaler)
    target.sharded.append(sharded)
    return sharded
