"""Join's agreement on a source rank, on one process: a rank that does not qualify never wins,
and when none does the error says so (instead of naming a rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from overlapddp.join import common_rank


def test_a_rank_that_does_not_qualify_is_never_chosen(one_rank: None) -> None:
    model = SimpleNamespace(process_group=dist.group.WORLD, device=torch.device("cpu"))
    assert common_rank(model, True) == 0  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="No rank qualified as the source of the model state"):
        common_rank(model, False)  # type: ignore[arg-type]
