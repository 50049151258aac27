"""Sharded optimizer (``attach_optimizer(opt, shard=True)``): bit-equal to DDP + the same optimizer.

One spawn per world size runs the whole matrix: after every step, every parameter and buffer
(``torch.equal``) and every optimizer state tensor of the consolidated state dict are compared with
stock DDP's and its plain optimizer's. Refusals run on one rank, before any collective.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.shard.checkpoint import load_sharded, save_sharded
from overlapddp.testing import delay_communication, delay_parameter_gathers, unfenced
from tests import models
from tests.multiprocess import SLOW_TIMEOUT_S, run_ranks

STEPS = 4  # DDP's bucket rebuild comes after the first: the state moves to the new shards once


def _sgd(params: Any, foreach: bool = False) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True, foreach=foreach)


def _two_groups(params: Any) -> torch.optim.Optimizer:
    """Weights and biases in two groups with different lr and weight decay."""
    params = list(params)
    weights = [p for p in params if p.dim() > 1]
    others = [p for p in params if p.dim() <= 1]
    return torch.optim.AdamW([{"params": weights}, {"params": others, "lr": 3e-3, "weight_decay": 0.0}],
                             lr=1e-3, weight_decay=0.1)


@dataclass(frozen=True)
class Case:
    model: str
    optimizer: Callable[[Any], torch.optim.Optimizer]
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1  # micro-batches per step, all but the last under no_sync()
    scheduler: bool = False  # an LR scheduler that changes lr every step
    attach_after: int = 0  # steps the optimizer takes unsharded before it is attached (then resharded)
    clip: float | None = None  # max_grad_norm (small enough that every step clips)
    compiled: str | None = None  # "inner": Wrapper(compile(model)); "outer": compile(Wrapper(model)); aot_eager


CASES = {
    "sgd_momentum_wd_nesterov": Case("transformer", _sgd),
    "sgd_foreach": Case("transformer", functools.partial(_sgd, foreach=True)),
    "sgd_plain_batched_copy": Case("mlp", lambda ps: torch.optim.SGD(ps, lr=0.1), {"batched_grad_copy": True}),
    "adam": Case("transformer", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2, foreach=False)),
    "adam_foreach_amsgrad": Case("transformer", lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, foreach=True)),
    "adamw": Case("transformer", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)),
    "adamw_foreach": Case("transformer", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
    "two_groups_scheduler": Case("transformer", _two_groups, scheduler=True),
    "frozen_parameter": Case("cnn_frozen", _sgd),
    "find_unused_adam": Case("branchy", lambda ps: torch.optim.Adam(ps, lr=1e-2), {"find_unused_parameters": True}),
    "no_sync_adamw": Case("transformer", lambda ps: torch.optim.AdamW(ps, lr=1e-3), accumulate=2),
    "clipped_sgd": Case("transformer", _sgd, clip=0.05),
    "clipped_adamw_two_groups": Case("transformer", _two_groups, clip=0.05),
    "resharded_after_two_steps": Case("transformer", lambda ps: torch.optim.Adam(ps, lr=1e-3), attach_after=2),
    # After the rebuild the scalar is bucket 0, of 1 element: every rank but rank 0 holds only its padding.
    "resharded_with_a_padding_only_bucket": Case("scaled_mlp", lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                                 {"bucket_cap_mb": 4e-6}, attach_after=2),
    "compiled_inner_adamw": Case("mlp", lambda ps: torch.optim.AdamW(ps, lr=1e-3), compiled="inner"),
    "compiled_outer_adamw_clipped": Case("mlp", lambda ps: torch.optim.AdamW(ps, lr=1e-3), compiled="outer", clip=0.05),
    # Empty pieces owned by the first, a middle and the last rank, and in a bucket of 0 elements.
    "zero_element_parameters": Case("empty_parameters",
                                    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True)),
}
QUICK = ("sgd_momentum_wd_nesterov", "adam")  # the cases run with a delayed rank
NORM_ULPS = 2  # the clipping norm from the shards is within this many ulps of clip_grad_norm_'s (see docs)
DELAYS = ("reduce_scatter", "gather")  # rank 1 launches late: its reduce-scatters, or its all-gathers
DELAY_S = 0.05


def _equal_state(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Optimizer state dicts equal: the same groups, the same entries, every tensor ``torch.equal``."""
    if ours["param_groups"] != theirs["param_groups"] or ours["state"].keys() != theirs["state"].keys():
        return False
    for index, entry in theirs["state"].items():
        mine = ours["state"][index]
        if mine.keys() != entry.keys():
            return False
        for key, value in entry.items():
            same = torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value
            if not same:
                return False
    return True


