"""``device_context`` and ``side_stream`` off CUDA: nothing to make current, nothing to order."""

from __future__ import annotations

import contextlib

import pytest
import torch

from overlapddp.device_streams import device_context, side_stream


@pytest.mark.parametrize("device", ["cpu", "meta", "mps", "xpu"])
def test_only_a_cuda_device_is_made_current(device: str) -> None:
    context = device_context(torch.device(device))
    assert isinstance(context, contextlib.nullcontext)
    with context:
        pass


def test_a_disabled_side_stream_runs_the_block_where_it_is() -> None:
    ran = []
    with side_stream(False):
        ran.append(True)
    assert ran == [True]
