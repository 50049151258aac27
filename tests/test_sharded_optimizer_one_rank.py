"""The sharded optimizer (``attach_optimizer(opt, shard=True)``) on a one-rank group in the test process: no spawn.

On one rank a bucket is a single shard (no padding, rank 0 owns every element), so the division by
the world size and the cuts between ranks are left to tests/test_sharded_optimizer.py. Everything
else in shard/optimizer.py is the same code and is checked here within seconds: the shards'
updates against stock DDP with the same plain optimizer (``torch.equal`` on every parameter, buffer
and consolidated state tensor after every step), the state moved along DDP's bucket rebuild, the
unsharded state dict and its loading, clipping, a dropped iteration, every refusal by its message,
and the small helpers directly (there also with pieces and ranks one rank's layout never makes).
"""

from __future__ import annotations

import copy
import math
import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.shard.layout import Piece, plan_bucket
from overlapddp.shard.optimizer import (
    ShardedOptimizer,
    _BucketShardState,
    _hyperparameters,
    _piece_of,
    memory_flat,
)
from tests import models

TINY = 0.001  # ~1 KiB caps: after DDP's rebuild (at the second forward) a bucket per parameter or two
ONE_PER_BUCKET = 1e-9  # a cap of 0 bytes: every parameter alone in its bucket, even one of 0 elements

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These models are tiny: with more than one intra-op thread, each op waits for threads that a
    busy machine (a mutation run's other worker) cannot schedule, 50 times slower here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- comparisons ------------------------------------------------------------------------------------


def _tensors_as_read(wrapper: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer read directly (as a forward reads them), not through ``state_dict()``,
    which would complete pending all-gathers itself."""
    module = wrapper.module
    return [*module.named_parameters(), *module.named_buffers()]


def _module_difference(ddp: nn.Module, ours: nn.Module, *, as_read: bool) -> str | None:
    """The first parameter or buffer that is not ``torch.equal``, or None."""
    if as_read:
        pairs = zip(_tensors_as_read(ddp), _tensors_as_read(ours), strict=True)
    else:
        pairs = zip(ddp.module.state_dict().items(), ours.module.state_dict().items(), strict=True)
    for (name, theirs), (_, mine) in pairs:
        if not torch.equal(theirs, mine):
            return name
    return None


def _state_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Where two optimizer state dicts differ (groups, entries, any tensor not ``torch.equal``), or None;
    also whether ``mine`` (the sharded one's) lists its state by parameter index."""
    if mine["param_groups"] != theirs["param_groups"]:
        return f"param_groups {mine['param_groups']} != {theirs['param_groups']}"
    mine_keys, their_keys = set(mine["state"]), set(theirs["state"])
    if mine_keys != their_keys:
        return f"state of parameters {sorted(mine_keys)} != {sorted(their_keys)}"
    if list(mine["state"]) != sorted(mine["state"]):  # a plain optimizer's order once every parameter stepped
        return f"state not in parameter order: {list(mine['state'])}"
    for index in sorted(their_keys):
        entry, expected = mine["state"][index], theirs["state"][index]
        if entry.keys() != expected.keys():
            return f"parameter {index}: entries {sorted(entry)} != {sorted(expected)}"
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                same = isinstance(entry[key], torch.Tensor) and torch.equal(entry[key], value)
            else:
                same = entry[key] == value
            if not same:
                return f"parameter {index}: {key}"
    return None


# -- training side by side --------------------------------------------------------------------------


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True, foreach=False)


def _sgd_foreach(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, foreach=True)


def _adam_amsgrad(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2, amsgrad=True, foreach=False)


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, foreach=True)