def _equal_modules(ddp: Any, ours: Any) -> bool:
    """Every parameter and buffer ``torch.equal`` (our ``state_dict()`` completes the all-gathers first)."""
    return all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=True))


def _equal_as_read(ddp: Any, ours: Any) -> bool:
    """Every parameter and buffer ``torch.equal``, read as a forward reads them: directly, since our
    ``state_dict()`` would complete pending all-gathers and hide a forward that did not wait for them."""
    def tensors(wrapper: Any) -> list[torch.Tensor]:
        return [*wrapper.module.parameters(), *wrapper.module.buffers()]

    return all(torch.equal(a, b) for a, b in zip(tensors(ddp), tensors(ours), strict=True))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many float32 values lie between ``a`` and ``b`` (both positive)."""
    return abs(int(a.float().view(torch.int32)) - int(b.float().view(torch.int32)))


def _wrapped_as(wrapper: type, case: Case, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The wrapper and what the loop calls (the wrapper, or the compiled wrapper), in the case's form."""
    if case.compiled == "outer":
        model = wrapper(models.build(case.model), **kwargs)
        return model, torch.compile(model, backend="aot_eager")
    module = models.build(case.model)
    model = wrapper(torch.compile(module, backend="aot_eager") if case.compiled else module, **kwargs)
    return model, model


def _run_case(
    rank: int, case: Case, delay: str | None, unfenced_reads: bool = False, norm_ulps: list[int] | None = None
) -> list[tuple[bool, bool]]:
    """Train DDP and the sharded wrapper side by side; per step, (parameters equal, state equal).
    A step's parameters are compared once the next forward ran (as it read them), the last step's at the end.

    With clipping, DDP's gradients are clipped by torch's ``clip_grads_with_norm_`` with the norm the
    shards found (so the rest must be bit-equal), and that norm's distance in ulps from
    ``get_total_norm`` of DDP's gradients (what ``clip_grad_norm_`` uses) goes to ``norm_ulps``.

    ``delay``: rank 1 launches its reduce-scatters or its all-gathers late; ``unfenced_reads`` (with
    the reduce-scatter delay) lets the update read each shard without waiting for it: the bug the
    fence prevents, which the comparison must see."""
    kwargs = {"bucket_cap_mb": 0.01, **case.ddp_kwargs}  # several buckets, parameters cut by shards
    torch._dynamo.reset()  # each case traces its own frames
    ddp, run_ddp = _wrapped_as(DistributedDataParallel, case, kwargs)
    ours, run_ours = _wrapped_as(OverlapDDP, case, kwargs)
    ddp_opt = case.optimizer([p for p in ddp.parameters()])
    our_opt = case.optimizer([p for p in ours.parameters()])
    sharded = ours.attach_optimizer(our_opt, shard=True, max_grad_norm=case.clip) if case.attach_after == 0 else None
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ddp_opt, our_opt)
                  if case.scheduler]
    params_equal, state_equal = [], []
    for step in range(STEPS):
        if step == case.attach_after and sharded is None:
            sharded = ours.attach_optimizer(our_opt, shard=True)
        for micro in range(case.accumulate):
            inputs, target = models.batch(case.model, rank, step * case.accumulate + micro)
            with ExitStack() as delayed:  # each context acts on ours only
                if delay == "reduce_scatter":
                    delayed.enter_context(delay_communication(ours, 1, DELAY_S))
                if delay == "gather" and sharded is not None:
                    delayed.enter_context(delay_parameter_gathers(sharded, 1, DELAY_S))
                if unfenced_reads:
                    delayed.enter_context(unfenced(ours))
                losses = []
                for wrapper, run in ((ours, run_ours), (ddp, run_ddp)):
                    wrapper.require_backward_grad_sync = micro == case.accumulate - 1
                    losses.append(models.loss_of(run(inputs), target))
                if step and micro == 0:
                    params_equal.append(_equal_as_read(ddp, ours))  # the previous step's
                for loss in losses:
                    loss.backward()
        if case.clip is not None:
            grads = [p.grad for p in ddp.parameters() if p.grad is not None]
            theirs, used = torch.nn.utils.get_total_norm(grads), sharded.last_grad_norm
            cast(list, norm_ulps).append(_ulps(used, theirs))
            torch.nn.utils.clip_grads_with_norm_(ddp.parameters(), case.clip, used)
        for opt in (our_opt, ddp_opt):
            opt.step()
            opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        state_equal.append(_equal_state(our_opt.state_dict(), ddp_opt.state_dict()))
    params_equal.append(_equal_modules(ddp, ours))  # the last step's, its all-gathers completed by state_dict()
    return list(zip(params_equal, state_equal, strict=True))


