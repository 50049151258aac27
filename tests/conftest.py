"""Shared fixtures."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank():
    """A real one-rank gloo group in the test process, for checks that need no peer (one per module)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The stream model patches torch.Tensor and torch.cuda while it runs: its tests go first, before
    another test of this process can have left state behind in torch."""
    items.sort(key=lambda item: item.path.name != "test_streams.py")
