"""Rank 0's model on every rank, on one rank and with other ranks stood in for: how broadcasts are
chunked and grouped, what they write back, and the error every rank raises for a different model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlapddp import module_sync
from overlapddp.module_sync import _chunks, broadcast_coalesced, gather_objects, verify_same_parameters


def test_chunks_close_before_a_tensor_that_would_pass_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module_sync, "BROADCAST_BUCKET_BYTES", 16)
    a, b, c, big, d = torch.zeros(2), torch.zeros(2), torch.zeros(1), torch.zeros(8), torch.zeros(1)  # 8, 8, 4, 32, 4 B
    sizes = [[t.numel() for t in chunk] for chunk in _chunks([a, b, c, big, d])]
    assert sizes == [[2, 2], [1], [8], [1]], "16 bytes fit exactly; a tensor over the limit goes alone"
    assert _chunks([]) == [[]]


def test_the_default_limit_puts_a_small_model_in_one_broadcast(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    original = module_sync.broadcast_from
    monkeypatch.setattr(module_sync, "broadcast_from", lambda flat, src, group: (sent.append(flat.numel()), original(flat, src, group)))
    tensors = [torch.full((3,), 1.0), torch.full((2, 2), 2.0), torch.arange(4), torch.full((1,), 3.0)]
    broadcast_coalesced(tensors, 0, dist.group.WORLD)
    assert sent == [8, 4], "one broadcast per dtype: float32 (3 + 4 + 1 elements), int64"
    assert tensors[1].tolist() == [[2.0, 2.0], [2.0, 2.0]] and tensors[2].tolist() == [0, 1, 2, 3]


def test_each_tensor_gets_its_own_piece_of_the_broadcast_back(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module_sync, "broadcast_from", lambda flat, src, group: flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype)))
    first, second = torch.zeros(2, 2), torch.zeros(3)
    broadcast_coalesced([first, second], 0, dist.group.WORLD)
    assert first.tolist() == [[0.0, 1.0], [2.0, 3.0]] and second.tolist() == [4.0, 5.0, 6.0]


def test_every_rank_is_gathered_in_rank_order(one_rank: None) -> None:
    assert gather_objects({"rank": 0}, dist.group.WORLD, torch.device("cpu")) == [{"rank": 0}]


def test_one_parameter_is_enough_to_check(one_rank: None) -> None:
    verify_same_parameters(["only.weight"], [torch.zeros(2, 3)], dist.group.WORLD)


def _ranks(monkeypatch: pytest.MonkeyPatch, *others: list[tuple]) -> None:
    """Other ranks' descriptions (rank 0's own comes first), as gather_objects would return them."""
    monkeypatch.setattr(module_sync, "gather_objects", lambda mine, group, device: [mine, *others])


def test_a_rank_with_another_parameter_count_is_named_with_both_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [torch.zeros(2), torch.zeros(3)]
    mine = [("a", (2,), (1,), "torch.float32"), ("b", (3,), (1,), "torch.float32")]
    _ranks(monkeypatch, mine, mine[:1])
    with pytest.raises(RuntimeError, match="rank 2 has 1 parameters that require grad while rank 0 has 2"):
        verify_same_parameters(["a", "b"], params, None)  # type: ignore[arg-type]


def test_the_first_differing_parameter_is_described_on_both_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [torch.zeros(2), torch.zeros(3)]
    mine = [("a", (2,), (1,), "torch.float32"), ("b", (3,), (1,), "torch.float32")]
    _ranks(monkeypatch, mine, [mine[0], ("b", (3, 1), (1, 1), "torch.float64")])
    with pytest.raises(RuntimeError) as raised:
        verify_same_parameters(["a", "b"], params, None)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "OverlapDDP expects the same model on every rank, but parameter 1 differs: rank 0 has b with shape [3], "
        "strides [1], dtype torch.float32, rank 2 has b with shape [3, 1], strides [1, 1], dtype torch.float64."
    )


def test_the_same_model_everywhere_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [torch.zeros(2, 3).t()]
    _ranks(monkeypatch, [("w", (3, 2), (1, 3), "torch.float32")])
    verify_same_parameters(["w"], params, None)  # type: ignore[arg-type]


def test_a_chunk_after_a_break_starts_from_zero_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte-sized tensors land exactly on the limit: a running size off by one moves a tensor."""
    monkeypatch.setattr(module_sync, "BROADCAST_BUCKET_BYTES", 16)
    tensors = [torch.zeros(n, dtype=torch.uint8) for n in (8, 8, 1, 16)]
    assert [[t.numel() for t in chunk] for chunk in _chunks(tensors)] == [[8, 8], [1], [16]]
    just_fits = [torch.zeros(n, dtype=torch.uint8) for n in (8, 8, 1, 15)]
    assert [[t.numel() for t in chunk] for chunk in _chunks(just_fits)] == [[8, 8], [1, 15]]


def test_a_rank_with_more_parameters_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = [("a", (2,), (1,), "torch.float32")]
    _ranks(monkeypatch, mine + [("b", (3,), (1,), "torch.float32")])
    with pytest.raises(RuntimeError, match="rank 1 has 2 parameters that require grad while rank 0 has 1"):
        verify_same_parameters(["a"], [torch.zeros(2)], None)  # type: ignore[arg-type]


def test_a_parameter_that_sorts_before_rank_0s_is_a_difference_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _ranks(monkeypatch, [("a", (1,), (1,), "torch.float32")])
    with pytest.raises(RuntimeError, match="parameter 0 differs: rank 0 has a with shape \\[2\\]"):
        verify_same_parameters(["a"], [torch.zeros(2)], None)  # type: ignore[arg-type]


def test_a_model_of_more_than_256_parameters_is_compared_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts past the ints Python caches are different objects: only equality may compare them."""
    params = [torch.zeros(1) for _ in range(300)]
    names = [f"p{i}" for i in range(300)]
    _ranks(monkeypatch, [(n, (1,), (1,), "torch.float32") for n in names])
    verify_same_parameters(names, params, None)  # type: ignore[arg-type]


def test_the_default_chunk_holds_250_mib_exactly() -> None:
    """DDP's broadcast bucket size, to the byte; meta tensors have sizes and no memory."""
    quarter_gib = 125 * 1024 * 1024 // 4  # float32 elements in 125 MiB
    half, byte = torch.empty(quarter_gib, device="meta"), torch.empty(1, dtype=torch.uint8, device="meta")
    assert [len(chunk) for chunk in _chunks([half, half, byte, half])] == [2, 2], "one byte past the limit"