def _train_and_compare(rank: int, ddp: Any, ddp_opt: Any, ours: Any, our_opt: Any, steps: range) -> list:
    """Train both from where they are for ``steps``; per step, (parameters equal, state equal)."""
    equal = []
    for step in steps:
        inputs, target = models.batch("transformer", rank, step)
        for wrapper, opt in ((ours, our_opt), (ddp, ddp_opt)):
            models.loss_of(wrapper(inputs), target).backward()
            opt.step()
            opt.zero_grad()
        equal.append((_equal_modules(ddp, ours), _equal_state(our_opt.state_dict(), ddp_opt.state_dict())))
    return equal


def _wrapped(group: Any, state: dict[str, Any] | None, sharded_from: str | None = None) -> tuple[Any, Any, Any, Any]:
    """DDP with a plain AdamW and OverlapDDP with a sharded one, on ``group``; with ``state``, resumed
    from it: the plain optimizer loads the sharded run's consolidated state, the sharded one DDP's
    (or, ``sharded_from``, the DCP checkpoint the sharded run saved there)."""
    ddp = DistributedDataParallel(models.build("transformer"), bucket_cap_mb=0.01, process_group=group)
    ours = OverlapDDP(models.build("transformer"), bucket_cap_mb=0.01, process_group=group)
    ddp_opt, our_opt = _two_groups(ddp.parameters()), _two_groups(ours.parameters())
    sharded = ours.attach_optimizer(our_opt, shard=True)
    if state is not None:
        ddp.module.load_state_dict(state["model"])
        ours.module.load_state_dict(state["model"])
        ddp_opt.load_state_dict(copy.deepcopy(state["sharded"]))  # it adopts the tensors, then steps them
        if sharded_from is None:
            our_opt.load_state_dict(state["plain"])
        else:
            load_sharded(sharded, sharded_from)
    return ddp, ddp_opt, ours, our_opt


def _checkpoint(ddp: Any, ddp_opt: Any, our_opt: Any, sharded_to: str) -> dict[str, Any]:
    """The consolidated checkpoint (model, DDP's optimizer, ours consolidated); ours also saved with DCP."""
    save_sharded(our_opt.state_dict.__self__, sharded_to)
    return {"model": ddp.module.state_dict(), "plain": ddp_opt.state_dict(), "sharded": our_opt.state_dict()}


def _resume_across_world_sizes(rank: int, folder: str) -> dict[str, list]:
    """At 3 ranks: train on ranks 0 and 1 (a 2-rank group), resume all 3 from the checkpoint
    (consolidated, and through DCP), then ranks 0 and 1 from the 3-rank one; every step compared with DDP."""
    pair = dist.new_group([0, 1])
    results, shared = {}, [None]
    if rank < 2:
        ddp, ddp_opt, ours, our_opt = _wrapped(pair, None)
        results["2 ranks"] = _train_and_compare(rank, ddp, ddp_opt, ours, our_opt, range(2))
        shared = [_checkpoint(ddp, ddp_opt, our_opt, f"{folder}/two")]
    dist.broadcast_object_list(shared, src=0)
    for how, sharded_from in (("", None), (" through dcp", f"{folder}/two")):
        ddp, ddp_opt, ours, our_opt = _wrapped(None, shared[0], sharded_from)
        results[f"2 -> 3 ranks{how}"] = _train_and_compare(rank, ddp, ddp_opt, ours, our_opt, range(2, 5))
    three = _checkpoint(ddp, ddp_opt, our_opt, f"{folder}/three")
    if rank < 2:
        for how, sharded_from in (("", None), (" through dcp", f"{folder}/three")):
            ddp, ddp_opt, ours, our_opt = _wrapped(pair, three, sharded_from)
            results[f"3 -> 2 ranks{how}"] = _train_and_compare(rank, ddp, ddp_opt, ours, our_opt, range(5, 8))
    return results


def _matrix(rank: int, world_size: int, folder: str) -> dict[str, list]:
    results: dict[str, list] = {}
    for name, case in CASES.items():
        ulps: list[int] = []
        results[name] = _run_case(rank, case, None, norm_ulps=ulps)
        if case.clip is not None:
            results[f"{name}/norm ulps"] = ulps
    for delay in DELAYS:
        results |= {f"{name}/delayed {delay}": _run_case(rank, CASES[name], delay) for name in QUICK}
    if world_size == 3:
        results |= {f"resume {k}": v for k, v in _resume_across_world_sizes(rank, folder).items()}
    return results