def _three_groups(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Biases first, then the last weight, then the other weights: the groups interleave the model's
    order (and the reducer's), and differ in lr, weight decay and betas."""
    params = list(params)
    weights = [p for p in params if p.dim() > 1]
    others = [p for p in params if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": others, "lr": 3e-2, "weight_decay": 0.0}, {"params": weights[-1:], "betas": (0.8, 0.9)},
         {"params": weights[:-1], "lr": 2e-2}],
        lr=1e-2, weight_decay=0.1,
    )


@dataclass(frozen=True)
class Case:
    model: str
    optimizer: MakeOptimizer
    cap: float | None = TINY
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 3  # DDP's rebuild comes at the second forward: the state moves to the new shards once
    accumulate: int = 1  # micro-batches per step, all but the last under no_sync()
    scheduler: bool = False  # an LR scheduler that halves lr every step
    attach_after: int = 0  # steps the optimizer takes unsharded before it is attached (then resharded)
    clip: float | None = None  # max_grad_norm
    set_to_none: bool = True  # zero_grad(set_to_none=...)


CASES = {
    "sgd_nesterov_weight_decay": Case("mlp", _sgd),
    "sgd_foreach_dampening_keep_grads": Case("mlp", _sgd_foreach, set_to_none=False),
    "sgd_one_bucket_default_cap": Case("mlp", _sgd, cap=None),
    "adam_amsgrad_transformer": Case("transformer", _adam_amsgrad, steps=2),
    "adamw_batchnorm_buffers": Case("cnn_bn", _adamw),
    "three_groups_interleaved_scheduler": Case("mlp", _three_groups, scheduler=True, steps=4),
    "frozen_parameter_in_the_optimizer": Case("cnn_frozen", _sgd),
    "channels_last_parameters": Case("cnn_channels_last", _adam_amsgrad),
    "tied_parameter": Case("tied_lm", _adam, steps=2),
    "find_unused_adam": Case("branchy", _adam, ddp_kwargs={"find_unused_parameters": True}, steps=4),
    "no_sync_accumulation_keep_grads": Case("mlp", _adamw, accumulate=2, set_to_none=False),
    "no_sync_accumulation_batched_copy": Case("cnn_bn", _sgd, accumulate=3, ddp_kwargs={"batched_grad_copy": True}),
    "resharded_after_two_plain_steps": Case("mlp", _adam_amsgrad, attach_after=2, steps=4),
    "resharded_sgd_after_one_plain_step": Case("cnn_bn", _sgd, attach_after=1),
    "clipped_sgd": Case("mlp", _sgd, clip=0.05),
    "clipped_three_groups": Case("mlp", _three_groups, clip=0.05, scheduler=True),
    "clip_above_the_norm_changes_nothing": Case("mlp", _adamw, clip=1e3),
    "clipped_find_unused": Case("branchy", _adam, ddp_kwargs={"find_unused_parameters": True}, clip=0.05, steps=4),
}


def _norm_in_bucket_order(ours: OverlapDDP, ddp: DistributedDataParallel) -> torch.Tensor:
    """The clipping norm the shards must find on one rank: the sum of squares of every present
    gradient (in float64, bucket by bucket), its root rounded once to float32."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    grads = [params[i].grad for bucket in ours.bucket_indices() for i in bucket if params[i].grad is not None]
    squares = [torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads]
    return torch.stack(squares).sum().sqrt().to(torch.float32)


def _after_backward(case: Case, ddp: Any, ours: OverlapDDP, sharded: ShardedOptimizer | None) -> list[str]:
    """After a synchronized backward: no reduced gradient left in ours' ``.grad`` (it lives in the
    shards); with clipping, the shards' norm checked and DDP's gradients clipped with it."""
    problems = []
    if sharded is None:
        return problems
    if not case.ddp_kwargs.get("find_unused_parameters"):  # else an unused parameter keeps its local one
        left = [name for name, p in ours.module.named_parameters() if p.grad is not None]
        if left:
            problems.append(f"reduced gradients left in .grad of {left}")
    if any(view.grad is not None for state in sharded._buckets for view in state.pieces):
        problems.append("a piece kept its gradient after its update (a view of a buffer the all-gather reuses)")
    if case.clip is not None:
        used, expected = sharded.last_grad_norm, _norm_in_bucket_order(ours, ddp)
        if used is None or not torch.equal(used, expected):
            problems.append(f"clipping norm {used} != {expected}")
        torch.nn.utils.clip_grads_with_norm_(ddp.parameters(), case.clip, expected)
    return problems


def _train_side_by_side(case: Case) -> list[str]:
    """Train stock DDP + the plain optimizer and OverlapDDP + the sharded one on the same batches;
    the problems found, per step (parameters as the next forward read them, the consolidated
    optimizer state, the reduced gradients left in ``.grad``, the clipping norm)."""
    kwargs = {"bucket_cap_mb": case.cap, **case.ddp_kwargs}
    ddp = DistributedDataParallel(models.build(case.model), **kwargs)
    ours = OverlapDDP(models.build(case.model), **kwargs)
    ddp_opt, our_opt = case.optimizer(ddp.parameters()), case.optimizer(ours.parameters())
    sharded = None
    if case.attach_after == 0:  # before the schedulers wrap step()
        sharded = ours.attach_optimizer(our_opt, shard=True, max_grad_norm=case.clip)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                  for opt in (ddp_opt, our_opt) if case.scheduler]
    problems = []
    for step in range(case.steps):
        if step == case.attach_after and sharded is None:
            sharded = ours.attach_optimizer(our_opt, shard=True, max_grad_norm=case.clip)
        for micro in range(case.accumulate):
            inputs, target = models.batch(case.model, 0, step * case.accumulate + micro)
            synchronized = micro == case.accumulate - 1
            for wrapper in (ours, ddp):
                with nullcontext() if synchronized else wrapper.no_sync():
                    models.loss_of(wrapper(inputs), target).backward()
            if step and micro == 0 and (name := _module_difference(ddp, ours, as_read=True)):
                problems.append(f"step {step - 1}: {name} as read by the next forward")
        problems += [f"step {step}: {problem}" for problem in _after_backward(case, ddp, ours, sharded)]
        for opt in (our_opt, ddp_opt):
            opt.step()
            opt.zero_grad(set_to_none=case.set_to_none)
        for scheduler in schedulers:
            scheduler.step()
        if difference := _state_difference(our_opt.state_dict(), ddp_opt.state_dict()):
            problems.append(f"step {step}: optimizer state: {difference}")
    if name := _module_difference(ddp, ours, as_read=False):
        problems.append(f"after the last step: {name}")
    return problems


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sharded_training_is_bit_equal_to_ddp_with_the_same_optimizer(one_rank: None, case: Case) -> None:
    """Every parameter, buffer and state tensor ``torch.equal`` to DDP's after every step: with the
    state moved along DDP's rebuild, schedulers, no_sync, unused and frozen parameters, clipping."""
    assert _train_side_by_side(case) == []


class _WithEmptyParameter(nn.Module):
    """A parameter of 0 elements, used: with one parameter per bucket, its bucket has no element."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x))) + self.empty.sum()  # its gradient is ready first


def test_a_parameter_of_0_elements_is_stepped_saved_and_loaded_as_by_ddp(one_rank: None) -> None:
    """After the rebuild the empty parameter is alone in the first bucket (no element): its empty
    piece there is stepped, so its (empty) state is DDP's, across a plain checkpoint loaded at step 1
    too, and the buckets after it still update and load."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_WithEmptyParameter(), bucket_cap_mb=ONE_PER_BUCKET)
    torch.manual_seed(0)
    ours = OverlapDDP(_WithEmptyParameter(), bucket_cap_mb=ONE_PER_BUCKET)
    ddp_opt, our_opt = _adam(ddp.parameters()), _adam(ours.parameters())
    sharded = ours.attach_optimizer(our_opt, shard=True)
    for step in range(4):
        inputs, target = models.batch("mlp", 0, step)
        for wrapper, opt in ((ours, our_opt), (ddp, ddp_opt)):
            models.loss_of(wrapper(inputs), target).backward()
            opt.step()
            opt.zero_grad()
        if step == 1:
            assert ours.bucket_indices()[0] == [0] and sharded._buckets[0].shard.shard_length == 0
            checkpoint = copy.deepcopy(ddp_opt.state_dict())
            assert 0 in checkpoint["state"]  # the plain optimizer's entry for the empty parameter
            checkpoint["param_groups"][0]["lr"] = 3e-2
            ddp_opt.load_state_dict(copy.deepcopy(checkpoint))
            our_opt.load_state_dict(checkpoint)
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None, f"step {step}"
    assert sharded.local_pieces() == [Piece(p, 0, ours.module.get_parameter(n).numel(), 0)
                                      for p, n in ((0, "empty"), (4, "out.bias"), (3, "out.weight"),
                                                   (2, "hidden.bias"), (1, "hidden.weight"))]


