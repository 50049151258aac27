"""The optimizer-step guard: it lets correct loops through bit-equal to DDP and stops the wrong ones."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests import models


def _error_of(action) -> str:
    try:
        action()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _train_step(wrapper, opt, scaler, rank: int, step: int) -> None:
    inputs, target = models.batch("mlp", rank, step)
    scaler.scale(models.loss_of(wrapper(inputs), target)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(wrapper.parameters(), max_norm=0.5)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _guard_checks(rank: int, world_size: int) -> dict[str, object]:
    facts: dict[str, object] = {}

    # A correct loop (backward, unscale, clip, step) with the guard: bit-equal to DDP, every step.
    ddp = DistributedDataParallel(models.build("mlp"))
    ours = OverlapDDP(models.build("mlp"))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    our_opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ours.attach_optimizer(our_opt, strict=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    equal = []
    for step in range(4):
        _train_step(ddp, ddp_opt, scalers[0], rank, step)
        _train_step(ours, our_opt, scalers[1], rank, step)
        equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values())))
    facts["guarded_loop_equal"] = equal

    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt)
    inputs, target = models.batch("mlp", rank, 0)
    facts["step_before_backward"] = _error_of(opt.step)
    models.loss_of(model(inputs), target).backward()
    opt.step()
    facts["second_step_same_gradients"] = _error_of(opt.step)

    with model.no_sync():
        models.loss_of(model(inputs), target).backward()
    facts["step_after_no_sync_only"] = _error_of(opt.step)
    models.loss_of(model(inputs), target).backward()
    facts["step_after_synchronized_backward"] = _error_of(opt.step)

    # Reading gradients from inside backward, while a bucket is being reduced.
    inside: dict[str, str] = {}
    first = next(model.module.parameters())  # the last gradient to become ready

    def read_early(_):
        inside["step"] = _error_of(opt.step)
        inside["zero_grad"] = _error_of(opt.zero_grad)

    handle = first.register_post_accumulate_grad_hook(read_early)
    models.loss_of(model(inputs), target).backward()
    handle.remove()
    facts.update({f"{k}_during_backward": v for k, v in inside.items()})

    local = OverlapDDP(models.build("mlp"))
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    local.attach_optimizer(local_opt, allow_unsynced=True)
    with local.no_sync():
        models.loss_of(local(inputs), target).backward()
    facts["allow_unsynced_step"] = _error_of(local_opt.step)
    return facts


@functools.cache
def facts() -> list[dict[str, object]]:
    from tests.multiprocess import run_ranks

    return run_ranks(2, _guard_checks)


def test_guarded_loop_with_grad_scaler_and_clipping_is_bit_equal_to_ddp():
    for f in facts():
        assert f["guarded_loop_equal"] == [True] * 4


@pytest.mark.parametrize(
    "fact, expected",
    [
        ("step_before_backward", "no synchronized backward has run yet"),
        ("second_step_same_gradients", "already used by the previous step"),
        ("step_after_no_sync_only", "accumulated under no_sync()"),
        ("step_during_backward", "are still being reduced"),
        ("zero_grad_during_backward", "optimizer.zero_grad() was called while buckets [0]"),
    ],
)
def test_guard_raises_a_clear_error_naming_the_problem_and_rank(fact, expected):
    for rank, f in enumerate(facts()):
        assert expected in f[fact], f[fact]
        assert f"rank {rank}" in f[fact]


@pytest.mark.parametrize("fact", ["step_after_synchronized_backward", "allow_unsynced_step"])
def test_guard_lets_correct_steps_through(fact):
    assert all(f[fact] == "no error" for f in facts())
