"""Shard planning: pieces recomputed element by element, independently of the planner."""

from __future__ import annotations

import random

import pytest

from overlapddp.shard_layout import Piece, padded_length, plan_bucket, plan_shards


def _owners_element_by_element(lengths: list[int], world_size: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(parameter, element) -> (rank, position in its shard), from the definition: equal padded shards."""
    size = -(-sum(lengths) // world_size)
    owners, flat = {}, 0
    for param, length in enumerate(lengths):
        for element in range(length):
            owners[(param, element)] = (flat // size, flat % size)
            flat += 1
    return owners


@pytest.mark.parametrize("world_size", (1, 2, 3, 5))
def test_pieces_cover_every_element_once_at_its_place(world_size):
    rng = random.Random(world_size)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        expected = _owners_element_by_element(lengths, world_size)
        found = {}
        for rank in range(world_size):
            shard = plan_bucket(7, list(range(len(lengths))), lengths, world_size, rank)
            assert shard.padded_length % world_size == 0 and shard.padded_length - sum(lengths) < world_size
            assert shard.shard_length * world_size == shard.padded_length
            for piece in shard.pieces:
                assert piece.length > 0 and piece.shard_offset + piece.length <= shard.shard_length
                for k in range(piece.length):
                    key = (piece.param, piece.start + k)
                    assert key not in found, f"element {key} owned twice"
                    found[key] = (rank, piece.shard_offset + k)
        assert found == expected


def test_offsets_and_member_indices_follow_the_bucket():
    shards = plan_shards([[4, 1], [0, 2, 3]], [3, 5, 2, 1, 6], world_size=2, rank=1)
    assert [s.offsets for s in shards] == [(0, 6), (0, 3, 5)]
    assert shards[0].pieces == (Piece(1, 0, 5, 0),)  # 11 elements, padded to 12: rank 1 owns 6..11, one of them pad
    assert shards[1].pieces == (Piece(2, 0, 2, 0), Piece(3, 0, 1, 2))


def test_padding_and_bad_ranks():
    assert [padded_length(n, 3) for n in (1, 3, 4, 6)] == [3, 3, 6, 6]
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        plan_bucket(0, [0], [4], world_size=2, rank=2)


@pytest.mark.parametrize("world_size, rank", [(0, 0), (2, -1), (2, 2), (3, 5)])
def test_a_rank_outside_the_world_is_refused(world_size, rank):
    with pytest.raises(ValueError, match=f"got rank {rank} and world_size {world_size}"):
        plan_bucket(0, [0], [4], world_size, rank)