# -- the unsharded state dict ---------------------------------------------------------------------


def test_a_param_group_added_after_attaching_is_refused(one_rank: None) -> None:
    """The shards were cut from the groups at attach: a new group would have no shard on any rank."""
    model = OverlapDDP(models.build("mlp"), bucket_cap_mb=TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, shard=True)
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"add_param_group\(\) on rank 0: a sharded optimizer's parameter groups are fixed"):
        opt.add_param_group({"params": [extra], "lr": 0.5})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("ignore, refused", [(["head.weight"], None), (["embed.weight"], None),
                                              (["embed.weight", "head.weight"], "embed.weight")])
def test_a_tied_weight_is_refused_only_when_no_name_of_it_is_reduced(
    one_rank: None, ignore: list[str], refused: str | None
) -> None:
    """Ignored under one of its names, a tied weight is still reduced under the other (as by DDP):
    it has a shard. Ignored under both it has none, and is named by its first name."""
    net = models.build("tied_lm")
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ignore)
    model = OverlapDDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"wrapper ignores \({refused}\)") if refused else nullcontext():
        model.attach_optimizer(opt, shard=True)
    assert any(p is net.embed.weight for p in model._reducer.params) is (refused is None)


def _pair(model: str, make: MakeOptimizer, cap: float | None = TINY) -> tuple[Any, Any, Any, Any, ShardedOptimizer]:
    """DDP with a plain optimizer, OverlapDDP with a sharded one, both fresh from the same seed."""
    ddp = DistributedDataParallel(models.build(model), bucket_cap_mb=cap)
    ours = OverlapDDP(models.build(model), bucket_cap_mb=cap)
    ddp_opt, our_opt = make(ddp.parameters()), make(ours.parameters())
    return ddp, ddp_opt, ours, our_opt, ours.attach_optimizer(our_opt, shard=True)


def _step_both(model: str, pairs: Iterable[tuple[nn.Module, torch.optim.Optimizer]], step: int) -> None:
    inputs, target = models.batch(model, 0, step)
    for wrapper, opt in pairs:
        models.loss_of(wrapper(inputs), target).backward()
        opt.step()
        opt.zero_grad()


def test_a_fresh_state_dict_equals_the_plain_optimizers(one_rank: None) -> None:
    """Before any step: no state, and the groups packed as ``Optimizer.state_dict()`` packs them
    (interleaved groups and a frozen parameter the reducer does not hold)."""
    for model in ("mlp", "cnn_frozen"):
        _, ddp_opt, _, our_opt, sharded = _pair(model, _three_groups)
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None
        assert sharded.local_state() == [] and sharded.local_state_bytes() == 0


def test_the_consolidated_state_resumes_a_plain_optimizer_bit_exactly(one_rank: None) -> None:
    """A plain optimizer that loads the sharded one's state dict (after the rebuild moved it) goes on
    exactly as the sharded one does."""
    ddp, ddp_opt, ours, our_opt, _ = _pair("mlp", _three_groups)
    for step in range(3):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
    plain = DistributedDataParallel(models.build("mlp"), bucket_cap_mb=TINY)
    plain.module.load_state_dict(ours.module.state_dict())
    plain_opt = _three_groups(plain.parameters())
    plain_opt.load_state_dict(copy.deepcopy(our_opt.state_dict()))
    for step in range(3, 5):
        _step_both("mlp", ((ours, our_opt), (plain, plain_opt)), step)
        assert _module_difference(plain, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), plain_opt.state_dict()) is None, f"step {step}"


@pytest.mark.parametrize("make", [_adam_amsgrad, _sgd], ids=["adam_amsgrad", "sgd"])
def test_a_plain_state_loaded_just_before_the_rebuild_moves_to_the_new_shards(one_rank: None, make: MakeOptimizer) -> None:
    """A plain optimizer's checkpoint (other lr, other moments) loaded after the first step, so the
    next forward's relayout must move what was loaded, not what was stepped; then as DDP resumed from it."""
    source, source_opt, _, _, _ = _pair("mlp", make)
    for step in range(2):
        _step_both("mlp", ((source, source_opt),), 10 + step)
    checkpoint = copy.deepcopy(source_opt.state_dict())
    for group in checkpoint["param_groups"]:
        group["lr"] = group["lr"] * 0.5
    ddp, ddp_opt, ours, our_opt, _ = _pair("mlp", make)
    _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), 0)
    for wrapper, opt in ((ours, our_opt), (ddp, ddp_opt)):
        wrapper.module.load_state_dict(source.module.state_dict())
        opt.load_state_dict(copy.deepcopy(checkpoint))
    assert our_opt.param_groups[0]["lr"] == ddp_opt.param_groups[0]["lr"]
    for step in range(1, 4):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None, f"step {step}"


