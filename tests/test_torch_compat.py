"""The torch lookups that are not exercised on every torch: the process group's store, and the
loops that stand in for multi-tensor kernels where a torch lacks them."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

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


def test_torchs_own_kernels_and_collectives_are_chosen_where_this_torch_has_them(one_rank: None) -> None:
    """The loops are fallbacks only: here each name is torch's kernel, and the flat collectives are
    the current ones (the deprecated names warn on every call)."""
    from overlapddp import torch_compat

    assert torch_compat.foreach_copy_ is torch._foreach_copy_
    assert torch_compat.foreach_mul_ is torch._foreach_mul_
    assert torch_compat.foreach_div_ is torch._foreach_div_
    assert torch_compat.foreach_norm is torch._foreach_norm
    gathered, scattered = torch.zeros(2), torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_compat.all_gather_flat(gathered, torch.full((2,), 3.0))
        torch_compat.reduce_scatter_flat(scattered, torch.full((2,), 5.0))
    assert gathered.tolist() == [3.0, 3.0] and scattered.tolist() == [5.0, 5.0]


def test_the_norm_loop_is_euclidean_unless_told() -> None:
    from overlapddp.torch_compat import _norms

    first, second = _norms([torch.tensor([3.0, 4.0]), torch.tensor([-2.0])])
    assert first.item() == 5.0 and second.item() == 2.0
    assert _norms([torch.tensor([3.0, 4.0])], 1)[0].item() == 7.0


def test_in_backward_is_true_only_while_autograd_runs_a_backward() -> None:
    from overlapddp.torch_compat import in_backward

    seen: list[bool] = []
    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: seen.append(in_backward()))
    assert not in_backward()
    (weight * 2).sum().backward()
    assert seen == [True] and not in_backward()


def test_a_registry_entry_that_is_not_a_backend_and_store_pair_gives_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d

    group, store = object(), object()
    for entry, expected in (((None, store), store), ((None, store, "more"), None), ((None,), None), (store, None)):
        monkeypatch.setattr(distributed_c10d, "_world", SimpleNamespace(pg_map={group: entry}))
        assert group_store(group) is expected, entry
    monkeypatch.setattr(distributed_c10d, "_world", SimpleNamespace(pg_map=[group]))
    assert group_store(group) is None, "a registry that is not a dict"


def test_cuda_sleep_calls_torchs_sleep_and_names_it_where_torch_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlapddp.torch_compat import cuda_sleep

    cycles: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", cycles.append)
    cuda_sleep(7)
    assert cycles == [7]
    monkeypatch.delattr(torch.cuda, "_sleep")
    with pytest.raises(RuntimeError, match=r"torch\.cuda\._sleep"):
        cuda_sleep(7)


def test_without_dcp_the_wrapper_type_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without ``torch.distributed.checkpoint.state_dict`` (an import that fails) is no error."""
    import torch.distributed.checkpoint as dcp

    from overlapddp.torch_compat import let_dcp_unwrap

    monkeypatch.delattr(dcp, "state_dict")
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.state_dict", None)
    let_dcp_unwrap(type("Wrapper", (), {}))  # no error
    assert not hasattr(dcp, "state_dict"), "and installs nothing in its place"
