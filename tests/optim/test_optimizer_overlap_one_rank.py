"""Optimizer overlap on a one-rank group in the test process: bit-equal to DDP then ``step()`` with
clipping and loss scaling, and every refusal, without a spawn (the 2- and 3-rank comparisons are in
tests/optim/test_optimizer_overlap.py, whose comparison this reuses)."""

from __future__ import annotations

import pytest
import torch

from overlapddp import OverlapDDP
from overlapddp.optim import overlap as optimizer_overlap
from overlapddp.optim import takeover
from tests.optim import test_optimizer_overlap
from tests.optim.test_optimizer_overlap import (
    _compare,
    _overlap_with_an_ignored_parameter,
    _split_optimizers_with_an_ignored_parameter,
)
from tests.support import models


def _wrapped() -> OverlapDDP:
    return OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)


@pytest.mark.parametrize("max_grad_norm", (0.0, -1.0, float("nan")))
def test_a_clipping_norm_that_is_not_positive_is_refused(one_rank: None, max_grad_norm: float) -> None:
    model = _wrapped()
    with pytest.raises(ValueError, match=f"max_grad_norm must be positive, got {max_grad_norm!r}"):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, max_grad_norm=max_grad_norm)


def test_a_fused_optimizer_is_refused(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.param_groups[0]["fused"] = True  # as fused=True records it (a CPU build may not run fused kernels)
    with pytest.raises(ValueError, match="A fused optimizer updates all parameters in one kernel; create it with fused=False"):
        model.attach_optimizer(opt, overlap=True)


def test_a_subclass_of_a_per_parameter_optimizer_is_refused_naming_it(one_rank: None) -> None:
    class MySGD(torch.optim.SGD):
        pass

    class Declared(torch.optim.SGD):
        per_parameter_update = True

    model = _wrapped()
    with pytest.raises(ValueError, match=(
        "MySGD cannot be overlapped bucket by bucket: it subclasses SGD and its step may read more; if its update of a "
        "parameter reads only that parameter, its gradient and its state, set per_parameter_update = True"
    )):
        model.attach_optimizer(MySGD(model.parameters(), lr=0.1), overlap=True)
    model.attach_optimizer(Declared(model.parameters(), lr=0.1), overlap=True)


def test_a_closure_is_refused_and_step_counts_each_synchronized_backward_once(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    with pytest.raises(NotImplementedError, match="cannot re-evaluate a closure"):
        opt.step(lambda: 0.0)
    opt.step()
    with pytest.raises(RuntimeError, match="none has run since the last step"):
        opt.step()


def test_gradients_written_in_place_hundreds_of_times_are_compared_by_version_value(one_rank: None) -> None:
    """Kept gradients (zero_grad(set_to_none=False)) count every in-place write: past 256 a version read
    twice is an equal int, not the same object, and step() must not take it for a change."""
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    for step in range(2):
        inputs, target = models.batch("mlp", 0, step)
        models.loss_of(model(inputs), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        for p in model.parameters():
            for _ in range(300):
                p.grad.add_(0.0)
    assert min(p.grad._version for p in model.parameters()) > 256


def test_detach_gives_the_optimizer_its_own_step_back(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlapped = model.attach_optimizer(opt, overlap=True)
    overlapped.detach()
    before = [p.detach().clone() for p in model.parameters()]
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), "no update in backward"
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), "step() updates"


@pytest.mark.parametrize("max_norm", [0.01, 1000.0])  # clipped, and a norm above the total: not scaled up
def test_clipping_a_model_of_one_gradient_equals_clip_grad_norm(one_rank: None, max_norm: float) -> None:
    """One parameter, one norm: the total is that norm, as clip_grad_norm_ computes it."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 1, bias=False)
    model = OverlapDDP(torch.nn.Linear(4, 1, bias=False))
    model.module.load_state_dict(plain.state_dict())
    reference, opt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True, max_grad_norm=max_norm)
    for step in range(2):
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        plain(inputs).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        reference.step()
        reference.zero_grad()
        model(inputs).square().sum().backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(plain.weight, model.module.weight), step


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_with_clipping_each_buckets_norms_are_measured_as_it_is_reduced(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, max_norm: float | None
) -> None:
    """The norms overlap communication: one measurement per bucket, during backward, none at its
    end; without clipping, none at all."""
    measured: list[int] = []
    real = optimizer_overlap.foreach_norm
    monkeypatch.setattr(optimizer_overlap, "foreach_norm", lambda grads, norm: measured.append(len(grads)) or real(grads, norm))
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True, max_grad_norm=max_norm)
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    expected = [len(members) for members in model.bucket_indices()] if max_norm is not None else []
    assert measured == expected


# The comparisons last: the refusals above fail in milliseconds.
@pytest.mark.parametrize(("max_norm", "scaled"), [(None, False), (0.05, False), (None, True), (0.05, True)])
def test_one_rank_overlapped_updates_equal_ddp_then_step(one_rank: None, max_norm: float | None, scaled: bool) -> None:
    for case, equal in _compare(0, 1, max_norm=max_norm, scaled=scaled).items():
        assert equal == [True] * 4, f"{case}: {equal}"


def test_the_one_rank_comparison_catches_a_lost_bucket_update(one_rank: None) -> None:
    assert not any(all(equal) for equal in _compare(0, 1, skip_last_bucket=True).values())


def test_one_rank_with_an_infinite_step_skips_it_as_the_scaler_would(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_optimizer_overlap, "INF_RANK", 0)  # this one rank's loss is made infinite
    for case, equal in _compare(0, 1, scaled=True).items():
        assert equal == [True] * 4, f"{case}: {equal}"


def test_one_rank_ignored_parameters_are_updated_and_clipped_as_with_ddp(one_rank: None) -> None:
    assert _overlap_with_an_ignored_parameter(0, 1) == {"sgd": [True] * 4, "adam": [True] * 4}
    for clip in (False, True):
        assert _split_optimizers_with_an_ignored_parameter(0, 1, clip) == [True] * 4, f"clip={clip}"


def _backward(model: OverlapDDP, step: int) -> None:
    inputs, target = models.batch("mlp", 0, step)
    models.loss_of(model(inputs), target).backward()


def test_an_lr_set_after_backward_raises_at_step_naming_the_group_and_both_values(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    opt.param_groups[0]["lr"] = 0.05  # the update already ran with 0.1
    with pytest.raises(RuntimeError, match=(
        r"optimizer.step\(\) on rank 0: param_groups\[0\]\['lr'\] is 0.05, but the update that already ran during "
        r"backward \(attach_optimizer\(overlap=True\)\) used 0.1\. .* set hyperparameters .* before backward"
    )):
        opt.step()


def test_hyperparameters_changed_before_backward_are_used_and_accepted(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.attach_optimizer(opt, overlap=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        _backward(model, step)
        opt.step()
        scheduler.step()  # after step(): the next backward's update uses it
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**3


def test_a_skipped_step_raises_at_the_next_zero_grad_once(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=(
        r"optimizer.zero_grad\(\) on rank 0: the last backward already updated the parameters .* but "
        r"optimizer.step\(\) was not called after it, so that update cannot be skipped"
    )):
        opt.zero_grad()
    opt.zero_grad()  # said once: the loop may go on


def test_a_skipped_step_raises_at_the_next_backward_without_a_zero_grad(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=r"the next backward on rank 0: the last backward already updated"):
        _backward(model, 1)
    _backward(model, 2)  # the failed iteration was dropped; the next one reduces and updates
    opt.step()


def test_a_step_the_scaler_skips_owes_nothing(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    model.attach_optimizer(opt, overlap=True, scaler=scaler)
    inputs, target = models.batch("mlp", 0, 0)
    scaler.scale(models.loss_of(model(inputs), target) * float("inf")).backward()
    scaler.step(opt)  # found inf: no update ran, and step() is skipped
    scaler.update()
    opt.zero_grad()
    assert scaler.get_scale() == 2.0**3


def test_a_grad_scaler_not_given_to_attach_raises_at_its_step(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    inputs, target = models.batch("mlp", 0, 0)
    scaler.scale(models.loss_of(model(inputs), target)).backward()
    with pytest.raises(RuntimeError, match=(
        r"GradScaler.step\(optimizer\) on rank 0: with attach_optimizer\(overlap=True\) the updates already ran during "
        r"backward, on the scaled gradients .* Pass it as attach_optimizer\(optimizer, overlap=True, scaler=scaler\)"
    )):
        scaler.step(opt)
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # it unscales nothing: its step is the optimizer's
    other = _wrapped()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other.attach_optimizer(other_opt, overlap=True)
    disabled.scale(models.loss_of(other(inputs), target)).backward()
    disabled.step(other_opt)


def test_only_a_declaration_of_true_in_the_class_body_counts() -> None:
    class SaysOne(torch.optim.SGD):
        per_parameter_update = 1  # truthy, but no declaration

    class SaysTwo(torch.optim.SGD):
        per_parameter_update = 2

    assert not takeover.is_per_parameter(SaysOne) and not takeover.is_per_parameter(SaysTwo)


def test_another_overlapped_optimizers_clipping_is_not_taken_for_a_change_to_this_ones_gradients(one_rank: None) -> None:
    model = _wrapped()
    params = list(model.parameters())
    first, second = torch.optim.SGD(params[:2], lr=0.1), torch.optim.AdamW(params[2:], lr=1e-3)
    model.attach_optimizer(first, overlap=True)
    model.attach_optimizer(second, overlap=True, max_grad_norm=1e-3)  # clips only its own gradients
    _backward(model, 0)
    first.step()
    second.step()


def test_a_foreign_scaler_is_found_behind_wrappers_of_step(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps step once
    taken = opt.step
    opt.step = lambda *args, **kwargs: taken(*args, **kwargs)  # type: ignore[method-assign]  # and once more
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    inputs, target = models.batch("mlp", 0, 0)
    scaler.scale(models.loss_of(model(inputs), target)).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler.step\(optimizer\) on rank 0"):
        scaler.step(opt)
    assert scheduler.last_epoch == 0


def test_a_refused_step_is_said_once_the_next_zero_grad_goes_on(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    opt.param_groups[0]["lr"] = 0.05
    with pytest.raises(RuntimeError, match="param_groups"):
        opt.step()
    opt.zero_grad()  # the refusal was the step: nothing else is owed
    _backward(model, 1)
    opt.step()


def test_parameters_in_a_skipped_unused_bucket_still_update_as_after_ddp(one_rank: None) -> None:
    """skip_all_reduce_unused_params passes a bucket of unused parameters over: their zero gradients
    never reach the consumers, but weight decay and momentum still move them in DDP's step()."""

    class WithUnused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    finals = []
    for overlap in (False, True):
        model = OverlapDDP(WithUnused(), static_graph=True, skip_all_reduce_unused_params=True, bucket_cap_mb=1e-5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        model.attach_optimizer(opt, overlap=overlap)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for step in range(3):
            model(torch.full((4, 3), float(step + 1))).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    assert not torch.equal(finals[1][2], WithUnused().unused.weight), "weight decay moved the unused layer"


def test_step_arguments_are_named_in_the_refusal(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    with pytest.raises(NotImplementedError, match=r"\(got a closure\)"):
        opt.step(lambda: 0.0)
    with pytest.raises(NotImplementedError, match=r"\(got \['foo'\]\)"):
        opt.step(foo=1)
    opt.step()  # a refused call is not the step: it is still owed


class _OneUsed(torch.nn.Module):
    """Two layers; ``use_both=False`` leaves the second without a gradient (its reduction never finishes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        self.use_both = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)) if self.use_both else self.first(x)


def test_an_attach_refused_between_iterations_gives_the_scaler_its_unscale_back(one_rank: None) -> None:
    model = OverlapDDP(_OneUsed(), bucket_cap_mb=1e-5)
    model.module.use_both = False
    model(torch.ones(2, 3)).sum().backward()  # the second layer's bucket never fills: still reducing
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="can only be attached between iterations"):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True, scaler=scaler)
    assert scaler.unscale_.__func__ is torch.amp.GradScaler.unscale_, "the refused attach kept the scaler's unscale_"


def test_a_skipped_step_is_still_owed_after_a_dropped_iteration(one_rank: None) -> None:
    """A backward that never finishes (an unused parameter) is dropped at the next forward, before any
    bucket was taken: the update of the backward before it is still owed its step()."""
    model = OverlapDDP(_OneUsed(), bucket_cap_mb=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    model(torch.ones(2, 3)).sum().backward()  # updated, then no step()
    model.module.use_both = False
    model(torch.ones(2, 3)).sum().backward()  # never finishes: nothing taken
    model.module.use_both = True
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
        model(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match=r"the next backward on rank 0: the last backward already updated"):
        model(torch.ones(2, 3)).sum().backward()


def test_a_step_after_the_refused_zero_grad_acknowledges_the_update(one_rank: None) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) was not called"):
        opt.zero_grad()
    opt.step()  # the refusal forgot the settings used: nothing to compare, the step goes through
    opt.zero_grad()
    _backward(model, 1)
    opt.step()


@pytest.mark.parametrize("key", ["weight_decay", "nesterov", "lr"])  # keys after "params", and one before
def test_any_hyperparameter_set_after_backward_raises_at_step(one_rank: None, key: str) -> None:
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    opt.param_groups[0][key] = {"weight_decay": 0.5, "nesterov": True, "lr": 0.5}[key]
    with pytest.raises(RuntimeError, match=rf"param_groups\[0\]\['{key}'\] is"):
        opt.step()


def test_a_hyperparameter_set_again_to_an_equal_value_is_not_a_change(one_rank: None) -> None:
    """Compared by value: a new float, the same value as a 0-d tensor or back, or a tensor of several
    values equal element by element (a key of the user's own) are what the update used."""
    model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    opt.param_groups[0]["mask"] = torch.tensor([1.0, 2.0])
    model.attach_optimizer(opt, overlap=True)
    for step, lr in enumerate((float("0.25"), torch.tensor(0.25), 0.25)):
        _backward(model, step)
        opt.param_groups[0]["lr"] = lr  # the update used 0.25, as a float, a float, then a tensor
        opt.param_groups[0]["mask"] = torch.tensor([1.0, 2.0])
        opt.step()
        opt.zero_grad()


def _first_and_last_layer(model: OverlapDDP) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = list(model.parameters())
    return params[:-2], params[-2:]


def test_a_parameter_group_added_after_backward_raises_at_step(one_rank: None) -> None:
    model = _wrapped()
    first, last = _first_and_last_layer(model)
    opt = torch.optim.SGD(first, lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    opt.add_param_group({"params": last})  # the update that ran during backward did not step these
    with pytest.raises(RuntimeError, match=(
        r"optimizer.step\(\) on rank 0: the optimizer has 2 parameter groups, but the update that already ran "
        r"during backward \(attach_optimizer\(overlap=True\)\) used 1; .* change the optimizer's parameter groups "
        r"before backward"
    )):
        opt.step()


def test_parameters_added_to_a_group_after_backward_raise_at_step(one_rank: None) -> None:
    model = _wrapped()
    first, last = _first_and_last_layer(model)
    opt = torch.optim.SGD(first, lr=0.1)
    model.attach_optimizer(opt, overlap=True)
    _backward(model, 0)
    opt.param_groups[0]["params"].extend(last)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] holds other parameters than when the update"):
        opt.step()


def test_a_parameter_group_added_between_steps_is_stepped_as_without_overlap(one_rank: None) -> None:
    finals = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = _wrapped()
        first, last = _first_and_last_layer(model)
        opt = torch.optim.SGD(first, lr=0.1, momentum=0.9)
        model.attach_optimizer(opt, overlap=overlap)
        for step in range(3):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
            if step == 0:
                opt.add_param_group({"params": last, "lr": 0.05})  # taken at the next backward
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