def test_an_empty_state_loaded_clears_the_shards_state(one_rank: None) -> None:
    """A fresh optimizer's state dict (no state) loaded after two steps drops every moment, as on the
    plain optimizer; the next steps start over from there."""
    ddp, ddp_opt, ours, our_opt, sharded = _pair("mlp", _adam)
    for step in range(2):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
    fresh = _adam(models.build("mlp").parameters()).state_dict()
    ddp_opt.load_state_dict(copy.deepcopy(fresh))
    our_opt.load_state_dict(fresh)
    assert sharded.local_state() == [] and our_opt.state_dict()["state"] == {}
    for step in range(2, 4):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None, f"step {step}"


def test_local_state_bytes_are_the_plain_optimizers_on_one_rank(one_rank: None) -> None:
    """One rank holds every piece: its state is exactly the plain optimizer's, byte for byte."""
    ddp, ddp_opt, ours, our_opt, sharded = _pair("mlp", _adam_amsgrad)
    for step in range(3):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
        plain = sum(value.numel() * value.element_size() for entry in ddp_opt.state.values()
                    for value in entry.values() if isinstance(value, torch.Tensor))
        assert sharded.local_state_bytes() == plain, f"step {step}"


@pytest.mark.parametrize("state_dict, match", [
    ([], "Expected an optimizer state dict with 'state' and 'param_groups'"),
    ({"state": {}}, "Expected an optimizer state dict with 'state' and 'param_groups'"),
    ({"param_groups": [{"params": [0, 1, 2, 3, 4, 5]}]}, "Expected an optimizer state dict with 'state' and"),
    ({"state": {}, "param_groups": {"params": [0]}}, "Expected an optimizer state dict with 'state' and"),
    ({"state": {}, "param_groups": [{"params": [0, 1, 2, 3, 4]}]},
     r"has parameter groups of sizes \[5\], but this optimizer's are \[6\]"),
    ({"state": {}, "param_groups": [{"params": [0, 1, 2]}, {"params": [3, 4, 5]}]},
     r"sizes \[3, 3\], but this optimizer's are \[6\]"),
    ({"state": {}, "param_groups": [{"params": [0, 1, 2, 3, 4, 5]}, {"params": [6]}]},
     r"sizes \[6, 1\], but this optimizer's are \[6\]"),
    ({"state": {2: {"momentum_buffer": torch.zeros(64, 15)}}, "param_groups": [{"params": [0, 1, 2, 3, 4, 5]}]},
     r"The loaded state 'momentum_buffer' of 2\.weight has shape \(64, 15\), expected \(64, 64\)\."),
    ({"state": {5: {"momentum_buffer": torch.zeros(11)}}, "param_groups": [{"params": [0, 1, 2, 3, 4, 5]}]},
     r"The loaded state 'momentum_buffer' of 4\.bias has shape \(11,\), expected \(10,\)\."),
])
def test_a_state_dict_that_does_not_fit_is_refused_by_name(one_rank: None, state_dict: Any, match: str) -> None:
    """Each malformed or mismatched checkpoint names what is wrong: its form, its group sizes, or
    the entry, parameter and shapes."""
    _, _, ours, our_opt, _ = _pair("mlp", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=match):
        our_opt.load_state_dict(state_dict)


# -- the iteration: steps, pending all-gathers, failures --------------------------------------------


def test_step_checks_that_a_synchronized_backward_updated_the_shards(one_rank: None) -> None:
    """step() raises before any backward, twice after one, after a no_sync backward, and with a
    closure; it passes once per synchronized backward."""
    model = OverlapDDP(models.build("mlp"), bucket_cap_mb=TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, shard=True)
    none_since = r"optimizer\.step\(\) on rank 0: with shard=True .* none has run since the last step"
    with pytest.raises(RuntimeError, match=none_since):
        opt.step()
    for step in range(2):
        inputs, target = models.batch("mlp", 0, step)
        models.loss_of(model(inputs), target).backward()
        with pytest.raises(NotImplementedError, match="A sharded optimizer cannot re-evaluate a closure"):
            opt.step(lambda: torch.zeros(()))
        opt.step()
        with pytest.raises(RuntimeError, match=none_since):
            opt.step()
    with model.no_sync():
        models.loss_of(model(inputs), target).backward()
    with pytest.raises(RuntimeError, match=none_since):
        opt.step()


def test_updated_parameters_arrive_at_the_next_forward_or_state_dict(one_rank: None) -> None:
    """After backward the parameters still hold their old values (the all-gathers wait); the next
    forward, ``state_dict()`` and ``gather_parameters()`` complete them, once."""
    ddp, ddp_opt, ours, our_opt, sharded = _pair("mlp", _sgd)
    for step in range(3):  # the second and third backward run in the rebuilt buckets
        before = {name: p.detach().clone() for name, p in ours.module.named_parameters()}
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
        assert all(torch.equal(p, before[name]) for name, p in ours.module.named_parameters())
        if step == 0:
            sharded.gather_parameters()
        elif step == 1:
            ours.module.state_dict()
        else:
            inputs, _ = models.batch("mlp", 0, step)
            with torch.no_grad():
                ours(inputs)
        assert _module_difference(ddp, ours, as_read=True) is None, f"step {step}"
        sharded.gather_parameters()  # nothing left to complete: the values stay
        assert _module_difference(ddp, ours, as_read=True) is None, f"step {step}"


def test_a_state_dict_loaded_before_the_next_forward_wins_over_the_pending_gathers(one_rank: None) -> None:
    """Loading parameters between backward and forward, as with DDP, replaces the updated values."""
    _, _, ours, our_opt, _ = _pair("mlp", _sgd)
    saved = copy.deepcopy(ours.module.state_dict())
    for step in range(2):
        _step_both("mlp", ((ours, our_opt),), step)
    ours.module.load_state_dict(saved)
    ours(models.batch("mlp", 0, 5)[0])
    assert all(torch.equal(p, saved[name]) for name, p in ours.module.named_parameters())


