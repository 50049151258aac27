"""Loops beyond forward-backward-step, bit-equal to stock DDP (see tests/support/loops.py for each case):
GAN steps with BatchNorm buffers broadcast at every forward, and reentrant activation checkpointing
with ``find_unused_parameters=True``: a layer in two segments, unused layers, no_sync accumulation."""

from __future__ import annotations

import pytest
import torch

from overlapddp import OverlapDDP
from overlapddp.reducer import GraphMode
from tests.support import loops
from tests.support.multiprocess import run_ranks

CASES = [case.name for case in loops.GAN_CASES + loops.CHECKPOINT_CASES]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gan_steps_and_reentrant_checkpoints_match_ddp(world_size):
    per_rank = run_ranks(world_size, loops.run_every_loop)
    for rank, found in enumerate(per_rank):
        assert sorted(found) == sorted(CASES)
        differing = {name: what for name, what in found.items() if what is not None}
        assert not differing, f"rank {rank}: {differing}"


def test_a_layer_in_two_reentrant_checkpoints_without_the_flag_is_named_with_the_fix(one_rank):
    model = OverlapDDP(loops.Segmented(reentrant=True, shared=True))
    with pytest.raises(RuntimeError, match=r"(?s)Parameter shared\.\w+ .*twice.*find_unused_parameters=True"):
        model(torch.ones(2, 8), False).sum().backward()


def test_a_framework_armed_backward_through_a_reentrant_checkpoint_is_refused(one_rank):
    model = OverlapDDP(loops.Segmented(reentrant=True, shared=True), find_unused_parameters=True)
    model.require_backward_grad_sync = False
    out = model(torch.ones(2, 8), False)
    with pytest.raises(RuntimeError, match="Lightning: with find_unused_parameters=True and a reentrant checkpoint"):
        model.arm_backward([out], caller="Lightning")



class _CheckpointedActivation(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(torch.tanh, x, use_reentrant=True)


def test_a_reentrant_checkpoint_over_no_parameter_keeps_the_overlapped_path(one_rank):
    """A checkpointed activation hides no parameter: the backward reduces as it goes, as DDP's does."""
    model = OverlapDDP(torch.nn.Sequential(torch.nn.Linear(4, 4), _CheckpointedActivation()),
                       find_unused_parameters=True)
    out = model(torch.randn(2, 4))
    assert model._reducer.mode is GraphMode.OVERLAP
    out.sum().backward()
    assert model.module[0].weight.grad is not None
