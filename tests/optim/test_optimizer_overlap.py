"""Optimizer overlap: per-bucket updates during backward's end, bit-equal to DDP then ``step()``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

OPTIMIZERS = {
    "sgd_momentum_wd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
CASES = [(m, o) for m in ("cnn_bn", "transformer") for o in OPTIMIZERS]


INF_STEP, INF_RANK = 2, 1  # with loss scaling, this rank's loss is made infinite at this step


def _compare(
    rank: int, world_size: int, skip_last_bucket: bool = False, max_norm: float | None = None,
    scaled: bool = False, ignore_inf: bool = False,
) -> dict[str, list[bool]]:
    results = {}
    for model_name, opt_name in CASES:
        ddp = DistributedDataParallel(models.build(model_name), bucket_cap_mb=0.001)
        ours = OverlapDDP(models.build(model_name), bucket_cap_mb=0.001)
        ddp_opt, our_opt = OPTIMIZERS[opt_name](ddp.parameters()), OPTIMIZERS[opt_name](ours.parameters())
        # Growth every 2 steps, so the scale both grows and (after the infinite step) halves.
        scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=scaled)
                   for _ in range(2)]
        overlapped = ours.attach_optimizer(our_opt, overlap=True, max_grad_norm=max_norm, scaler=scalers[1])
        if skip_last_bucket:  # fault: the last bucket's update is lost
            overlapped._update_bucket = _skipping_last(ours, overlapped._update_bucket)
        if ignore_inf:  # fault: the updates run although a gradient was not finite
            unscaler = overlapped._unscaler
            hand_over = unscaler.hand_over
            unscaler.hand_over = lambda hand_over=hand_over: hand_over() and False
            overlapped._check_stepped = lambda where: None  # (else the skipped step itself is reported)
        equal = []
        for step in range(4):
            inputs, target = models.batch(model_name, rank, step)
            for wrapper, opt, scaler in ((ddp, ddp_opt, scalers[0]), (ours, our_opt, scalers[1])):
                loss = models.loss_of(wrapper(inputs), target)
                if scaled and (step, rank) == (INF_STEP, INF_RANK):
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                if wrapper is ddp:  # the usual order: unscale, clip, step
                    scaler.unscale_(opt)
                    if max_norm is not None:
                        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            equal.append(
                all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False))
                and scalers[0].get_scale() == scalers[1].get_scale()
            )
        results[f"{model_name}-{opt_name}"] = equal
    return results


def _skipping_last(model: OverlapDDP, update):
    def update_all_but_last(params):
        if params is not model._reducer.pipelines[-1].params:
            update(params)

    return update_all_but_last


@functools.cache
def outcomes(world_size: int, max_norm: float | None = None, scaled: bool = False):
    return run_ranks(world_size, _compare, False, max_norm, scaled, timeout_s=SLOW_TIMEOUT_S)


@pytest.mark.parametrize("world_size", (2, 3))
def test_overlapped_updates_are_bit_equal_to_ddp_then_step(world_size):
    for rank, results in enumerate(outcomes(world_size)):
        for case, equal in results.items():
            assert equal == [True] * 4, f"rank {rank} {case}: {equal}"


def test_overlapped_clipping_is_bit_equal_to_clip_grad_norm_then_step():
    for rank, results in enumerate(outcomes(3, 0.05)):  # small enough that every step clips
        for case, equal in results.items():
            assert equal == [True] * 4, f"rank {rank} {case}: {equal}"


@pytest.mark.parametrize("max_norm", (None, 0.05))
def test_overlapped_loss_scaling_is_bit_equal_to_unscale_clip_then_scaler_step(max_norm):
    # Step INF_STEP has an infinite gradient: every rank must skip it, and the scale must halve.
    for rank, results in enumerate(outcomes(3, max_norm, True)):
        for case, equal in results.items():
            assert equal == [True] * 4, f"rank {rank} {case}: {equal}"


def test_comparison_catches_updates_that_ignore_an_infinite_gradient():
    for results in run_ranks(3, _compare, False, None, True, True, timeout_s=SLOW_TIMEOUT_S):
        for case, equal in results.items():
            assert equal[:INF_STEP] == [True] * INF_STEP and not any(equal[INF_STEP:]), (case, equal)


def test_comparison_catches_a_lost_bucket_update():
    for results in run_ranks(3, _compare, True, timeout_s=SLOW_TIMEOUT_S):
        assert not any(all(equal) for equal in results.values())


def test_optimizers_that_need_every_gradient_are_refused_with_the_alternative(one_rank):
    model = OverlapDDP(models.build("mlp"))
    with pytest.raises(ValueError, match="cannot be overlapped bucket by bucket.*without overlap"):
        model.attach_optimizer(torch.optim.LBFGS(model.parameters()), overlap=True)


def test_step_without_a_synchronized_backward_raises(one_rank):
    """The overlapped optimizer updates during backward: step() only acknowledges a synchronized backward, once."""
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    with pytest.raises(RuntimeError, match="none has run since the last step"):
        opt.step()
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="none has run since the last step"):
        opt.step()  # the same update cannot be acknowledged twice


def test_clipping_after_the_overlapped_update_is_detected_and_points_to_max_grad_norm(one_rank):
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match="cannot be honored. Pass max_grad_norm"):
        opt.step()


def test_unscale_after_the_overlapped_update_is_refused_and_points_to_max_grad_norm(one_rank):
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    model.attach_optimizer(opt, overlap=True, scaler=scaler)
    inputs, target = models.batch("mlp", 0, 0)
    scaler.scale(models.loss_of(model(inputs), target)).backward()
    with pytest.raises(RuntimeError, match="already run when backward returns.*max_grad_norm"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def test_backward_of_an_unscaled_loss_with_a_scaler_attached_is_refused(one_rank):
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True, scaler=torch.amp.GradScaler("cpu"))
    inputs, target = models.batch("mlp", 0, 0)
    with pytest.raises(RuntimeError, match="backpropagate scaler.scale"):
        models.loss_of(model(inputs), target).backward()


def _overlap_with_an_ignored_parameter(rank: int, world_size: int) -> dict[str, list[bool]]:
    """overlap=True with neither clipping nor loss scaling, and a parameter the wrapper ignores (no
    bucket carries it): the optimizer still updates it, with its local gradient, as DDP then step() does."""
    results = {}
    for opt_name in ("sgd", "adam"):
        pairs = []
        for wrapper_class in (DistributedDataParallel, OverlapDDP):
            net = models.build("mlp")
            wrapper_class._set_params_and_buffers_to_ignore_for_model(net, ["0.bias"])
            wrapper = wrapper_class(net, bucket_cap_mb=0.001)
            opt = models.optimizer(opt_name, wrapper.parameters())
            if wrapper_class is OverlapDDP:
                wrapper.attach_optimizer(opt, overlap=True)
            pairs.append((wrapper, opt))
        equal = []
        for step in range(4):
            inputs, target = models.batch("mlp", rank, step)
            for wrapper, opt in pairs:
                models.loss_of(wrapper(inputs), target).backward()
                opt.step()
                opt.zero_grad()
            (ddp, _), (ours, _) = pairs
            equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False)))
        results[opt_name] = equal
    return results


def test_overlapped_updates_step_ignored_parameters_too_bit_equal_to_ddp_then_step():
    for rank, results in enumerate(run_ranks(3, _overlap_with_an_ignored_parameter)):
        assert results == {"sgd": [True] * 4, "adam": [True] * 4}, f"rank {rank}: {results}"


def _split_optimizers_with_an_ignored_parameter(rank: int, world_size: int, clip: bool) -> list[bool]:
    """One scaler, two optimizers (only the body one overlapped), one parameter the wrapper ignores:
    each gradient is unscaled exactly once, by its own optimizer, as with DDP."""
    wrappers = []
    for wrapper_class in (DistributedDataParallel, OverlapDDP):
        net = models.build("mlp")
        wrapper_class._set_params_and_buffers_to_ignore_for_model(net, ["0.bias"])
        wrapper = wrapper_class(net, bucket_cap_mb=0.001)
        params = dict(net.named_parameters())
        body = torch.optim.SGD([p for n, p in params.items() if n != "4.weight"], lr=0.05, momentum=0.9)
        head = torch.optim.SGD([params["4.weight"]], lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        if wrapper_class is OverlapDDP:
            wrapper.attach_optimizer(body, overlap=True, scaler=scaler, max_grad_norm=0.05 if clip else None)
        wrappers.append((wrapper, body, head, scaler))
    equal = []
    for step in range(4):
        inputs, target = models.batch("mlp", rank, step)
        for wrapper, body, head, scaler in wrappers:
            scaler.scale(models.loss_of(wrapper(inputs), target)).backward()
            if isinstance(wrapper, DistributedDataParallel):
                scaler.unscale_(body)
                if clip:
                    torch.nn.utils.clip_grad_norm_([p for g in body.param_groups for p in g["params"]], 0.05)
            scaler.step(head)
            scaler.step(body)
            scaler.update()
            body.zero_grad()
            head.zero_grad()
        (ddp, *_), (ours, *_) = wrappers
        equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False)))
    return equal


@pytest.mark.parametrize("clip", (False, True))
def test_loss_scaling_unscales_only_the_attached_optimizers_gradients_including_ignored_ones(clip):
    assert run_ranks(3, _split_optimizers_with_an_ignored_parameter, clip) == [[True] * 4] * 3


def test_a_failed_backward_leaves_no_stale_unscaling_behind(one_rank):
    # Forgetting scaler.update() makes the next backward fail; after update() the scale has grown,
    # and the following step must use the new scale, not the failed iteration's.
    results = []
    for wrapper_class in (DistributedDataParallel, OverlapDDP):
        model = wrapper_class(models.build("mlp"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        if wrapper_class is OverlapDDP:
            model.attach_optimizer(opt, overlap=True, scaler=scaler)
        for step in range(3):
            inputs, target = models.batch("mlp", 0, step)
            scaled = scaler.scale(models.loss_of(model(inputs), target))
            if wrapper_class is OverlapDDP and step == 1:
                with pytest.raises(RuntimeError, match="already unscaled or stepped this optimizer"):
                    scaled.backward()
                opt.zero_grad()  # the iteration is lost, as with DDP below
                scaler.update()
                continue
            scaled.backward()
            if wrapper_class is DistributedDataParallel and step == 1:
                opt.zero_grad()  # the same iteration, lost
                scaler.update()
                continue
            scaler.step(opt)
            if step != 0:
                scaler.update()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=False))


def _split_muon(params):
    """Muon on the 2-D weights, AdamW on the rest: the usual pairing (Muon takes matrices only)."""
    params = list(params)
    return [torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-3)]


PER_PARAMETER_CASES = {
    "adagrad": lambda ps: [torch.optim.Adagrad(ps, lr=0.01)],
    "rmsprop": lambda ps: [torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9)],
    "nadam": lambda ps: [torch.optim.NAdam(ps, lr=1e-3)],
    "radam": lambda ps: [torch.optim.RAdam(ps, lr=1e-3)],
    "adafactor": lambda ps: [torch.optim.Adafactor(ps, lr=1e-2)],
    "muon_and_adamw": _split_muon,
}


def _compare_per_parameter(rank: int, world_size: int) -> dict[str, list[bool]]:
    """Every other per-parameter optimizer overlapped (Muon beside AdamW: two consumers), unclipped."""
    results = {}
    for name, make in PER_PARAMETER_CASES.items():
        ddp = DistributedDataParallel(models.build("transformer"), bucket_cap_mb=0.001)
        ours = OverlapDDP(models.build("transformer"), bucket_cap_mb=0.001)
        ddp_opts, our_opts = make(ddp.parameters()), make(ours.parameters())
        for opt in our_opts:
            ours.attach_optimizer(opt, overlap=True)
        equal = []
        for step in range(3):
            inputs, target = models.batch("transformer", rank, step)
            for wrapper, opts in ((ddp, ddp_opts), (ours, our_opts)):
                models.loss_of(wrapper(inputs), target).backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
            equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(),
                                                                strict=True)))
        results[name] = equal
    return results


@pytest.mark.parametrize("world_size", (2, 3))
def test_every_per_parameter_optimizer_overlapped_is_bit_equal_to_ddp_then_step(world_size):
    for results in run_ranks(world_size, _compare_per_parameter, timeout_s=SLOW_TIMEOUT_S):
        assert results == {name: [True] * 3 for name in PER_PARAMETER_CASES}
