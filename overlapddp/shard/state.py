"""How does a sharded optimizer's state become the plain optimizer's format, and back?

Each rank's optimizer holds state only for the parameters it owns (and for those the wrapper does
not reduce, which every rank updates itself, as under DDP). ``consolidate`` gathers every owner's
entries into the state dict the same optimizer returns under DDP (a collective); ``owned_part``
cuts such a state dict down to what this rank keeps (no collective).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def consolidate(
    local: dict[str, Any], owners: Sequence[int | None], devices: Sequence[torch.device], rank: int,
    group: dist.ProcessGroup,
) -> dict[str, Any]:
    """The unsharded state dict from this rank's ``local`` one: each owned entry from its owner
    (through the CPU, bit for bit), each entry of an unsharded parameter from this rank."""
    mine = {index: _portable(entry) for index, entry in local["state"].items() if owners[index] == rank}
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    state: dict[int, Any] = {}
    for index, owner in enumerate(owners):
        if owner is None:
            entry = local["state"].get(index)
        else:
            held = everyone[owner].get(index)
            entry = None if held is None else _placed(held, devices[index])
        if entry is not None:
            state[index] = entry
    return {"state": state, "param_groups": local["param_groups"]}


def owned_part(state_dict: dict[str, Any], owners: Sequence[int | None], rank: int) -> dict[str, Any]:
    """``state_dict`` (the unsharded format) with only the entries this rank keeps."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("Expected an optimizer state dict with 'state' and 'param_groups'.")
    keep = {index: entry for index, entry in state_dict["state"].items()
            if not isinstance(index, int) or index >= len(owners) or owners[index] in (None, rank)}
    return {**state_dict, "state": keep}


def _portable(entry: dict[str, Any]) -> dict[str, Any]:
    """Tensors moved to the CPU (pickled for the gather), each marked whether it lived there."""
    return {key: ("tensor", value.cpu(), value.device.type == "cpu") if isinstance(value, torch.Tensor)
            else ("value", value, True) for key, value in entry.items()}


def _placed(entry: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A gathered entry back on the parameter's device (the tensors that lived on the CPU stay there)."""
    return {key: (value if on_cpu else value.to(device)) if kind == "tensor" else value
            for key, (kind, value, on_cpu) in entry.items()}
