"""The multi-process harness fails fast and says where: a hung run names the test, the ranks that
did not finish, where they hung, and what the finished ranks returned."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.multiprocess import TIMEOUT_SCALE_ENV, run_ranks


def _rank_1_sleeps_forever(rank: int, world_size: int) -> str:
    if rank == 1:
        time.sleep(600)
    return f"rank {rank} is done"


def _rank_1_exits_silently(rank: int, world_size: int) -> str:
    if rank == 1:
        os._exit(3)
    return f"rank {rank} is done"


def test_a_hung_rank_fails_within_the_timeout_naming_the_test_rank_and_stack(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, _rank_1_sleeps_forever, timeout_s=5)
    message = str(failure.value)
    assert message.startswith("tests/test_multiprocess.py::test_a_hung_rank_fails_within_the_timeout")
    assert "ranks [1] did not finish within 5 s" in message
    hung = message.split("--- rank 1 hung here:")[1]
    assert "in _rank_1_sleeps_forever" in hung.split("--- rank 0")[0]
    assert "--- rank 0 finished (ok):\n'rank 0 is done'" in message


def test_a_rank_that_exits_without_a_result_fails_at_once_with_its_exit_code(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    with pytest.raises(AssertionError, match=r"ranks \[1\] exited without a result \(rank 1: exit code 3\)"):
        run_ranks(2, _rank_1_exits_silently, timeout_s=600)  # fails at once, not after the timeout


def test_the_timeout_scale_stretches_every_timeout(monkeypatch):
    from tests.support.multiprocess import scaled_timeout

    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "2.5")
    assert scaled_timeout(180) == 450
