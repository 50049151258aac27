"""Can this optimizer be sharded by whole parameters on this model? Every refusal, checked before any collective.

With ``shard=True`` each parameter is updated by one rank only, which then sends it to the others.
That is DDP's result exactly when the update of a parameter reads nothing but that parameter, its
gradient and its own state (optim/takeover.py: the known optimizers, a class's declaration, and why
one cannot). Optimizers that read other parameters (LBFGS's line search over all of them) are
refused by name, as is any subclass that did not declare itself.

Each refusal names the optimizer, the option or the parameters, and says what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlapddp.optim.takeover import is_per_parameter, why_not_per_parameter

# attach_optimizer switches that shard=True cannot honor, and why (the switch is named in the error).
REFUSED_SWITCHES: dict[str, str] = {
    "overlap": "overlap=True updates each bucket during backward; shard=True updates in step(), each rank its own "
    "parameters. Pass one of them",
    "max_grad_norm": "with shard=True every rank holds DDP's full reduced gradients: call "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before step(), as with DDP",
    "allow_unsynced": "a step on gradients that were not reduced would send the owner's local update to every rank",
}

@dataclass(frozen=True)
class ShardRequest:
    """What the wrapper knows that decides whether, and how, an optimizer can be sharded."""

    names: dict[int, str]  # id -> name (a tied one's first) of every parameter of the wrapped module
    reduced: frozenset[int]  # ids of the parameters whose gradients the wrapper reduces
    taken: dict[int, str]  # id -> the optimizer class already sharding that parameter
    switches: dict[str, bool]  # attach_optimizer's switches, by name: True where given
    rank: int
    world_size: int


def check_shardable(optimizer: torch.optim.Optimizer, request: ShardRequest) -> None:
    """Raise ValueError (naming the optimizer, the switch or the parameters) unless sharding works."""
    kind = type(optimizer)
    if not is_per_parameter(kind):
        why = why_not_per_parameter(kind)
        raise ValueError(f"{kind.__name__} cannot be sharded: {why}. Attach it without shard=True.")
    for switch, why in REFUSED_SWITCHES.items():
        if request.switches.get(switch, False):
            raise ValueError(f"shard=True cannot be combined with {switch}: {why}.")
    held = [p for group in optimizer.param_groups for p in group["params"]]
    twice = sorted({request.names.get(id(p), f"shape {tuple(p.shape)}") for p in held if id(p) in request.taken})
    if twice:
        first = request.taken[next(id(p) for p in held if id(p) in request.taken)]
        raise ValueError(
            f"{kind.__name__} holds parameters ({', '.join(twice[:4])}) that a sharded {first} attached before "
            "already updates; give each parameter to one optimizer."
        )
