"""How is a sharded optimizer saved and loaded through ``torch.distributed.checkpoint``, each rank
writing and reading only its own pieces, at any world size?

Each per-element state entry of a parameter (``exp_avg``, ``momentum_buffer``, ...) is saved as one
``ShardedTensor`` of the parameter's length (its elements in memory order), whose local shard on a
rank is that rank's piece; per-parameter entries (``step``) are saved as plain tensors by the
ranks that hold a piece. Loading reads the checkpoint's metadata, asks for this rank's pieces under
the current layout (another world size, other buckets) and DCP reads just the overlapping bytes.
Keys: ``state.<parameter name>.<entry>`` and ``param_groups.<group>.<setting>``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from overlapddp.shard.layout import Piece
from overlapddp.shard.optimizer import ShardedOptimizer


def save_sharded(optimizer: ShardedOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Save ``optimizer``'s state with DCP, each rank writing its pieces (a collective: every rank calls it)."""
    group = optimizer.process_group
    mine = optimizer.local_state()
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, sorted({(p.param, key) for p, entry in mine for key in entry}), group=group)
    names = optimizer.param_names
    state: dict[str, dict[str, Any]] = {}
    by_param = {piece.param: (piece, entry) for piece, entry in mine}
    for param, key in sorted(set().union(*map(set, everyone))):  # the same order on every rank
        held = by_param.get(param)
        if key in optimizer.elementwise_keys:
            local = [] if held is None else [(held[0], held[1][key])]
            state.setdefault(names[param], {})[key] = _sharded(local, optimizer.param_numel(param), group)
        elif held is not None:
            state.setdefault(names[param], {})[key] = held[1][key]
    dcp.save({"state": state, "param_groups": optimizer.packed_groups()}, checkpoint_id=checkpoint_id,
             process_group=group)


def load_sharded(optimizer: ShardedOptimizer, checkpoint_id: str | os.PathLike[str]) -> None:
    """Load a :func:`save_sharded` checkpoint into ``optimizer``, whatever world size wrote it (a collective)."""
    group = optimizer.process_group
    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    index_of = {name: i for i, name in enumerate(optimizer.param_names)}
    pieces = {piece.param: piece for piece in optimizer.local_pieces()}
    template: dict[str, dict[str, Any]] = {}
    for key in sorted(k for k in saved if k.startswith("state.")):
        name, entry = key[len("state."):].rsplit(".", 1)
        if name not in index_of:
            raise ValueError(f"The checkpoint has optimizer state for {name}, which this model does not reduce.")
        param, meta = index_of[name], saved[key]
        if not isinstance(meta, TensorStorageMetadata):  # no allowed optimizer keeps non-tensor state
            raise ValueError(f"The checkpoint's {entry!r} of {name} is not a tensor.")
        dtype = meta.properties.dtype
        piece = pieces.get(param)
        if entry in optimizer.elementwise_keys:
            if tuple(meta.size) != (optimizer.param_numel(param),):
                raise ValueError(
                    f"The checkpoint's {entry!r} of {name} has {tuple(meta.size)} elements; "
                    f"the parameter has {optimizer.param_numel(param)}."
                )
            local = [] if piece is None else [(piece, torch.zeros(piece.length, dtype=dtype))]
            template.setdefault(name, {})[entry] = _sharded(local, optimizer.param_numel(param), group)
        else:  # every key, held here or not: DCP reads a partial request as a pre-2.4 checkpoint's
            template.setdefault(name, {})[entry] = torch.zeros(meta.size, dtype=dtype)
    loaded: dict[str, Any] = {"state": template, "param_groups": optimizer.packed_groups()}
    # Keep the ShardedTensors whole: flattening drops those with no local shard (a rank that holds no
    # piece of that parameter), and DCP then reads the remaining request as a pre-2.4 checkpoint's.
    planner = dcp.DefaultLoadPlanner(flatten_sharded_tensors=False)
    dcp.load(loaded, checkpoint_id=checkpoint_id, process_group=group, planner=planner)
    names = optimizer.param_names

    def entry_of(piece: Piece) -> dict[str, Any] | None:
        values = template.get(names[piece.param])
        if values is None:
            return None
        return {key: value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value
                for key, value in values.items()}

    optimizer.install(loaded["param_groups"], entry_of, any(k.startswith("state.") for k in saved))


def _sharded(local: list[tuple[Piece, torch.Tensor]], numel: int, group: dist.ProcessGroup) -> ShardedTensor:
    """One parameter's per-element entry across ranks: this rank's piece (if any) as its local shard."""
    rank = dist.get_rank(group)
    shards = [
        Shard(value, ShardMetadata([piece.start], [piece.length], f"rank:{rank}/{value.device}"))
        for piece, value in local
    ]
    return init_from_local_shards(shards, numel, process_group=group)