@functools.cache
def outcomes(world_size: int) -> list[dict[str, list]]:
    with tempfile.TemporaryDirectory(prefix="overlapddp-sharded-") as folder:  # the DCP checkpoints
        return run_ranks(world_size, _matrix, folder, timeout_s=SLOW_TIMEOUT_S)


@pytest.mark.parametrize("world_size", (2, 3))
def test_sharded_updates_are_bit_equal_to_ddp_and_the_same_optimizer(world_size):
    for rank, results in enumerate(outcomes(world_size)):
        for case, equal in results.items():
            if case.endswith("/norm ulps"):
                assert len(equal) == STEPS and max(equal) <= NORM_ULPS, f"rank {rank} {case}: {equal}"
            else:
                assert equal and set(equal) == {(True, True)}, f"rank {rank} {case}: (params, state) per step {equal}"


def test_checkpoints_resume_bit_exact_across_world_sizes_2_and_3():
    # A plain optimizer loads the sharded run's consolidated state, and the sharded one DDP's, or
    # its own DCP checkpoint (each rank reading its pieces under the new layout).
    for rank, results in enumerate(outcomes(3)):
        resumed = {case: equal for case, equal in results.items() if case.startswith("resume")}
        expected = {"resume 2 -> 3 ranks", "resume 2 -> 3 ranks through dcp"}
        if rank < 2:
            expected |= {"resume 2 ranks", "resume 3 -> 2 ranks", "resume 3 -> 2 ranks through dcp"}
        assert resumed.keys() == expected, f"rank {rank}: {sorted(resumed)}"
        for case, equal in resumed.items():
            assert set(equal) == {(True, True)}, f"rank {rank} {case}: {equal}"


def _unfenced_updates(rank: int, world_size: int) -> list[list[tuple[bool, bool]]]:
    return [_run_case(rank, CASES[name], "reduce_scatter", unfenced_reads=True) for name in QUICK]


def test_comparison_catches_an_update_that_reads_its_shard_before_the_reduce_scatter_completed():
    for rank, results in enumerate(run_ranks(2, _unfenced_updates)):
        assert all(not all(params for params, _ in equal) for equal in results), f"rank {rank}: {results}"


# -- refusals: on one rank, before any collective --------------------------------------------------


class _AdamSubclass(torch.optim.Adam):
    """A subclass may change the update (e.g. a trust ratio per tensor): refused like any unknown class."""


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS cannot be sharded.*elementwise"),
    (lambda ps: torch.optim.Adagrad(ps), "Adagrad cannot be sharded"),
    (lambda ps: _AdamSubclass(ps), "_AdamSubclass cannot be sharded.*not subclasses"),
    (lambda ps: torch.optim.Adam(ps, fused=True), "parameter group 0 has fused=True"),
    (lambda ps: torch.optim.SGD(list(ps)[1:], lr=0.1), r"Parameters 0\.weight receive reduced gradients"),
    (lambda ps: torch.optim.SGD([*ps, torch.nn.Parameter(torch.zeros(3))], lr=0.1), "not the model's"),
])
def test_optimizers_that_cannot_be_sharded_are_refused_by_name(one_rank, make, match):
    model = OverlapDDP(models.build("mlp"))
    with pytest.raises(ValueError, match=match):
        model.attach_optimizer(make(model.parameters()), shard=True)


@pytest.mark.parametrize("options, kwargs, match", [
    ({"overlap": True}, {}, "cannot be combined with overlap"),
    ({"max_grad_norm": 0.0}, {}, "max_grad_norm must be positive"),
    ({"scaler": torch.amp.GradScaler("cpu")}, {}, "cannot be combined with scaler"),
    ({"allow_unsynced": True}, {}, "cannot be combined with allow_unsynced"),
    ({}, {"gradient_as_bucket_view": True}, "cannot be combined with gradient_as_bucket_view"),
    ({}, {"bucket_plan": "tuned"}, "cannot be combined with tuned_plan"),
    ({}, {"skip_all_reduce_unused_params": True}, "cannot be combined with skip_all_reduce_unused_params"),
])
def test_combinations_that_cannot_work_are_refused_by_name(one_rank, options, kwargs, match):
    model = OverlapDDP(models.build("mlp"), **kwargs)
    with pytest.raises(ValueError, match=match):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True, **options)


