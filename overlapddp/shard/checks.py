"""Can this optimizer be sharded across ranks on this model? Every refusal, checked before any collective.

A sharded update is bit-equal to the user's optimizer only when the update of an element reads
nothing but that element, its gradient and its state: SGD (momentum, weight decay, nesterov),
Adam and AdamW. Optimizers that read a whole tensor (LAMB's and LARS's trust ratios, Adafactor's
factored moments) or all of them (LBFGS) are refused, as is every subclass (its step may read more).
Each refusal names the optimizer, the parameter group, the option or the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from overlapddp.bucket.storage import is_dense_permutation
from overlapddp.shard.collectives import SHARDED_BACKENDS

# The optimizers whose update is elementwise, and for each the names of its per-element state
# (every other state entry, e.g. Adam's step, is one value per parameter).
ELEMENTWISE_STATE: dict[type[torch.optim.Optimizer], frozenset[str]] = {
    torch.optim.SGD: frozenset({"momentum_buffer"}),
    torch.optim.Adam: frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    torch.optim.AdamW: frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
}


@dataclass(frozen=True)
class ShardRequest:
    """What the wrapper knows about its configuration that decides whether sharding can work."""

    params: Sequence[torch.Tensor]  # the reduced parameters (the reducer's), in order
    names: Sequence[str]  # their names
    module_params: dict[int, str]  # id -> name (a tied one's first) of every parameter of the wrapped module
    options: dict[str, bool]  # the wrapper's switches that sharding cannot combine with, by name
    comm_hook: str | None  # the registered communication hook's name
    backend: str  # the process group's backend for the parameters' device


# Why each switch cannot be combined with a sharded optimizer.
_INCOMPATIBLE = {
    "overlap": "overlap=True updates whole parameters after an all-reduce; shard=True already overlaps its "
    "updates with the reduce-scatters. Pass one of them",
    "mixed_precision": "mixed_precision reduces every bucket through its own communication hook and casts the "
    "parameters per forward; the reduce-scatter and the all-gather of full-precision shards do neither",
    "gradient_as_bucket_view": "gradient_as_bucket_view makes param.grad a view of the bucket, but only this "
    "rank's shard of it is reduced",
    "delay_all_reduce_named_params": "delayed parameters are all-reduced outside the buckets, so no shard holds them",
    "sparse_gradients": "a sparse gradient has no flat layout to cut into shards",
    "tuned_plan": "bucket_plan='tuned' models an all-reduce and a copy into param.grad, not a reduce-scatter, "
    "an update and an all-gather",
    "skip_all_reduce_unused_params": "a skipped bucket's local gradients would need a local, unsharded update",
    "scaler": "a GradScaler must see every gradient before any update (found Inf/NaN); not supported with shard=True",
    "allow_unsynced": "a step on local gradients would update each rank's shard with different gradients",
}


def check_shardable(optimizer: torch.optim.Optimizer, request: ShardRequest) -> None:
    """Raise ValueError (naming the optimizer, group, option or parameters) unless sharding can work."""
    kind = type(optimizer)
    if kind not in ELEMENTWISE_STATE:
        raise ValueError(
            f"{kind.__name__} cannot be sharded: shard=True supports only optimizers whose update is elementwise "
            f"({', '.join(t.__name__ for t in ELEMENTWISE_STATE)}, not subclasses). Optimizers that read a whole "
            "tensor (LAMB, LARS, Adafactor) or all of them (LBFGS) would see only this rank's pieces. Attach it "
            "without shard=True."
        )
    if request.backend not in SHARDED_BACKENDS:
        raise ValueError(
            f"shard=True supports the {' and '.join(SHARDED_BACKENDS)} backends, not {request.backend}: the "
            "reduce-scatter and all-gather of each bucket are written for theirs. Attach it without shard=True."
        )
    for option, why in _INCOMPATIBLE.items():
        if request.options.get(option, False):
            raise ValueError(f"shard=True cannot be combined with {option}: {why}.")
    if request.comm_hook is not None:
        raise ValueError(
            f"shard=True cannot be combined with the communication hook {request.comm_hook}: each bucket is "
            "reduce-scattered, and a hook's all-reduced result has no place to go."
        )
    for g, group in enumerate(optimizer.param_groups):
        for option in ("fused", "differentiable"):
            if group.get(option):
                raise ValueError(
                    f"{kind.__name__} parameter group {g} has {option}=True, which shard=True does not support "
                    "(a fused kernel, or an autograd graph through the update, on this rank's pieces); create the "
                    f"optimizer with {option}=False."
                )
    _check_parameters(optimizer, request)


def _check_parameters(optimizer: torch.optim.Optimizer, request: ShardRequest) -> None:
    """The optimizer must hold exactly the reduced parameters (frozen ones of the module may be added)."""
    held = {id(p): (g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    foreign = sorted(f"group {g}: shape {tuple(p.shape)}" for i, (g, p) in held.items()
                     if i not in request.module_params)
    if foreign:
        raise ValueError(f"The optimizer holds parameters that are not the model's ({'; '.join(foreign[:4])}).")
    reduced = {id(p) for p in request.params}
    ignored = sorted(request.module_params[i] for i, (_, p) in held.items() if i not in reduced and p.requires_grad)
    if ignored:
        raise ValueError(
            f"The optimizer holds parameters the wrapper ignores ({', '.join(ignored[:4])}); their gradients are "
            "not reduced, so no rank's shard holds them. Step them with a separate optimizer."
        )
    missing = [name for p, name in zip(request.params, request.names, strict=True) if id(p) not in held]
    if missing:
        raise ValueError(
            f"Parameters {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''} receive reduced gradients "
            "but are not in the optimizer: with shard=True no rank holds their full reduced gradient for another "
            "optimizer to step. Put every parameter in this optimizer, or attach without shard=True."
        )
    # A parameter of 0 elements has no memory to cut, whatever its strides (shape (4, 0) has (1, 1)).
    odd = [name for p, name in zip(request.params, request.names, strict=True)
           if p.numel() and not is_dense_permutation(p)]
    if odd:
        raise ValueError(f"Parameters {', '.join(odd[:4])} are not dense in memory; shard=True cuts their memory.")
