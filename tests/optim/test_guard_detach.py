"""``OptimizerGuard.detach`` on one process against a stand-in reducer: the optimizer, its
``zero_grad`` and the scaler's ``unscale_`` are the user's own again, and gradient writes are no
longer watched for it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from overlapddp.optim.guard import OptimizerGuard


class _Fence:
    def make_visible(self, strict: bool, gradients: list[torch.Tensor]) -> None:
        pass


class _Reducer:
    """What the guard reads: no synchronized backward has run, so a guarded step must raise."""

    rank = 0
    reductions = 0
    local_gradients_since_reduction = False

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.fence = _Fence()
        self.stages = SimpleNamespace(write_watch=SimpleNamespace(watchers=0))  # the guards counted in

    def unfinished_buckets(self) -> list[int]:
        return []


def _optimizer() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [torch.nn.Parameter(torch.ones(2))]
    params[0].grad = torch.ones(2)
    return torch.optim.SGD(params, lr=0.5), params


@pytest.mark.parametrize("with_scaler", [False, True])
def test_detach_gives_the_optimizer_and_the_scaler_back(with_scaler: bool) -> None:
    optimizer, params = _optimizer()
    reducer = _Reducer(params)
    zero_grad = optimizer.zero_grad
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    unscale: Any = scaler.unscale_ if scaler is not None else None
    guard = OptimizerGuard(reducer, optimizer, strict=False, allow_unsynced=False, scaler=scaler)  # type: ignore[arg-type]
    assert reducer.stages.write_watch.watchers == 1
    with pytest.raises(RuntimeError, match="no synchronized backward has run yet"):
        optimizer.step()
    guard.detach()
    assert reducer.stages.write_watch.watchers == 0, "gradient writes are no longer watched for this guard"
    assert optimizer.zero_grad == zero_grad
    if scaler is not None:
        assert scaler.unscale_ == unscale
    optimizer.step()  # unguarded: local gradients may be stepped
    assert torch.equal(params[0], torch.full((2,), 0.5))


def test_detach_leaves_an_unscale_installed_after_it_alone() -> None:
    optimizer, params = _optimizer()
    scaler = torch.amp.GradScaler("cpu")
    guard = OptimizerGuard(_Reducer(params), optimizer, strict=False, allow_unsynced=False, scaler=scaler)  # type: ignore[arg-type]

    def later(optimizer: torch.optim.Optimizer) -> None:  # another wrapper's, set after this guard
        pass

    scaler.unscale_ = later  # type: ignore[method-assign]
    guard.detach()
    assert scaler.unscale_ is later