class _FailedWait:
    """A started all-gather whose wait fails (a peer died)."""

    def wait(self) -> None:
        raise RuntimeError("simulated peer death")


class _Linears(nn.Sequential):
    """``count`` parameters in one bucket (default cap): Linear layers, the last without bias when odd."""

    def __init__(self, count: int) -> None:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4) for _ in range(count // 2)] + ([nn.Linear(4, 4, bias=False)] if count % 2 else [])
        super().__init__(*layers)


@pytest.mark.parametrize("count, listed", [
    (4, r"\(4 parameters: 0\.weight, 0\.bias, 1\.weight, 1\.bias\)"),
    (5, r"\(5 parameters: 0\.weight, 0\.bias, 1\.weight, 1\.bias, \.\.\.\)"),
], ids=["four_listed", "five_cut_at_four"])
def test_a_failed_all_gather_names_its_bucket_parameters_and_rank(one_rank: None, count: int, listed: str) -> None:
    """The next forward raises, naming the bucket, up to four of its parameters, and the rank."""
    model = OverlapDDP(_Linears(count))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = model.attach_optimizer(opt, shard=True)
    sharded.gather_start = lambda gathered, shard: _FailedWait()
    inputs = torch.ones(2, 4)
    model(inputs).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match=rf"of bucket 0 {listed} failed on rank 0: simulated peer death\. "
                                           "Another rank may have died") as raised:
        model(inputs)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_a_failed_all_gather_of_a_later_bucket_names_that_bucket(one_rank: None) -> None:
    """After the rebuild (three buckets), only the second bucket's all-gather fails: the error names
    bucket 1 and its parameters, and bucket 0's parameters were completed before it."""
    ddp, ddp_opt, ours, our_opt, sharded = _pair("mlp", _sgd)
    _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), 0)
    real_start, started = sharded.gather_start, []

    def second_fails(gathered: torch.Tensor, shard: torch.Tensor) -> Any:
        started.append(None)
        return _FailedWait() if len(started) == 2 else real_start(gathered, shard)

    sharded.gather_start = second_fails
    _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), 1)
    assert ours.bucket_indices() == [[5, 4], [3, 2], [1, 0]]
    with pytest.raises(RuntimeError, match=r"bucket 1 \(2 parameters: 2\.bias, 2\.weight\) failed on rank 0"):
        ours.module.state_dict()
    assert torch.equal(ours.module[4].weight, ddp.module[4].weight)  # bucket 0: completed first
    assert not torch.equal(ours.module[2].weight, ddp.module[2].weight)  # bucket 1: its old values


class _FailedReduction:
    """A started reduction whose future holds an error (a peer timed out)."""

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("simulated collective timeout"))
        return future


def test_an_iteration_dropped_mid_reduction_leaves_no_clipping_state_behind(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With clipping, bucket 0 waits for the norm when bucket 1's reduction fails: the dropped
    iteration's waiting updates, their shares of the norm and their pieces' gradients must go, so
    the next steps equal those of a model that never ran the failed backward."""
    seed = models.build("mlp")
    wrappers = [OverlapDDP(copy.deepcopy(seed), bucket_cap_mb=TINY) for _ in range(2)]
    opts = [torch.optim.SGD(w.parameters(), lr=0.05, momentum=0.9) for w in wrappers]
    shardeds = [w.attach_optimizer(o, shard=True, max_grad_norm=0.05) for w, o in zip(wrappers, opts, strict=True)]
    (failing, fresh), (failing_opt, fresh_opt) = wrappers, opts
    _step_both("mlp", ((failing, failing_opt), (fresh, fresh_opt)), 0)
    launches = []
    real = dist.all_reduce  # over gloo each bucket is all-reduced in place (shard/collectives.py)

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        launches.append(None)
        return _FailedReduction() if len(launches) == 2 else real(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(dist, "all_reduce", second_fails)
        with pytest.raises(RuntimeError, match="The reduction of bucket 1"):
            _step_both("mlp", ((failing, failing_opt),), 1)
    assert all(view.grad is None for state in shardeds[0]._buckets for view in state.pieces)
    failing_opt.zero_grad()
    for step in range(2, 5):
        _step_both("mlp", ((failing, failing_opt), (fresh, fresh_opt)), step)
        assert _module_difference(fresh, failing, as_read=False) is None, f"step {step}"
        assert _state_difference(failing_opt.state_dict(), fresh_opt.state_dict()) is None, f"step {step}"
        assert torch.equal(shardeds[0].last_grad_norm, shardeds[1].last_grad_norm), f"step {step}"


@pytest.mark.parametrize("ready_order, named", [
    # [[0], [1, 2], [3, 4], [5]]
    ([0, 1, 2, 3, 4, 5], "Bucket 0 on rank 0 holds 1 parameters: 0.weight, but the shard layout was built for "
                         "2 parameters: 4.bias, 4.weight"),
    # [[5, 4], [1, 2], [3, 0]]: the same sizes, and bucket 0 (the first to launch) unchanged
    ([5, 4, 1, 2, 3, 0], "Bucket 1 on rank 0 holds 2 parameters: 0.bias, 2.weight, but the shard layout was built "
                         "for 2 parameters: 2.bias, 2.weight"),
], ids=["other_sizes", "same_sizes_other_order"])
def test_buckets_changed_between_forward_and_backward_are_refused(one_rank: None, ready_order: list[int], named: str) -> None:
    """A layout restored after the forward: the backward's buckets are not those the shards follow
    ([[5, 4], [3, 2], [1, 0]], rebuilt at that forward), even where their sizes happen to match; the
    error names the first bucket that differs, what it holds now and what the layout was built for."""
    _, _, ours, our_opt, _ = _pair("mlp", _sgd)
    _step_both("mlp", ((ours, our_opt),), 0)
    inputs, target = models.batch("mlp", 0, 1)
    loss = models.loss_of(ours(inputs), target)
    ours.load_bucket_state({"ready_order": ready_order})
    with pytest.raises(RuntimeError, match=re.escape(f"{named}: the buckets changed without a forward in between")):
        loss.backward()


def test_a_changed_first_bucket_is_named_whichever_way_its_members_sort(one_rank: None) -> None:
    """Shards built for a restored registration-order layout ([[0], [1, 2], [3, 4], [5]]), then DDP's
    ready order restored after the forward: bucket 0 differs, and its members now sort after the old ones."""
    _, _, ours, our_opt, _ = _pair("mlp", _sgd)
    _step_both("mlp", ((ours, our_opt),), 0)
    ours.load_bucket_state({"ready_order": [0, 1, 2, 3, 4, 5]})
    inputs, target = models.batch("mlp", 0, 1)
    loss = models.loss_of(ours(inputs), target)
    assert ours.bucket_indices() == [[0], [1, 2], [3, 4], [5]]
    ours.load_bucket_state({"ready_order": [5, 4, 3, 2, 1, 0]})
    named = "Bucket 0 on rank 0 holds 2 parameters: 4.bias, 4.weight, but the shard layout was built for 1 parameters: 0.weight"
    with pytest.raises(RuntimeError, match=re.escape(f"{named}: the buckets changed without a forward in between")):
        loss.backward()


def test_the_same_buckets_restored_between_forward_and_backward_are_kept(one_rank: None) -> None:
    """A restored layout equal to the one in force leaves the shards valid: the step goes on as DDP's."""
    ddp, ddp_opt, ours, our_opt, _ = _pair("mlp", _sgd)
    _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), 0)
    inputs, target = models.batch("mlp", 0, 1)
    losses = [models.loss_of(wrapper(inputs), target) for wrapper in (ours, ddp)]
    ours.load_bucket_state(ours.bucket_state())
    for loss, opt in zip(losses, (our_opt, ddp_opt), strict=True):
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert _module_difference(ddp, ours, as_read=False) is None
    assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None


