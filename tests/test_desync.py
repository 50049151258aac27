"""A desync names the rank: when a rank is behind (it skipped a backward, ran fewer iterations, died,
or is stuck), the ranks waiting on it raise within the process group's timeout, naming it, where it
is, and what they waited for (from the progress records in the process group's store)."""

from __future__ import annotations

import copy
import os
import time

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import run_ranks


def _train(rank: int, world_size: int, behaviour: str) -> str:
    """Four iterations of the MLP (no buffers, so nothing but the buckets is exchanged); on rank 0
    (skip) or rank 1 (stuck, die) the second iteration goes wrong."""
    model = OverlapDDP(models.build("mlp"))
    if behaviour.endswith("after_copy"):  # a copy is built the constructor's way: it keeps the records
        model, behaviour = copy.deepcopy(model), behaviour.removesuffix("_after_copy")
    for iteration in range(4):
        inputs, target = models.batch("mlp", rank, iteration)
        loss = models.loss_of(model(inputs), target)
        if iteration == 1 and behaviour == "skip" and rank == 0:
            continue  # a data-dependent skip on one rank
        if iteration == 1 and rank == 1 and behaviour == "stuck":
            time.sleep(10)  # longer than the process group's timeout and the others' grace
        if iteration == 1 and rank == 1 and behaviour == "die":
            os._exit(3)
        try:
            loss.backward()
        except RuntimeError as error:
            return str(error)
    return "finished"


def test_a_rank_that_skipped_a_backward_is_named_by_every_waiting_rank():
    said = run_ranks(3, _train, "skip", pg_timeout_s=20)
    assert said[0] == "finished"  # one backward short, it ends first; the others wait for its 4th
    for rank in (1, 2):
        assert "Ranks behind: rank 0: at iteration 4" in said[rank], said[rank]
        assert "3 backwards reduced" in said[rank]
        assert "1 more forward(s) without a backward than this rank, the last at iteration 2" in said[rank]
        assert f"rank {rank} waited for bucket 0 of backward 4 (iteration 4)" in said[rank]
        assert f"rank {3 - rank}:" not in said[rank]  # the other waiting rank is not behind


def test_a_copy_still_names_the_rank_behind():
    said = run_ranks(2, _train, "skip_after_copy", pg_timeout_s=20)
    assert "Ranks behind: rank 0: at iteration 4" in said[1], said[1]


def test_a_stuck_rank_is_named_within_the_timeout():
    started = time.monotonic()
    said = run_ranks(2, _train, "stuck", pg_timeout_s=6)
    assert time.monotonic() - started < 60
    assert "Ranks behind: rank 1: at iteration 2 (forward ran, its backward not reduced, not waiting on a bucket; " \
           "1 backwards reduced)" in said[0], said[0]
    assert "rank 0 waited for bucket 0 of backward 2 (iteration 2)" in said[0]


def test_a_rank_that_died_is_named():
    said = run_ranks(2, _train, "die", pg_timeout_s=20, dying=frozenset({1}))
    assert "Ranks behind: rank 1: at iteration 2 (forward ran, its backward not reduced" in said[0], said[0]


def _watch_rank_0_wait(rank: int, world_size: int) -> object:
    """Rank 1 holds back its second backward until rank 0's record says it waits for a bucket
    (at most 30 s), then runs it: what rank 1 read, or None if rank 0 never said so."""
    model = OverlapDDP(models.build("mlp"))
    seen = None
    for iteration in range(2):
        inputs, target = models.batch("mlp", rank, iteration)
        loss = models.loss_of(model(inputs), target)
        if iteration == 1 and rank == 1:
            deadline = time.monotonic() + 30
            while seen is None and time.monotonic() < deadline:
                record = model._reducer.progress._others()[0]
                seen = record.waiting if record is not None else None
                time.sleep(0.05)
        loss.backward()
    return seen


def test_a_rank_really_waiting_for_a_bucket_says_so_in_its_record():
    """Rank 0 cannot finish its second backward before rank 1 starts its own: its record must say
    which bucket of which backward it waits for while it waits, not only once the collective is done."""
    seen = run_ranks(2, _watch_rank_0_wait)
    assert seen[1] == (2, 0), seen
