"""Which tensors does a collective write, and which does it only read?

Every collective ``torch.distributed`` issues from Python reaches one method of the process group
(``dist.all_reduce`` calls ``group.allreduce``, ``dist.all_gather_into_tensor`` calls
``group.all_gather_single``, DDP's comm hooks and OverlapDDP call the same functions). This table
names each method's user-facing collective and splits its tensor arguments into outputs (written:
a read before completion sees an unfinished result) and inputs (only read: a write before completion
changes what is sent). Collectives issued from C++ (DDP's own reducer without a comm hook,
``_broadcast_coalesced``) never reach these methods and are not seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Method:
    """One process-group method: the collective users call, and where its outputs and inputs are.

    ``outputs``/``inputs``: positional indices of the arguments holding tensors (a tensor, a list,
    or a list of lists). ``in_place``: the outputs are read too (all-reduce, broadcast).
    ``rooted``: only the root rank's tensor is written (``broadcast``) or only it receives (``reduce``).
    """

    op: str
    outputs: tuple[int, ...]
    inputs: tuple[int, ...] = ()
    rooted: str = ""


METHODS: dict[str, Method] = {
    "allreduce": Method("all_reduce", (0,), (0,)),
    "allreduce_coalesced": Method("all_reduce_coalesced", (0,), (0,)),
    "broadcast": Method("broadcast", (0,), (0,), rooted="broadcast"),
    "reduce": Method("reduce", (0,), (0,), rooted="reduce"),
    "allgather": Method("all_gather", (0,), (1,)),
    "allgather_coalesced": Method("all_gather_coalesced", (0,), (1,)),
    "all_gather_single": Method("all_gather_into_tensor", (0,), (1,)),
    "_allgather_base": Method("all_gather_into_tensor", (0,), (1,)),
    "allgather_into_tensor_coalesced": Method("all_gather_into_tensor_coalesced", (0,), (1,)),
    "all_gather_single_coalesced": Method("all_gather_into_tensor_coalesced", (0,), (1,)),
    "reduce_scatter": Method("reduce_scatter", (0,), (1,)),
    "reduce_scatter_single": Method("reduce_scatter_tensor", (0,), (1,)),
    "_reduce_scatter_base": Method("reduce_scatter_tensor", (0,), (1,)),
    "reduce_scatter_tensor_coalesced": Method("reduce_scatter_tensor_coalesced", (0,), (1,)),
    "reduce_scatter_single_coalesced": Method("reduce_scatter_tensor_coalesced", (0,), (1,)),
    "all_to_all_single": Method("all_to_all_single", (0,), (1,)),
    "alltoall_base": Method("all_to_all_single", (0,), (1,)),
    "alltoall": Method("all_to_all", (0,), (1,)),
}


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of an argument: a tensor, or a (nested) list or tuple of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def _root(args: tuple[Any, ...]) -> int | None:
    """The root rank (in the group) of a rooted collective: its options' ``rootRank``."""
    for arg in args[1:]:
        root = getattr(arg, "rootRank", None)
        if root is not None:
            return int(root)
    return None


def split(method: Method, args: tuple[Any, ...], group_rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs, inputs-only) of one call: the tensors it writes, and those it only reads.

    A broadcast's root only sends, and a reduce's non-root ranks only send: their tensors are inputs.
    """
    outputs = [t for i in method.outputs if i < len(args) for t in tensors_in(args[i])]
    inputs = [t for i in method.inputs if i < len(args) for t in tensors_in(args[i])]
    if method.rooted:
        root = _root(args)
        sends_only = (root == group_rank) if method.rooted == "broadcast" else (root != group_rank)
        if root is not None and sends_only:
            return [], outputs
    ids = {id(t) for t in outputs}
    return outputs, [t for t in inputs if id(t) not in ids]