def test_restored_layouts_move_the_state_each_time(one_rank: None) -> None:
    """Layouts restored between steps (``load_bucket_state``): one equal to the layout in force
    (another plan of the same buckets), then two in a row with only an evaluation forward between
    them, so the second relayout follows the first without an update: each moves the state, and
    training goes on as DDP's (whose layout, on one rank, changes no number)."""
    ddp, ddp_opt, ours, our_opt, _ = _pair("mlp", _adam)
    for step in range(5):
        _step_both("mlp", ((ours, our_opt), (ddp, ddp_opt)), step)
        if step == 1:
            ours.load_bucket_state(ours.bucket_state())
        if step == 2:
            ours.load_bucket_state({"ready_order": [0, 1, 2, 3, 4, 5]})
            with torch.no_grad():
                ours(models.batch("mlp", 0, 0)[0])
            assert ours.bucket_indices() == [[0], [1, 2], [3, 4], [5]]
            ours.load_bucket_state({"ready_order": [5, 4, 1, 2, 3, 0]})
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None, f"step {step}"
    assert ours.bucket_indices() == [[5, 4], [1, 2], [3, 0]]


def _local_gradient(step: int) -> torch.Tensor:
    """A gradient of never.weight's shape (10, 32) in another layout each step: transposed strides,
    every other column of a wider tensor (not dense), then the parameter's own."""
    values = torch.arange(320.0).reshape(10, 32) / 320 + step
    if step == 0:
        return values.t().contiguous().t()  # strides (1, 10)
    if step == 1:
        wide = torch.zeros(10, 64)
        wide[:, ::2] = values
        return wide[:, ::2]  # strides (64, 2)
    return values  # strides (32, 1)


@pytest.mark.filterwarnings("ignore:Grad strides do not match bucket view strides")  # stock DDP, on purpose
def test_a_local_gradient_of_a_parameter_no_rank_used_is_stepped_as_by_ddp(one_rank: None) -> None:
    """find_unused_parameters: a parameter unused in the synchronized backward keeps its local
    ``.grad`` (here set by hand, in layouts other than the parameter's), and the shards step it as
    DDP's optimizer does; head_b, used only under no_sync, is reduced as DDP reduces it."""
    kwargs = {"bucket_cap_mb": TINY, "find_unused_parameters": True}
    ddp = DistributedDataParallel(models.build("branchy"), **kwargs)
    ours = OverlapDDP(models.build("branchy"), **kwargs)
    ddp_opt, our_opt = _adam(ddp.parameters()), _adam(ours.parameters())
    ours.attach_optimizer(our_opt, shard=True)
    positive, negative = torch.randn(8, 16).abs(), -torch.randn(8, 16).abs()  # head_a, head_b
    target = torch.randint(0, 10, (8,))
    for step in range(3):
        for wrapper in (ours, ddp):
            with wrapper.no_sync():
                models.loss_of(wrapper(negative + step), target).backward()  # head_b: a local gradient
            wrapper.module.never.weight.grad = _local_gradient(step)
            models.loss_of(wrapper(positive), target).backward()  # head_a only: head_b, never unused
        assert torch.equal(ours.module.never.weight.grad, _local_gradient(step))  # kept, not reduced
        assert ours.module.head_a.weight.grad is None  # reduced: in the shards only
        for opt in (our_opt, ddp_opt):
            opt.step()
            opt.zero_grad()
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        assert _state_difference(our_opt.state_dict(), ddp_opt.state_dict()) is None, f"step {step}"


