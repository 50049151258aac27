"""Moving a sharded optimizer's state to new buckets, without the unsharded state on any rank.

DDP rebuilds its buckets after the first iteration, when the optimizer already holds state (Adam's
moments): each rank's new pieces may lie in any rank's old shards. Going through the unsharded state
dict would put every rank's state on every rank at once (pickled, then unpickled), about N times the
sharded state at the moment memory is tightest. Instead, per old bucket and per-element state entry,
the shards are gathered into one bucket-sized temporary and each rank copies out its new pieces;
the per-parameter entries (Adam's step count) are small and exchanged as objects. Values are copied,
never computed: the state after the move is bit-identical to the state before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
import torch.distributed as dist

from overlapddp.shard.collectives import gather_shards
from overlapddp.shard.layout import BucketShard, Piece


@dataclass(frozen=True)
class HeldShard:
    """One old bucket as this rank held it: its plan, its members, and each piece's state entry."""

    shard: BucketShard
    members: Sequence[int]  # the bucket's parameters, in order (their slots start at shard.offsets)
    entries: Sequence[tuple[Piece, dict[str, Any]]]  # this rank's pieces that have state


def moved_state(
    held: Sequence[HeldShard], new_pieces: Sequence[Piece], elementwise: frozenset[str], device: torch.device,
    group: dist.ProcessGroup, backend: str,
) -> dict[int, dict[str, Any]]:
    """Per parameter of ``new_pieces`` (this rank's pieces of the new buckets) that has state: its
    entry, cut to its new piece. A collective: every rank calls it with its own ``held``."""
    summary: dict[int, tuple[dict[str, Any], dict[str, torch.dtype]]] = {}
    for bucket in held:
        for piece, entry in bucket.entries:
            shared = {k: v for k, v in entry.items() if k not in elementwise}
            dtypes = {k: v.dtype for k, v in entry.items() if k in elementwise}
            summary[piece.param] = (shared, dtypes)
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, summary, group=group)
    known: dict[int, tuple[dict[str, Any], dict[str, torch.dtype]]] = {}
    for rank_summary in everyone:
        known.update(rank_summary)
    wanted = {piece.param: piece for piece in new_pieces if piece.param in known}
    moved: dict[int, dict[str, Any]] = {
        param: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in known[param][0].items()}
        for param in wanted
    }
    for bucket in held:  # the same buckets and keys, in the same order, on every rank
        keys = sorted({k for param in bucket.members if param in known for k in known[param][1]})
        for key in keys:
            dtype = next(known[p][1][key] for p in bucket.members if p in known and key in known[p][1])
            gathered = _gathered(bucket, key, dtype, device, group, backend)
            for slot, param in enumerate(bucket.members):
                new = wanted.get(param)
                if new is not None and key in known[param][1]:
                    start = bucket.shard.offsets[slot] + new.start
                    moved[param][key] = gathered.narrow(0, start, new.length).clone()
    return moved


def _gathered(
    bucket: HeldShard, key: str, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup, backend: str
) -> torch.Tensor:
    """The bucket's flat per-element entry ``key``, every rank's shard gathered (zeros where none)."""
    shard = torch.zeros(bucket.shard.shard_length, dtype=dtype, device=device)
    for piece, entry in bucket.entries:
        if key in entry:
            shard.narrow(0, piece.shard_offset, piece.length).copy_(cast(torch.Tensor, entry[key]))
    gathered = torch.empty(bucket.shard.padded_length, dtype=dtype, device=device)
    # Both made on the current stream, which NCCL's wait orders after the gather: freed after it too.
    gather_shards(gathered, shard, group, backend).wait()
    return gathered