def test_mixed_precision_and_comm_hooks_are_refused_either_way_round(one_rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = OverlapDDP(models.build("mlp"), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot be combined with mixed_precision"):
        mixed.attach_optimizer(torch.optim.SGD(mixed.parameters(), lr=0.1), shard=True)
    hooked = OverlapDDP(models.build("mlp"))
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ValueError, match="communication hook allreduce_hook"):
        hooked.attach_optimizer(torch.optim.SGD(hooked.parameters(), lr=0.1), shard=True)
    sharded = OverlapDDP(models.build("mlp"))
    sharded.attach_optimizer(torch.optim.SGD(sharded.parameters(), lr=0.1), shard=True)
    with pytest.raises(RuntimeError, match="once a sharded optimizer is attached"):
        sharded.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="A sharded optimizer is attached to this model"):
        sharded.attach_optimizer(torch.optim.SGD(sharded.parameters(), lr=0.1), shard=True)
    with pytest.raises(ValueError, match="join.. cannot be used with a sharded optimizer"):
        sharded.join()


class _FailedWork:
    """A collective that failed (a peer timed out): its future holds the error."""

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("simulated collective timeout"))
        return future


def _clipped_sgd(seed_model: torch.nn.Module) -> tuple[OverlapDDP, torch.optim.Optimizer]:
    model = OverlapDDP(copy.deepcopy(seed_model), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.attach_optimizer(opt, shard=True, max_grad_norm=0.05)
    return model, opt


def test_an_iteration_dropped_mid_reduction_leaves_no_clipping_state_behind(one_rank, monkeypatch):
    """After a first step (DDP's one-bucket layout), bucket 1's reduce-scatter fails once bucket 0 was
    reduced: with clipping nothing was updated, so the next steps must equal those of a model that
    never ran the failed backward."""
    from overlapddp.shard import optimizer as sharded_optimizer

    seed_model = models.build("transformer")
    failing, failing_opt = _clipped_sgd(seed_model)
    fresh, fresh_opt = _clipped_sgd(seed_model)
    launches = []
    real = sharded_optimizer.dist.all_reduce  # over gloo each bucket is all-reduced in place

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        launches.append(None)
        return _FailedWork() if len(launches) == 2 else real(*args, **kwargs)

    def step(model: OverlapDDP, opt: torch.optim.Optimizer, index: int) -> None:
        inputs, target = models.batch("transformer", 0, index)
        models.loss_of(model(inputs), target).backward()
        opt.step()
        opt.zero_grad()

    for model, opt in ((failing, failing_opt), (fresh, fresh_opt)):
        step(model, opt, 0)
    with monkeypatch.context() as patched:
        patched.setattr(sharded_optimizer.dist, "all_reduce", second_fails)
        with pytest.raises(RuntimeError, match="The reduction of bucket 1"):
            step(failing, failing_opt, 1)
    failing_opt.zero_grad()
    for index in range(2, 5):
        for model, opt in ((failing, failing_opt), (fresh, fresh_opt)):
            step(model, opt, index)
        assert _equal_modules(fresh, failing), f"step {index}"
        assert _equal_state(failing_opt.state_dict(), fresh_opt.state_dict()), f"step {index}"


def test_a_state_dict_loaded_between_backward_and_forward_is_not_overwritten_by_the_pending_gathers(one_rank):
    """After backward the updated parameters wait in their all-gathers; loading a checkpoint then
    must win over them, as with DDP, whose parameters the loaded values replace."""
    model = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, shard=True)
    saved = copy.deepcopy(model.module.state_dict())
    for step in range(2):  # the second backward's gathers go to DDP's rebuilt buckets
        inputs, target = models.batch("mlp", 0, step)
        models.loss_of(model(inputs), target).backward()
        opt.step()
    model.module.load_state_dict(saved)
    model(inputs)  # the forward's pre-hook finds no all-gather left to complete
    assert all(torch.equal(p, saved[name]) for name, p in model.module.named_parameters())


def test_backends_other_than_gloo_and_nccl_are_refused_by_name():
    from overlapddp.shard.checks import ShardRequest, check_shardable

    param = torch.nn.Parameter(torch.zeros(3))
    request = ShardRequest([param], ["w"], {id(param): "w"}, {}, None, backend="mpi")
    with pytest.raises(ValueError, match="shard=True supports the gloo and nccl backends, not mpi"):
        check_shardable(torch.optim.SGD([param], lr=0.1), request)
