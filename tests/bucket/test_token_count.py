"""The token count on one process (a one-rank group): what ``count_tokens`` accepts, which devices
get the CUDA path, and that path's read of the reduced count (through the recording kit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlapddp.bucket.token_weighting import TokenCount
from overlapddp.device_streams import CudaKit
from tests.support.fake_cuda import RecordingKit


def test_counts_are_non_negative_ints() -> None:
    count = TokenCount(torch.device("cpu"))
    count.add(0)  # a micro-batch without tokens (all padding) is allowed
    count.add(5)
    assert count.local == 5
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="count_tokens expects a non-negative int"):
            count.add(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "meta", "mps"])
def test_only_cuda_devices_get_the_cuda_kit(device: str) -> None:
    assert TokenCount(torch.device(device))._kit is None
    assert isinstance(TokenCount(torch.device("cuda", 0))._kit, CudaKit)


def test_the_cuda_path_reads_the_count_copied_to_the_host(one_rank: None) -> None:
    kit = RecordingKit()
    count = TokenCount(torch.device("cpu"), kit=kit)  # type: ignore[arg-type]
    count.add(7)
    count.launch(dist.group.WORLD)  # type: ignore[arg-type]
    assert count.local == 0
    assert count.total(rank=0) == 7.0
    count.add(2)
    count.launch(dist.group.WORLD)  # type: ignore[arg-type]
    assert count.total(rank=0) == 2.0
    assert [c for c in kit.calls if c[0] == "wait_future"] == [("wait_future", "side1", "collective")] * 2, (
        "both counts reduced on the one side stream made at the first launch")
    with pytest.raises(RuntimeError, match="The token count was not launched for this backward"):
        count.total(rank=0)  # each launch is read once


def test_a_backward_with_no_token_on_any_rank_is_refused(one_rank: None) -> None:
    count = TokenCount(torch.device("cpu"))
    count.add(1)
    count.launch(dist.group.WORLD)  # type: ignore[arg-type]
    assert count.total(rank=0) == 1.0, "one token is a count"
    count.add(0)
    count.launch(dist.group.WORLD)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no rank counted any tokens for this backward"):
        count.total(rank=0)
    with pytest.raises(RuntimeError, match="The token count was not launched for this backward"):
        count.total(rank=0)
