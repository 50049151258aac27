"""The torch lookups that are not exercised on every torch: the process group's store, and the
loops that stand in for multi-tensor kernels where a torch lacks them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlapddp.torch_compat import _each, group_store


def test_the_groups_store_is_found_and_shared_by_the_ranks(one_rank: None) -> None:
    store = group_store(dist.group.WORLD)
    assert store is not None
    store.set("overlapddp-test", "seen")
    assert store.get("overlapddp-test") == b"seen"
    assert group_store(object()) is None, "not a group: no store"


def test_the_loop_stand_ins_apply_per_tensor_and_refuse_unequal_lists() -> None:
    tensors = [torch.ones(2), torch.ones(3)]
    _each("mul_")(tensors, 3.0)
    assert [t.tolist() for t in tensors] == [[3.0, 3.0], [3.0, 3.0, 3.0]]
    _each("copy_")(tensors, [torch.zeros(2), torch.full((3,), 2.0)])
    assert [t.tolist() for t in tensors] == [[0.0, 0.0], [2.0, 2.0, 2.0]]
    with pytest.raises(ValueError):
        _each("div_")(tensors, [torch.ones(2)])


def test_dcp_recognizes_the_wrapper_beside_ddp_once() -> None:
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from overlapddp import OverlapDDP
    from overlapddp.torch_compat import let_dcp_unwrap

    let_dcp_unwrap(OverlapDDP)  # again: already there
    assert dcp_state_dict.DDP == (DistributedDataParallel, OverlapDDP)
