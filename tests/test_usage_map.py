"""The parameter-usage flags alone (no spawn): when ``settle`` waits for the flags' all-reduce, and
what ``globally_used`` reads. A pending reduction is a future nobody has completed yet."""

from __future__ import annotations

import threading

import pytest
import torch

from overlapddp.param_usage import UsageMap

SETTLE_WAIT_S = 1.0  # how long a settle that must wait is given to (wrongly) return, on a loaded machine


def _map_with_pending_reduction() -> tuple[UsageMap, torch.futures.Future]:
    usage = UsageMap(3, torch.device("cpu"))
    pending: torch.futures.Future = torch.futures.Future()
    usage._reduction = pending
    return usage, pending


def test_settle_waits_for_a_reduction_nobody_read():
    usage, pending = _map_with_pending_reduction()
    settler = threading.Thread(target=usage.settle)
    settler.start()
    settler.join(SETTLE_WAIT_S)
    assert settler.is_alive(), "settle returned while the flags' all-reduce was still running"
    pending.set_result([torch.tensor([0, 1, 0], dtype=torch.int32)])
    settler.join()


def test_settle_does_not_wait_once_the_result_was_read_or_without_a_reduction():
    usage, pending = _map_with_pending_reduction()
    usage._global = [0, 1, 0]  # finalize read it already
    usage.settle()  # returns although ``pending`` never completes
    UsageMap(3, torch.device("cpu")).settle()  # nothing launched: nothing to wait for


def test_globally_used_reads_the_local_flag_first_then_the_summed_counts_once():
    usage, pending = _map_with_pending_reduction()
    usage.mark_used(2)
    assert usage.globally_used(2)  # local: no wait
    pending.set_result([torch.tensor([0, 1, 1], dtype=torch.int32)])
    assert (usage.globally_used(0), usage.globally_used(1)) == (False, True)
    assert usage._global == [0, 1, 1]


def test_globally_used_without_a_launched_reduction_says_so():
    with pytest.raises(RuntimeError, match="never launched"):
        UsageMap(2, torch.device("cpu")).globally_used(0)


def test_a_map_of_no_parameters_sends_no_flags():
    usage = UsageMap(0, torch.device("cpu"))
    assert usage._local.numel() == 0 and usage._sent.numel() == 0
