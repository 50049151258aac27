"""Which collectives shard a bucket, per backend (spawn-free: the collectives are recorded, or run
on a one-rank group). Over NCCL the in-place reduce-scatter and all-gather; over gloo an all-reduce
of the whole bucket and one broadcast per rank (docs/sharded_optimizer.md says why)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from overlapddp.shard import collectives as shard_collectives
from overlapddp.shard.collectives import Broadcasts, gather_shards, reduce_to_shard


class _Group:
    def size(self) -> int:
        return 2


class _Started:
    def get_future(self) -> str:
        return "future"


def test_nccl_reduces_into_this_ranks_shard_and_gathers_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any, Any]] = []
    group = _Group()

    def reduce_scatter(shard: torch.Tensor, buffer: torch.Tensor, **kwargs: Any) -> _Started:
        assert kwargs == {"group": group, "async_op": True}
        calls.append(("reduce_scatter", shard, buffer))
        return _Started()

    def all_gather(gathered: torch.Tensor, shard: torch.Tensor, **kwargs: Any) -> str:
        assert kwargs == {"group": group, "async_op": True}, "started, not run to completion here"
        calls.append(("all_gather", gathered, shard))
        return "work"

    monkeypatch.setattr(shard_collectives, "reduce_scatter_flat", reduce_scatter)
    monkeypatch.setattr(shard_collectives, "all_gather_flat", all_gather)
    buffer = torch.arange(6.0)
    assert reduce_to_shard(buffer, 1, group, "nccl") == "future"  # type: ignore[arg-type, comparison-overlap]
    (name, shard, whole), = calls
    assert name == "reduce_scatter" and whole is buffer
    assert shard.data_ptr() == buffer[3:].data_ptr() and shard.numel() == 3, "rank 1's half, in place"
    shard = torch.ones(3)
    assert gather_shards(buffer, shard, group, "nccl") == "work"  # type: ignore[arg-type, comparison-overlap]
    assert calls[1] == ("all_gather", buffer, shard)


def test_gloo_all_reduces_the_bucket_and_broadcasts_each_shard(one_rank: None) -> None:
    group = dist.group.WORLD
    buffer = torch.arange(4.0)
    reduce_to_shard(buffer, 0, group, "gloo").wait()  # type: ignore[arg-type]
    assert torch.equal(buffer, torch.arange(4.0)), "a one-rank SUM of the whole bucket"
    gathered = torch.zeros(4)
    waitable = gather_shards(gathered, torch.full((4,), 5.0), group, "gloo")  # type: ignore[arg-type]
    assert isinstance(waitable, Broadcasts)
    waitable.wait()
    assert torch.equal(gathered, torch.full((4,), 5.0))


def test_gloo_is_told_apart_by_value_not_identity(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend name reaches these functions from the process group, not as this literal."""
    started: list[str] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: started.append("all_reduce") or all_reduce(*a, **k))
    gloo = "".join(["gl", "oo"])
    reduce_to_shard(torch.ones(2), 0, dist.group.WORLD, gloo).wait()  # type: ignore[arg-type]
    assert isinstance(gather_shards(torch.zeros(2), torch.ones(2), dist.group.WORLD, gloo), Broadcasts)  # type: ignore[arg-type]
    assert started == ["all_reduce"]
