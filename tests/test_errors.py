"""The error contract: each bad input gets a clear error that names the problem, never a hang.

The README's error table lists these cases; each row is a test here (or in the file named there).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import run_ranks


def test_no_process_group_says_how_to_create_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        OverlapDDP(nn.Linear(2, 2))


def test_module_without_trainable_parameters(one_rank):
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        OverlapDDP(frozen)


def test_lazy_parameters_are_named(one_rank):
    with pytest.raises(RuntimeError, match=r"uninitialized parameters.*0\.weight"):
        OverlapDDP(nn.Sequential(nn.LazyLinear(3)))


def test_parameters_on_mixed_device_types_are_named(one_rank):
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"one type of device.*'meta': \['1\.weight'"):
        OverlapDDP(mixed)


def test_device_ids_for_a_cpu_module(one_rank):
    with pytest.raises(ValueError, match="device_ids and output_device only work with single-device GPU modules"):
        OverlapDDP(nn.Linear(2, 2), device_ids=[0])


def test_more_than_one_device_id(one_rank):
    with pytest.raises(ValueError, match="device_ids can only be None or contain a single element"):
        OverlapDDP(nn.Linear(2, 2), device_ids=[0, 1])


@pytest.mark.parametrize("cap", [0, -5, float("nan"), "25"])
def test_invalid_bucket_cap(one_rank, cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        OverlapDDP(nn.Linear(2, 2), bucket_cap_mb=cap)


def test_process_group_and_device_mesh_together(one_rank):
    with pytest.raises(RuntimeError, match="Cannot specify both process_group and device_mesh"):
        OverlapDDP(nn.Linear(2, 2), process_group=dist.group.WORLD, device_mesh=object())


def test_forward_during_backward_while_buckets_are_in_flight(one_rank):
    model = OverlapDDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    seen: list[str] = []

    def forward_again(_):
        try:
            model(torch.ones(1, 2))
        except RuntimeError as error:
            seen.append(str(error))

    handle = model.module[0].weight.register_post_accumulate_grad_hook(forward_again)
    model(torch.ones(1, 2)).sum().backward()
    handle.remove()
    assert seen and "forward() was called during backward on rank 0 while buckets [0]" in seen[0]
    model(torch.ones(1, 2)).sum().backward()  # usable again


def _nonfinite(rank: int, world_size: int) -> dict[str, object]:
    model = OverlapDDP(models.build("mlp"))
    model.check_nonfinite_gradients()
    inputs, target = models.batch("mlp", rank, 0)
    if rank == 1:
        inputs[0, 0] = float("nan")
    facts: dict[str, object] = {}
    try:
        models.loss_of(model(inputs), target).backward()
        facts["message"] = "no error"
    except FloatingPointError as error:
        facts["message"] = str(error)
    model.zero_grad()  # the local non-finite gradients are still there, unreduced
    models.loss_of(model(models.batch("mlp", rank, 1)[0]), target).backward()  # usable again
    facts["finite_after"] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return facts


def test_nonfinite_gradients_stop_every_rank_before_the_collective_naming_rank_and_parameters():
    for facts in run_ranks(2, _nonfinite):
        assert "Non-finite gradients (NaN or Inf) in bucket 0 before its reduction (rank 1: 0.weight" in facts["message"]
        assert "rank 0:" not in facts["message"]
        assert facts["finite_after"]
