"""Shard planning: pieces recomputed element by element, independently of the planner."""

from __future__ import annotations

import random

import pytest

from overlapddp.shard.layout import Piece, padded_length, plan_bucket, plan_shards


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


# -- parameters of 0 elements: one empty piece each, on one rank -----------------------------------


def _owner_by_definition(offset: int, total: int, world_size: int) -> int:
    """The rank whose shard ``[r * S, (r + 1) * S)`` holds ``offset``; past every shard the last rank;
    in a bucket of no elements rank 0."""
    size = -(-total // world_size)
    holders = [rank for rank in range(world_size) if rank * size <= offset < (rank + 1) * size]
    return holders[0] if holders else (world_size - 1 if size else 0)


def _pieces_per_rank(lengths: list[int], world_size: int) -> list[tuple[Piece, ...]]:
    return [plan_bucket(0, list(range(len(lengths))), lengths, world_size, rank).pieces for rank in range(world_size)]


@pytest.mark.parametrize("lengths, world_size, expected", [
    ([0, 5, 0, 3, 0], 1, [(Piece(0, 0, 0, 0), Piece(1, 0, 5, 0), Piece(2, 0, 0, 5), Piece(3, 0, 3, 5), Piece(4, 0, 0, 8))]),
    # 8 elements, shards of 4: the last offset (8) is the end of the last shard, held by no rank
    ([0, 5, 0, 3, 0], 2, [(Piece(0, 0, 0, 0), Piece(1, 0, 4, 0)),
                          (Piece(1, 4, 1, 0), Piece(2, 0, 0, 1), Piece(3, 0, 3, 1), Piece(4, 0, 0, 4))]),
    # padded to 9, shards of 3: the last offset (8) lies in rank 2's shard, in front of its padding
    ([0, 5, 0, 3, 0], 3, [(Piece(0, 0, 0, 0), Piece(1, 0, 3, 0)),
                          (Piece(1, 3, 2, 0), Piece(2, 0, 0, 2), Piece(3, 0, 1, 2)),
                          (Piece(3, 1, 2, 0), Piece(4, 0, 0, 2))]),
    ([4, 0, 4], 2, [(Piece(0, 0, 4, 0),), (Piece(1, 0, 0, 0), Piece(2, 0, 4, 0))]),  # on a cut: the next rank
    ([0, 0], 1, [(Piece(0, 0, 0, 0), Piece(1, 0, 0, 0))]),  # a bucket of no elements: rank 0
    ([0, 0], 2, [(Piece(0, 0, 0, 0), Piece(1, 0, 0, 0)), ()]),
    ([0, 0], 3, [(Piece(0, 0, 0, 0), Piece(1, 0, 0, 0)), (), ()]),
], ids=["start-middle-end-1", "start-middle-end-2", "start-middle-end-3", "on-a-cut-2", "only-empty-1",
        "only-empty-2", "only-empty-3"])
def test_a_parameter_of_0_elements_has_one_empty_piece_on_the_rank_whose_shard_holds_its_offset(
    lengths, world_size, expected
):
    assert _pieces_per_rank(lengths, world_size) == expected


@pytest.mark.parametrize("world_size", (1, 2, 3, 5))
def test_every_parameter_of_0_elements_has_exactly_one_empty_piece_within_its_owners_shard(world_size):
    rng = random.Random(100 + world_size)
    for _ in range(50):
        lengths = [rng.choice((0, 0, rng.randint(1, 12))) for _ in range(rng.randint(1, 8))]
        shards = [plan_bucket(7, list(range(len(lengths))), lengths, world_size, r) for r in range(world_size)]
        for param, length in enumerate(lengths):
            if length:
                continue
            offset = sum(lengths[:param])
            held = [(rank, piece) for rank, shard in enumerate(shards) for piece in shard.pieces if piece.param == param]
            owner = _owner_by_definition(offset, sum(lengths), world_size)
            size = shards[0].shard_length
            assert held == [(owner, Piece(param, 0, 0, offset - owner * size))], (lengths, param)
            assert 0 <= offset - owner * size <= size


def test_the_owner_of_an_empty_parameter_is_found_past_the_small_int_cache() -> None:
    """Ranks are compared by value: with 300 ranks the last one owns an empty parameter ending a bucket."""
    last = plan_bucket(0, [0, 1], [300, 0], 300, int("299"))
    assert last.pieces == (Piece(0, 299, 1, 0), Piece(1, 0, 0, 1))
