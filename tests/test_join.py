"""Uneven inputs with ``join()``: joined ranks shadow the others, bit-equal to DDP's join."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import faults, models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks
from tests.support.parity import skipping_sync

BASE_STEPS = 3
# (model, divide_by_initial_world_size, wrapper arguments, micro-steps per step: all but the last under
# no_sync, whether the highest rank runs out first instead of the lowest)
CASES = [
    ("cnn_bn", True, (), 1, False),
    ("cnn_bn", False, (), 1, False),
    # The joined ranks are above the training ones: their buffers must not be broadcast (they are stale).
    ("cnn_bn", False, (), 1, True),
    ("mlp", False, (("bucket_cap_mb", 0.001),), 1, False),
    ("branchy", True, (("find_unused_parameters", True),), 1, False),
    # A joined rank follows the others' no_sync: it shadows only the synchronized backwards.
    ("mlp", True, (("bucket_cap_mb", 0.001),), 3, False),
]


def steps_of(rank: int, world_size: int, highest_first: bool) -> int:
    """Rank r trains BASE_STEPS + r steps, or BASE_STEPS + (world_size - 1 - r)."""
    return BASE_STEPS + (world_size - 1 - rank if highest_first else rank)


def _train_uneven(
    wrapper_cls, rank: int, world_size: int, model: str, divide_by_initial: bool, kwargs: dict, accumulate: int,
    highest_first: bool,
) -> list[list[torch.Tensor]]:
    """Rank r trains ``steps_of`` steps; returns the state after each of its steps and at the end."""
    wrapper = wrapper_cls(models.build(model), **kwargs)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
    snapshots = []
    with wrapper.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(steps_of(rank, world_size, highest_first)):
            for micro in range(accumulate):
                inputs, target = models.batch(model, rank, step * accumulate + micro)
                with skipping_sync(wrapper, "no_sync", micro < accumulate - 1):
                    models.loss_of(wrapper(inputs), target).backward()
            opt.step()
            opt.zero_grad()
            snapshots.append([t.clone() for t in wrapper.state_dict().values()])
    snapshots.append([t.clone() for t in wrapper.state_dict().values()])
    return snapshots


def _compare(rank: int, world_size: int, cases=CASES, fault: str | None = None) -> dict[str, list[bool]]:
    results = {}
    for model, divide_by_initial, extra, accumulate, highest_first in cases:
        kwargs = dict(extra)
        case = (model, divide_by_initial, kwargs, accumulate, highest_first)
        ddp = _train_uneven(DistributedDataParallel, rank, world_size, *case)
        with faults.injected(fault):
            ours = _train_uneven(OverlapDDP, rank, world_size, *case)
        key = f"{model}-divide_by_initial={divide_by_initial}-{extra}-accumulate={accumulate}-highest_first={highest_first}"
        results[key] = [all(torch.equal(a, b) for a, b in zip(x, y, strict=False)) for x, y in zip(ddp, ours, strict=False)]
    return results


@functools.cache
def outcomes(world_size: int) -> list[dict[str, list[bool]]]:
    return run_ranks(world_size, _compare, timeout_s=SLOW_TIMEOUT_S)


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_join_with_uneven_inputs_is_bit_equal_to_ddp_every_step_and_after(world_size):
    for rank, results in enumerate(outcomes(world_size)):
        for case, equal in results.items():
            assert len(equal) == steps_of(rank, world_size, case.endswith("highest_first=True")) + 1
            assert all(equal), f"rank {rank} {case}: {equal}"


def test_join_comparison_catches_averaging_over_the_wrong_number_of_ranks():
    results = run_ranks(3, _compare, [("mlp", False, (), 1, False)], "join_ignores_remaining_ranks")
    assert not all(all(equal) for r in results for equal in r.values())


def _early_termination(rank: int, world_size: int) -> str:
    wrapper = OverlapDDP(models.build("mlp"))
    try:
        with wrapper.join(throw_on_early_termination=True):
            for step in range(2 + rank):
                inputs, target = models.batch("mlp", rank, step)
                models.loss_of(wrapper(inputs), target).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_throw_on_early_termination_raises_on_every_rank():
    for message in run_ranks(3, _early_termination):
        assert "exhausted" in message and "inputs" in message
