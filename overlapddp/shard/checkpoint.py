"""How is a sharded optimizer saved and loaded through ``torch.distributed.checkpoint``, each rank
writing and reading only the parameters it owns, at any world size?

Every state entry is saved whole, by its owner, under ``state.<parameter name>.<entry>``; the groups'
settings under ``param_groups.<group>.<setting>`` (by rank 0, as the entries of parameters that
every rank updates itself). Loading asks for the entries of the parameters this rank owns under the
current plan (another world size gives other owners), so DCP reads just those bytes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from overlapddp.shard.optimizer import ShardedOptimizer


def save_sharded(optimizer: ShardedOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Save ``optimizer``'s state with DCP, each rank writing what it owns (a collective: every rank calls it)."""
    local = optimizer.local_state_dict()
    flat: dict[str, Any] = {}
    for index, entry in local["state"].items():
        owner = optimizer.owner_of(index)
        if owner == optimizer.rank or (owner is None and optimizer.rank == 0):
            flat |= {f"state.{optimizer.param_names[index]}.{key}": value for key, value in entry.items()}
    if optimizer.rank == 0:
        for g, group in enumerate(local["param_groups"]):
            flat |= {f"param_groups.{g}.{key}": value for key, value in group.items() if key != "params"}
    dcp.save(flat, checkpoint_id=checkpoint_id, process_group=optimizer.process_group)


def load_sharded(optimizer: ShardedOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Load a :func:`save_sharded` checkpoint into ``optimizer``, whatever world size wrote it (a collective)."""
    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    index_of = {name: i for i, name in enumerate(optimizer.param_names)}
    request: dict[str, Any] = {}
    for key, meta in saved.items():
        if key.startswith("state."):
            name = key[len("state."):].rsplit(".", 1)[0]
            if name not in index_of:
                raise ValueError(f"The checkpoint has optimizer state for {name}, which this optimizer does not hold.")
            if optimizer.owner_of(index_of[name]) not in (None, optimizer.rank):
                continue
        elif not key.startswith("param_groups."):
            raise ValueError(f"{key} is not a key that save_sharded writes.")
        if isinstance(meta, TensorStorageMetadata):
            request[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        else:  # a setting, or a state entry that is no tensor: DCP puts the saved object here
            request[key] = None
    dcp.load(request, checkpoint_id=checkpoint_id, process_group=optimizer.process_group)
    groups = optimizer.local_state_dict()["param_groups"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in request.items():
        head, rest = key.split(".", 1)
        owner_key, entry = rest.rsplit(".", 1)
        if head == "state":
            state.setdefault(index_of[owner_key], {})[entry] = value
        elif int(owner_key) >= len(groups):
            raise ValueError(f"The checkpoint has parameter group {owner_key}; the optimizer has {len(groups)}.")
        else:
            groups[int(owner_key)][entry] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