# -- refusals at construction -----------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [0.0, -0.5, math.nan])
def test_a_max_grad_norm_that_is_not_positive_is_refused(one_rank: None, max_grad_norm: float) -> None:
    """Zero, negative and NaN norms clip nothing sensible; a tiny positive one is accepted."""
    model = OverlapDDP(models.build("mlp"))
    with pytest.raises(ValueError, match=rf"max_grad_norm must be positive, got {max_grad_norm!r}\."):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True, max_grad_norm=max_grad_norm)
    assert not model._reducer.sharded  # refused before anything is rebound
    sharded = model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True, max_grad_norm=1e-12)
    assert sharded.max_grad_norm == 1e-12 and sharded.last_grad_norm is None


# -- helpers and small accessors --------------------------------------------------------------------


def test_memory_flat_reads_elements_in_memory_order() -> None:
    """A transposed tensor flattens as its memory holds it; a view keeps its storage offset."""
    base = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(memory_flat(base.t()), torch.arange(12.0))
    assert torch.equal(memory_flat(base[1]), torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert memory_flat(base).data_ptr() == base.data_ptr()  # a view, not a copy
    channels_last = torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)
    assert torch.equal(memory_flat(channels_last), channels_last.permute(0, 2, 3, 1).flatten())
    assert torch.equal(_piece_of(base.t(), Piece(0, 5, 3, 0)), torch.tensor([5.0, 6.0, 7.0]))


def test_hyperparameters_are_everything_but_the_parameters() -> None:
    """What is mirrored into the inner optimizers before every update, and packed into state dicts."""
    group = {"params": [torch.zeros(1)], "lr": 0.1, "betas": (0.9, 0.99), "foreach": None}
    assert _hyperparameters(group) == {"lr": 0.1, "betas": (0.9, 0.99), "foreach": None}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_reduced_pieces_are_views_of_this_ranks_slice_of_the_buffer(rank: int) -> None:
    """At 3 ranks, rank ``rank`` reads each of its pieces' reduced gradient at its own offsets."""
    shard = plan_bucket(0, [0, 1, 2], [3, 4, 2], world_size=3, rank=rank)  # 9 elements, shards of 3
    buffer = torch.arange(9.0)
    state = _BucketShardState(shard, torch.zeros(3), [], None, buffer)
    expected = {0: [[0.0, 1.0, 2.0]], 1: [[3.0, 4.0, 5.0]], 2: [[6.0], [7.0, 8.0]]}[rank]
    pieces = state.reduced_pieces(rank)
    assert [piece.tolist() for piece in pieces] == expected
    assert all(piece.data_ptr() == buffer[3 * rank + p.shard_offset].data_ptr()
               for piece, p in zip(pieces, shard.pieces, strict=True))
    assert ShardedOptimizer._entries(state) == []  # no inner optimizer: no state


def _channels_last_sharded() -> tuple[OverlapDDP, ShardedOptimizer]:
    model = OverlapDDP(models.build("cnn_channels_last"))
    return model, model.attach_optimizer(_adam(model.parameters()), shard=True)


def test_pieces_of_several_ranks_are_stitched_in_the_parameters_memory_order(one_rank: None) -> None:
    """A parameter cut in two pieces (as two ranks hold it): its per-element state is stitched in
    memory order into its own strides, the per-parameter entries copied once."""
    model, sharded = _channels_last_sharded()
    weight = model.module[0].weight  # (8, 3, 3, 3), channels_last
    numel = weight.numel()
    flat = torch.arange(float(numel))
    parts = [
        (Piece(0, 0, 100, 0), {"exp_avg": flat[:100].clone(), "step": torch.tensor(3.0), "note": "a"}),
        (Piece(0, 100, numel - 100, 0), {"exp_avg": flat[100:].clone(), "step": torch.tensor(3.0), "note": "a"}),
    ]
    entry = sharded._assemble(0, parts)
    assert entry["exp_avg"].stride() == weight.stride()
    assert torch.equal(memory_flat(entry["exp_avg"]), flat)
    assert torch.equal(entry["step"], torch.tensor(3.0)) and entry["step"] is not parts[0][1]["step"]
    assert entry["note"] == "a"
    whole = sharded._slice("exp_avg", entry["exp_avg"].contiguous(), Piece(0, 100, 20, 0))
    assert torch.equal(whole, flat[100:120])
    step = torch.tensor(3.0)
    assert torch.equal(sharded._slice("step", step, Piece(0, 100, 20, 0)), step)
    assert sharded._slice("step", step, Piece(0, 100, 20, 0)) is not step
    assert sharded._slice("exp_avg", 7, Piece(0, 100, 20, 0)) == 7  # not a tensor: kept as is


@pytest.mark.parametrize("which", ["too_few_elements", "overlapping", "an_entry_more", "an_entry_less"])
def test_pieces_that_do_not_fit_together_are_refused_naming_the_parameter(one_rank: None, which: str) -> None:
    """Pieces covering less or more than the parameter, or with different entries, were not updated alike."""
    _, sharded = _channels_last_sharded()
    numel = 216
    if which == "too_few_elements":
        parts = [(Piece(0, 0, 100, 0), {"exp_avg": torch.zeros(100)}), (Piece(0, 100, 50, 0), {"exp_avg": torch.zeros(50)})]
        covered = 150
    elif which == "overlapping":
        parts = [(Piece(0, 0, 100, 0), {"exp_avg": torch.zeros(100)}),
                 (Piece(0, 50, numel - 50, 0), {"exp_avg": torch.zeros(numel - 50)})]
        covered = numel + 50
    else:  # the second piece has an entry more, or one less, than the first
        fewer, more = {"exp_avg": torch.zeros(100)}, {"exp_avg": torch.zeros(100), "step": torch.tensor(1.0)}
        first, second = (fewer, more) if which == "an_entry_more" else (more, fewer)
        second = {key: value if key == "step" else torch.zeros(numel - 100) for key, value in second.items()}
        parts = [(Piece(0, 0, 100, 0), first), (Piece(0, 100, numel - 100, 0), second)]
        covered = numel
    with pytest.raises(RuntimeError, match=rf"The optimizer state of 0\.weight covers {covered} of its {numel} "
                                           "elements with differing entries"):
        sharded._assemble(0, parts)


