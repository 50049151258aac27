"""Which elements of each bucket does a rank own? A pure plan: bucket members and lengths in, pieces out.

Each bucket's flat buffer is padded with zeros to a multiple of the world size and cut into
``world_size`` equal, contiguous shards: rank ``r`` owns elements ``[r * S, (r + 1) * S)``, where
``S = padded_length / world_size``. A parameter occupies one contiguous slot of its bucket, so it
meets a shard in at most one contiguous *piece*; the rank's optimizer updates its pieces. No
collectives, no tensors: every rank computes every rank's plan alike.

A parameter of 0 elements meets no shard, yet DDP's optimizer steps it when it has a gradient (an
empty one, and an entry in its state): it gets an empty piece (length 0) on exactly one rank, so that one inner
optimizer steps it and its state has one home. The owner is the rank whose shard holds the
parameter's offset in the bucket, ``offset // S``; the last rank when the offset is the end of a
bucket without padding (no shard holds it); rank 0 when the bucket has no elements (``S = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in one rank's shard of its bucket."""

    param: int  # index of the parameter (in the reducer's parameter list)
    start: int  # first element of the parameter (in memory order) that the piece holds
    length: int  # number of elements (0 only for a parameter of 0 elements)
    shard_offset: int  # where the piece starts in the rank's shard


@dataclass(frozen=True)
class BucketShard:
    """One rank's shard of one bucket: its length (equal on every rank) and the pieces in it."""

    bucket: int
    padded_length: int  # the bucket's length rounded up to a multiple of the world size
    shard_length: int  # padded_length / world_size
    offsets: tuple[int, ...]  # where each member parameter starts in the bucket (every rank alike)
    pieces: tuple[Piece, ...]


def padded_length(length: int, world_size: int) -> int:
    """``length`` rounded up to a multiple of ``world_size`` (the reduce-scatter needs equal shards)."""
    return -(-length // world_size) * world_size


def plan_bucket(bucket: int, members: Sequence[int], lengths: Sequence[int], world_size: int, rank: int) -> BucketShard:
    """Rank ``rank``'s shard of bucket ``bucket``, whose parameters ``members`` (with ``lengths`` elements
    each) lie back to back in its flat buffer, in that order."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"Expected 0 <= rank < world_size, got rank {rank} and world_size {world_size}.")
    total = sum(lengths)
    padded = padded_length(total, world_size)
    size = padded // world_size
    lo, hi = rank * size, (rank + 1) * size
    pieces, offsets = [], []
    offset = 0
    for param, length in zip(members, lengths, strict=True):
        offsets.append(offset)
        begin, end = max(offset, lo), min(offset + length, hi)
        if begin < end:
            pieces.append(Piece(param, begin - offset, end - begin, begin - lo))
        elif length == 0 and _owner_of_empty(offset, size, world_size) == rank:
            pieces.append(Piece(param, 0, 0, offset - lo))
        offset += length
    return BucketShard(bucket, padded, size, tuple(offsets), tuple(pieces))


def _owner_of_empty(offset: int, shard_length: int, world_size: int) -> int:
    """The rank that holds the empty piece of a 0-element parameter at ``offset`` (see the module's docstring)."""
    return min(offset // shard_length, world_size - 1) if shard_length else 0


def plan_shards(
    buckets: Sequence[Sequence[int]], numels: Sequence[int], world_size: int, rank: int
) -> tuple[BucketShard, ...]:
    """Rank ``rank``'s shard of every bucket; ``numels[i]`` is the length of parameter ``i``."""
    return tuple(
        plan_bucket(b, members, [numels[i] for i in members], world_size, rank) for b, members in enumerate(buckets)
    )
