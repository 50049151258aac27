"""torch.compile, both ways round, bit-equal to the same form with DDP.

``OverlapDDP(torch.compile(model))`` matches ``DDP(torch.compile(model))`` and
``torch.compile(OverlapDDP(model))`` matches ``torch.compile(DDP(model))`` (the two DDP forms differ
from each other from the second step on, so each needs its own reference).

The ``aot_eager`` backend runs the real Dynamo and AOTAutograd path (graph capture, the compiled
backward, the post-accumulate-grad hooks firing from it) without Inductor's C++ build time.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests import models
from tests.multiprocess import SLOW_TIMEOUT_S, run_ranks


def _compiled_parity(rank: int, world_size: int, outer: bool) -> list[bool]:
    if outer:
        ddp = torch.compile(DistributedDataParallel(models.build("cnn_bn")), backend="aot_eager")
        ours = torch.compile(OverlapDDP(models.build("cnn_bn")), backend="aot_eager")
    else:
        ddp = DistributedDataParallel(torch.compile(models.build("cnn_bn"), backend="aot_eager"))
        ours = OverlapDDP(torch.compile(models.build("cnn_bn"), backend="aot_eager"))
    return models.train_side_by_side("cnn_bn", rank, 4, ddp, ours)


@pytest.mark.parametrize("outer", [False, True], ids=["OverlapDDP(compile(model))", "compile(OverlapDDP(model))"])
def test_compiled_training_is_bit_equal_to_ddp_in_the_same_form(outer):
    for rank, equal in enumerate(run_ranks(3, _compiled_parity, outer, timeout_s=SLOW_TIMEOUT_S)):
        assert equal == [True] * 4, f"rank {rank}: {equal}"
