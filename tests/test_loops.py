"""Loops beyond forward-backward-step, bit-equal to stock DDP (see tests/loops.py for each case):
GAN steps with BatchNorm buffers broadcast at every forward, and reentrant activation checkpointing
with ``find_unused_parameters=True``: a layer in two segments, unused layers, no_sync accumulation."""

from __future__ import annotations

import pytest

from tests import loops
from tests.multiprocess import run_ranks

CASES = [case.name for case in loops.GAN_CASES + loops.CHECKPOINT_CASES]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gan_steps_and_reentrant_checkpoints_match_ddp(world_size):
    per_rank = run_ranks(world_size, loops.run_every_loop)
    for rank, found in enumerate(per_rank):
        assert sorted(found) == sorted(CASES)
        differing = {name: what for name, what in found.items() if what is not None}
        assert not differing, f"rank {rank}: {differing}"
