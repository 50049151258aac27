"""The optimizer-step guard: it lets correct loops through bit-equal to DDP and stops the wrong ones."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import models


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


def _write_inside_backward(model, action, rank: int) -> str:
    """Run ``action`` from a hook on the last gradient to become ready, when every bucket is in flight."""
    first = next(model.module.parameters())
    handle = first.register_post_accumulate_grad_hook(lambda _: action())
    inputs, target = models.batch("mlp", rank, 0)
    try:
        return _error_of(lambda: models.loss_of(model(inputs), target).backward())
    finally:
        handle.remove()


def _clip(model) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)


def _total_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


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
        equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False)))
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

    # A synchronized backward, then a no_sync one, then the first step: the later gradients were
    # never reduced, although a reduction did happen since the last (here: no) step.
    mixed = OverlapDDP(models.build("mlp"))
    mixed_opt = torch.optim.SGD(mixed.parameters(), lr=0.1)
    mixed.attach_optimizer(mixed_opt)
    models.loss_of(mixed(inputs), target).backward()
    with mixed.no_sync():
        models.loss_of(mixed(inputs), target).backward()
    facts["first_step_after_synchronized_then_no_sync"] = _error_of(mixed_opt.step)

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

    # Writing gradients from inside backward, while buckets are being reduced: the guard stops
    # scaler.unscale_ before it runs and reports a clip when backward ends; unguarded, the clip is
    # silently replaced by the reduced values (what the guard exists to prevent).
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    guarded = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    guarded_opt = torch.optim.SGD(guarded.parameters(), lr=0.1)
    guarded.attach_optimizer(guarded_opt, scaler=scaler)
    scaler.scale(torch.ones(()))  # the scaler needs a scale before it can unscale
    facts["unscale_during_backward"] = _write_inside_backward(guarded, lambda: scaler.unscale_(guarded_opt), rank)
    clipped = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    clipped.attach_optimizer(torch.optim.SGD(clipped.parameters(), lr=0.1))
    facts["clip_during_backward"] = _write_inside_backward(clipped, lambda: _clip(clipped), rank)
    # zero_grad(set_to_none=False) zeroes in place; with gradient_as_bucket_view the gradients are the
    # buffers being reduced, so unguarded it would go through silently.
    viewed = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    viewed_opt = torch.optim.SGD(viewed.parameters(), lr=0.1)
    viewed.attach_optimizer(viewed_opt)
    _write_inside_backward(viewed, lambda: None, rank)  # the gradients are now the bucket views
    viewed_opt.step()
    facts["zero_grad_in_place_during_backward"] = _write_inside_backward(
        viewed, lambda: viewed_opt.zero_grad(set_to_none=False), rank
    )
    unguarded = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    facts["unguarded_clip_during_backward"] = _write_inside_backward(unguarded, lambda: _clip(unguarded), rank)
    facts["unguarded_norm_after_clip"] = _total_norm(unguarded)

    local = OverlapDDP(models.build("mlp"))
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    local.attach_optimizer(local_opt, allow_unsynced=True)
    with local.no_sync():
        models.loss_of(local(inputs), target).backward()
    facts["allow_unsynced_step"] = _error_of(local_opt.step)
    return facts


@functools.cache
def facts() -> list[dict[str, object]]:
    from tests.support.multiprocess import run_ranks

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
        ("first_step_after_synchronized_then_no_sync", "accumulated under no_sync()"),
        ("step_during_backward", "are still being reduced"),
        ("zero_grad_during_backward", "optimizer.zero_grad() was called while buckets [0]"),
        ("unscale_during_backward", "GradScaler.unscale_() was called while buckets"),
        ("zero_grad_in_place_during_backward", "optimizer.zero_grad() was called while buckets"),
        ("clip_during_backward", "were changed on rank"),
    ],
)
def test_guard_raises_a_clear_error_naming_the_problem_and_rank(fact, expected):
    for rank, f in enumerate(facts()):
        assert expected in f[fact], f[fact]
        assert f"rank {rank}" in f[fact]


@pytest.mark.parametrize("fact", ["step_after_synchronized_backward", "allow_unsynced_step"])
def test_guard_lets_correct_steps_through(fact):
    assert all(f[fact] == "no error" for f in facts())


def test_a_clip_inside_backward_is_named_by_the_guard_and_silently_lost_without_it():
    for f in facts():
        assert "(bucket " in f["clip_during_backward"] and ".weight" in f["clip_during_backward"]
        assert f["unguarded_clip_during_backward"] == "no error"
        assert f["unguarded_norm_after_clip"] > 1e-3 * 1.01  # the clip did not survive the reduction