def test_the_accessors_describe_one_ranks_pieces(one_rank: None) -> None:
    """On one rank every piece is a whole parameter, in bucket order; the accessors the checkpoint
    code reads say so."""
    _, _, ours, our_opt, sharded = _pair("mlp", _adam)
    _step_both("mlp", ((ours, our_opt),), 0)
    ours(models.batch("mlp", 0, 1)[0])  # the rebuild's relayout
    numels = [p.numel() for p in ours.module.parameters()]
    order = [i for bucket in ours.bucket_indices() for i in bucket]
    offsets = [sum(numels[j] for j in bucket[:slot]) for bucket in ours.bucket_indices() for slot in range(len(bucket))]
    assert sharded.local_pieces() == [Piece(i, 0, numels[i], offset) for i, offset in zip(order, offsets, strict=True)]
    assert [sharded.param_numel(i) for i in range(6)] == numels
    assert sharded.param_names == [name for name, _ in ours.module.named_parameters()]
    assert sharded.elementwise_keys == frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
    assert sharded.process_group is ours.process_group and sharded.world_size == 1 and sharded.rank == 0
    assert [piece.param for piece, _ in sharded.local_state()] == order
    assert sharded.packed_groups() == our_opt.state_dict()["param_groups"]
    assert sharded.packed_groups()[0]["params"] == list(range(6))


class _TwoDtypes(nn.Module):
    """A float64 layer and a float32 one: buckets of two dtypes, the float64 one first or last."""

    def __init__(self, double_first: bool) -> None:
        super().__init__()
        layers = {"wide": nn.Linear(16, 8).double(), "narrow": nn.Linear(16, 8)}
        for name in ("wide", "narrow") if double_first else ("narrow", "wide"):  # registration decides bucket order
            self.add_module(name, layers[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x.double()).float() + self.narrow(x)


@pytest.mark.parametrize("double_first", [True, False])
def test_the_clipping_norm_of_two_dtypes_has_clip_grad_norms_dtype(one_rank: None, double_first: bool) -> None:
    """clip_grad_norm_ returns the norm in the promoted dtype of the gradients (float64 here): the
    shards' norm has it too, whichever dtype's bucket comes first."""
    torch.manual_seed(0)
    model = OverlapDDP(_TwoDtypes(double_first), bucket_cap_mb=TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = model.attach_optimizer(opt, shard=True, max_grad_norm=1e-3)
    inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    model(inputs).square().sum().backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.float64}
    assert sharded.last_grad_norm is not None and sharded.last_grad_norm.dtype == torch.float64


def test_clipping_scales_a_kept_local_gradient_in_place_as_ddps_clip_does(one_rank: None) -> None:
    """A parameter no rank used keeps its local ``.grad`` (the parameter's own layout); clipping with
    ``max_grad_norm`` scales that very tensor, as ``clip_grad_norm_`` scales DDP's ``.grad`` (with the
    shards' norm: its rounding is checked by the clipped cases above)."""
    kwargs = {"bucket_cap_mb": TINY, "find_unused_parameters": True}
    ddp = DistributedDataParallel(models.build("branchy"), **kwargs)
    ours = OverlapDDP(models.build("branchy"), **kwargs)
    ddp_opt, our_opt = _sgd(ddp.parameters()), _sgd(ours.parameters())
    ours.attach_optimizer(our_opt, shard=True, max_grad_norm=0.05)
    positive, target = torch.randn(8, 16).abs(), torch.randint(0, 10, (8,))
    for step in range(2):
        for wrapper in (ours, ddp):
            wrapper.module.never.weight.grad = _local_gradient(2) + step  # the parameter's strides
            models.loss_of(wrapper(positive), target).backward()
        torch.nn.utils.clip_grads_with_norm_(ddp.parameters(), 0.05, _norm_in_bucket_order(ours, ddp))
        for opt in (our_opt, ddp_opt):
            opt.step()
        assert torch.equal(ours.module.never.weight.grad, ddp.module.never.weight.grad), f"step {step}"
        assert _module_difference(ddp, ours, as_read=False) is None, f"step {step}"
        for opt in (our_opt, ddp_opt):
            opt.zero_grad()


def test_a_one_parameter_models_state_moves_along_the_rebuild(one_rank: None) -> None:
    """DDP's rebuild after the first step replaces the plan, even of one bucket: the state moves
    from the first parameter's device (the only one)."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1, bias=False)
    plain = copy.deepcopy(net)
    ours = OverlapDDP(net)
    our_opt, plain_opt = _adam(ours.parameters()), _adam(plain.parameters())
    ours.attach_optimizer(our_opt, shard=True)
    for step in range(3):
        inputs = torch.randn(4, 3) + step
        for model, opt in ((ours, our_opt), (plain, plain_opt)):
            opt.zero_grad()
            model(inputs).square().sum().backward()
            opt.step()
        ours.module.state_dict()  # completes the all-gather
        assert torch.equal(ours.module.weight, plain.weight), f"step {step}"


def test_a_failed_all_gather_reports_the_ranks_behind_after_the_reduction(one_rank: None) -> None:
    """The all-gather follows this rank's last reduction: the progress records are read for it."""
    model = OverlapDDP(_Linears(2))
    sharded = model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True)
    asked: list[tuple[int, bool]] = []

    def behind(bucket: int, after_reduction: bool = False) -> str:
        asked.append((bucket, after_reduction))
        return " (the ranks behind)"

    model._reducer.progress.behind = behind  # type: ignore[method-assign]
    error = sharded._gather_failed(0, RuntimeError("lost"))
    assert asked == [(0, True)] and "failed on rank 0: lost. Another rank may have died or timed out. (the ranks" in str(error)
