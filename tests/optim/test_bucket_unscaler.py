"""``BucketUnscaler`` on one process, no ranks: what each bucket notes must last its whole iteration."""

from __future__ import annotations

import torch

from overlapddp.optim.unscaler import BucketUnscaler


def test_an_inf_in_an_early_bucket_is_still_found_late_in_a_long_run() -> None:
    """Iteration numbers above 256 are distinct int objects on each call: equal, never identical. A
    later bucket of the same iteration must not start the iteration again (forgetting the Inf)."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale exists from here on
    unscaler = BucketUnscaler(scaler, optimizer, params, lambda: int("1000"), rank=0)
    params[0].grad = torch.tensor([float("inf"), 8.0])
    params[1].grad = torch.tensor([4.0, 8.0])
    unscaler.unscale([params[0]])
    unscaler.unscale([params[1]])
    assert unscaler.hand_over() is True
    assert torch.equal(params[1].grad, torch.tensor([1.0, 2.0])), "unscaled once, by 1/4"
    unscaler.detach()


def test_a_parameter_without_a_gradient_does_not_stop_the_bucket() -> None:
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    unscaler = BucketUnscaler(scaler, optimizer, params, lambda: 1, rank=0)
    params[0].grad, params[2].grad = torch.tensor([2.0, 4.0]), torch.tensor([6.0, float("nan")])
    unscaler.unscale(params)  # params[1] has no gradient
    assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0]))
    assert params[2].grad[0].item() == 3.0
    assert unscaler.hand_over() is True, "the NaN after the gradient-less parameter is found"
    unscaler.detach()
