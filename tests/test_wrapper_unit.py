"""The wrapper's own behaviour on a one-rank group in the test process: no spawn, seconds in all.

tests/test_wrapper.py checks the wrapper against stock DDP across ranks, and tests/test_errors.py
and tests/test_one_rank_parity.py check its errors and its numbers; a slip in wrapper.py's own
bookkeeping (an attribute DDP has, a flag one forward leaves for the next, a refusal's condition or
message, which outputs go through the end-of-backward trigger, what the hooks hold) can pass all of
them. Each test here pins one such piece by its exact value or message, so a one-line change to
wrapper.py fails within seconds.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel.distributed import _MixedPrecision
from torch.utils.checkpoint import checkpoint

from overlapddp import OverlapDDP, wrapper
from overlapddp.fence import Fence, FenceLog
from overlapddp.layout.tuner import TUNING_ITERATIONS
from overlapddp.optim.guard import OptimizerGuard
from overlapddp.optim.overlap import OverlappedOptimizer
from overlapddp.shard.optimizer import ShardedOptimizer

BF16 = _MixedPrecision(param_dtype=torch.bfloat16)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: more intra-op threads only wait for cores a busy machine cannot give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


class _OneBuffer(nn.Module):
    """Exactly one buffer: the buffer rule counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _Reentrant(nn.Module):
    """A reentrant checkpoint hides ``inner`` from the graph the unused-parameter search walks."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(2, 2)
        self.inner = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, self.pre(x), use_reentrant=True)


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 2, sparse=True)
        self.head = nn.Linear(2, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class _Seen(nn.Module):
    """Records the dtypes its forward sees: the input, the keyword input, the integer input, its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor, *, extra: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, extra.dtype, ids.dtype, self.lin.weight.dtype))
        return self.lin(x) + extra


def _backward(model: OverlapDDP, x: torch.Tensor | None = None) -> None:
    model(torch.ones(4, 3) if x is None else x).sum().backward()


def _grad_fn_name(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


# -- the attributes DDP has ----------------------------------------------------------------------


def _same(value: object, expected: object) -> bool:
    """Equal and of the same type (``0 == False``), or the very object (a config)."""
    return value is expected or (type(value) is type(expected) and value == expected)


@pytest.mark.parametrize(("argument", "given", "attribute", "default", "kept"), [
    ("dim", 1, "dim", 0, 1),
    ("find_unused_parameters", True, "find_unused_parameters", False, True),
    ("gradient_as_bucket_view", True, "gradient_as_bucket_view", False, True),
    ("static_graph", True, "static_graph", False, True),
    ("batched_grad_copy", True, "batched_grad_copy", False, True),
    ("forward_sync_buffers", False, "forward_sync_buffers", True, False),
    ("bucket_cap_mb", 1, "bucket_bytes_cap", 25 * 1024 * 1024, 1024 * 1024),
    ("mixed_precision", BF16, "mixed_precision", None, BF16),
])
def test_each_argument_is_kept_under_ddps_attribute(
    one_rank: None, argument: str, given: object, attribute: str, default: object, kept: object
) -> None:
    assert _same(getattr(OverlapDDP(_OneBuffer()), attribute), default)
    assert _same(getattr(OverlapDDP(_OneBuffer(), **{argument: given}), attribute), kept)


def test_a_new_wrapper_has_ddps_flags_devices_buffers_and_group(one_rank: None) -> None:
    net = _OneBuffer()
    model = OverlapDDP(net)
    assert model.module is net
    assert model.require_backward_grad_sync is True and model.require_forward_param_sync is True
    assert model.parameters_to_ignore == set()
    assert (model.device, model.device_type, model.device_ids, model.output_device) == (torch.device("cpu"), "cpu", None, None)
    assert [id(b) for b in model.modules_buffers] == [id(net.scale)]
    assert model.process_group is dist.group.WORLD
    assert model.join_device == torch.device("cpu") and model.join_process_group is dist.group.WORLD
    assert model._divide_by_initial_world_size is True  # only a join hook changes it


def test_ignored_names_leave_the_buffers_and_may_be_set_through_an_instance(one_rank: None) -> None:
    existing = OverlapDDP(_mlp())
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    existing._set_params_and_buffers_to_ignore_for_model(net, ["0.bias", "1.running_mean"])  # a staticmethod, as DDP's
    marked = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if getattr(t, "_ddp_ignored", False)]
    assert net._ddp_params_and_buffers_to_ignore == ["0.bias", "1.running_mean"] and marked == ["0.bias", "1.running_mean"]
    model = OverlapDDP(net)
    assert model.parameters_to_ignore == {"0.bias", "1.running_mean"}
    assert [id(b) for b in model.modules_buffers] == [id(net[1].running_var), id(net[1].num_batches_tracked)]


class _Where(nn.Module):
    """Records the devices its inputs arrive on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[tuple[torch.device, torch.device]] = []

    def forward(self, x: torch.Tensor, *, k: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.device, k.device))
        return self.w * 2


class _NonBlockingCopies(torch.overrides.TorchFunctionMode):
    """Records the ``non_blocking`` of every ``Tensor.to``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[object] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.seen.append(kwargs.get("non_blocking"))
        return func(*args, **kwargs)


def test_inputs_move_to_the_one_device_in_device_ids(one_rank: None) -> None:
    """As DDP with ``device_ids=[i]``: positional and keyword inputs go to that device (a GPU's; the
    meta device stands in for it here)."""
    model = OverlapDDP(_Where())
    model(torch.ones(2), k=torch.ones(1))
    model.device_ids, model.device_type = [0], "meta"
    with _NonBlockingCopies() as copies:
        model(torch.ones(2), k=torch.ones(1))
    assert model.module.seen == [(torch.device("cpu"),) * 2, (torch.device("meta"),) * 2]
    assert copies.seen == [True, True], "as DDP: the host does not wait for the copies"


# -- flags between forwards ----------------------------------------------------------------------


def test_require_forward_param_sync_follows_the_last_forward_as_in_ddp(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    x = torch.ones(4, 3)
    seen = [model.require_forward_param_sync]
    model(x)
    seen.append(model.require_forward_param_sync)
    with torch.no_grad():
        model(x)
    seen.append(model.require_forward_param_sync)
    model(x)
    seen.append(model.require_forward_param_sync)
    with model.no_sync():
        model(x)
    seen.append(model.require_forward_param_sync)
    _backward(model)
    seen.append(model.require_forward_param_sync)
    assert seen == [True, True, False, True, False, True]


def test_will_sync_module_buffers_needs_the_flag_the_switch_and_a_buffer(one_rank: None) -> None:
    model = OverlapDDP(_OneBuffer())
    assert model.will_sync_module_buffers() is True
    model.forward_sync_buffers = False
    assert model.will_sync_module_buffers() is False
    model.forward_sync_buffers = True
    with torch.no_grad():
        model(torch.ones(1, 2))
    assert model.will_sync_module_buffers() is False
    assert OverlapDDP(_mlp()).will_sync_module_buffers() is False


def test_broadcast_buffers_reads_and_sets_forward_sync_buffers(one_rank: None) -> None:
    model = OverlapDDP(_OneBuffer(), forward_sync_buffers=False)
    assert model.broadcast_buffers is False
    model.broadcast_buffers = True
    assert model.forward_sync_buffers is True and model.broadcast_buffers is True


def test_the_forward_broadcasts_buffers_from_rank_0_when_the_last_forward_synchronized(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[list[int], int, object]] = []
    monkeypatch.setattr(wrapper, "broadcast_buffers", lambda buffers, source, group: sent.append(([id(b) for b in buffers], source, group)))
    model = OverlapDDP(_OneBuffer())
    x = torch.ones(1, 2)
    model(x)
    with torch.no_grad():
        model(x)  # still broadcasts: the forward before synchronized
    model(x)  # does not: a forward without gradients came before (DDP's rule)
    assert sent == [([id(model.module.scale)], 0, dist.group.WORLD)] * 2
    sent.clear()
    OverlapDDP(_OneBuffer(), forward_sync_buffers=False)(x)
    assert sent == []


def test_no_sync_restores_the_flag_it_found_even_on_an_error(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    with model.no_sync():
        assert model.require_backward_grad_sync is False
    assert model.require_backward_grad_sync is True
    model.require_backward_grad_sync = False
    with model.no_sync():
        pass
    assert model.require_backward_grad_sync is False
    model.require_backward_grad_sync = True
    with pytest.raises(KeyError), model.no_sync():
        raise KeyError("inside")
    assert model.require_backward_grad_sync is True


def test_the_forward_not_the_backward_decides_whether_gradients_are_reduced(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    with model.no_sync():
        out = model(torch.ones(4, 3))
    with pytest.warns(UserWarning, match="its forward ran with require_backward_grad_sync=False"):
        out.sum().backward()


def test_the_flag_assigned_between_forward_and_backward_reaches_the_reducer(one_rank: None) -> None:
    """Assigning DDP's attribute is what no_sync() does: the reducer sees it, and a synchronized
    forward's backward under it is reduced and warned about."""
    model = OverlapDDP(_mlp())
    out = model(torch.ones(4, 3))
    model.require_backward_grad_sync = False
    with pytest.warns(UserWarning, match="this backward's gradients ARE being reduced"):
        out.sum().backward()


# -- the static graph switch ---------------------------------------------------------------------


def test_set_static_graph_switches_without_a_warning_then_warns_as_ddp(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model._set_static_graph()
    assert model.static_graph is True
    assert model(torch.ones(4, 3)).grad_fn.reducer is model._reducer  # the first iteration is learned
    with pytest.warns(UserWarning) as caught:
        model._set_static_graph()
    assert [(str(w.message), w.filename) for w in caught] == [
        ("You've set static_graph to be True, no need to set it again.", __file__)
    ]


def test_set_static_graph_with_find_unused_parameters_says_it_is_not_needed(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), find_unused_parameters=True)
    with pytest.warns(UserWarning) as caught:
        model._set_static_graph()
    assert [(str(w.message), w.filename) for w in caught] == [(
        "You passed find_unused_parameters=true to OverlapDDP, `_set_static_graph` will detect unused parameters "
        "automatically, so you do not need to set find_unused_parameters=true.", __file__
    )]
    assert model.static_graph is True


# -- DDP's device-placement helpers --------------------------------------------------------------


def test_scatter_and_gather_use_the_wrappers_dim(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(wrapper, "scatter_kwargs", lambda *args, **kwargs: calls.append((*args, kwargs)) or ((), ()))
    monkeypatch.setattr(wrapper, "gather", lambda *args, **kwargs: calls.append((*args, kwargs)) or "gathered")
    model = OverlapDDP(_mlp(), dim=1)
    assert model.scatter(("x",), {"k": 1}, [0, 1]) == ((), ())
    assert model.gather(["a", "b"], 0) == "gathered"
    assert calls == [(("x",), {"k": 1}, [0, 1], {"dim": 1}), (["a", "b"], 0, {"dim": 1})]


# -- communication hooks -------------------------------------------------------------------------


def test_powersgd_is_refused_over_sparse_gradients_only(one_rank: None) -> None:
    with pytest.raises(ValueError) as refused:
        OverlapDDP(_Sparse()).register_comm_hook(PowerSGDState(None), powerSGD_hook)
    assert str(refused.value) == (
        "PowerSGD compresses flat dense buckets, but embed.weight produce sparse gradients (stock DDP hangs here); "
        "use sparse=False for them or another hook."
    )
    OverlapDDP(_Sparse()).register_comm_hook(None, default_hooks.allreduce_hook)
    dense = OverlapDDP(_mlp())
    state = PowerSGDState(None, start_powerSGD_iter=2)
    dense.register_comm_hook(state, powerSGD_hook)
    assert dense._comm_hooks == [(powerSGD_hook, state)]


def test_powersgd_must_start_once_the_tuned_buckets_are_final(one_rank: None) -> None:
    final = 1 + TUNING_ITERATIONS
    early = PowerSGDState(None, start_powerSGD_iter=final - 1)
    with pytest.raises(ValueError) as refused:
        OverlapDDP(_mlp(), bucket_plan="tuned").register_comm_hook(early, powerSGD_hook)
    assert str(refused.value) == (
        f"PowerSGD keeps per-bucket state from iteration start_powerSGD_iter={final - 1} on, but the buckets change "
        f"until iteration {final} (bucket_plan='tuned'); set start_powerSGD_iter >= {final} or use bucket_plan='ddp'."
    )
    for start in (final, final + 5):
        OverlapDDP(_mlp(), bucket_plan="tuned").register_comm_hook(PowerSGDState(None, start_powerSGD_iter=start),
                                                                   powerSGD_hook)
    OverlapDDP(_mlp(), bucket_plan="tuned").register_comm_hook(None, default_hooks.allreduce_hook)
    OverlapDDP(_mlp()).register_comm_hook(early, powerSGD_hook)  # DDP's layout is final early enough


MIXED_PRECISION_HOOK = (
    "register_comm_hook or register_builtin_comm_hook can only be called once: mixed_precision registered its "
    "reduction as the comm hook (cast to reduce_dtype, sum, division by the world size), as stock DDP does; reduce "
    "without mixed_precision to use a hook of your own."
)


def test_mixed_precision_refuses_every_other_hook_and_records_none(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), mixed_precision=BF16)
    with pytest.raises(RuntimeError) as refused:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    assert str(refused.value) == MIXED_PRECISION_HOOK
    with pytest.raises(RuntimeError) as refused:
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    assert str(refused.value) == MIXED_PRECISION_HOOK
    [(hook, state)] = model._comm_hooks  # its own reduction, registered as DDP registers its upcast hook
    assert (state, hook) == model._reducer.reduction.comm_hook


@pytest.mark.parametrize(("kind", "expected"), [
    (dist.BuiltinCommHookType.ALLREDUCE, torch.tensor(0.1)),
    (dist.BuiltinCommHookType.FP16_COMPRESS, torch.tensor(0.1).half().float()),
])
def test_the_builtin_hooks_reduce_with_ddps_arithmetic(one_rank: None, kind: Any, expected: torch.Tensor) -> None:
    model = OverlapDDP(nn.Linear(1, 1, bias=False))
    model._register_builtin_comm_hook(kind)
    assert model._comm_hooks == []  # as DDP's: a built-in hook is not recorded there
    model(torch.full((1, 1), 0.1)).sum().backward()
    assert torch.equal(model.module.weight.grad, expected.reshape(1, 1))


# -- the optimizer -------------------------------------------------------------------------------


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_attach_optimizer_returns_a_guard_by_default_with_its_switches(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    guard = model.attach_optimizer(_sgd(model))
    assert type(guard) is OptimizerGuard and (guard.strict, guard.allow_unsynced) == (False, False)
    strict = OverlapDDP(_mlp())
    guard = strict.attach_optimizer(_sgd(strict), strict=True, allow_unsynced=True)
    assert type(guard) is OptimizerGuard and (guard.strict, guard.allow_unsynced) == (True, True)


def test_attach_optimizer_overlaps_and_clips_only_with_overlap(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    with pytest.raises(ValueError) as refused:
        model.attach_optimizer(_sgd(model), max_grad_norm=1.0)
    assert str(refused.value) == "max_grad_norm is for overlap=True; without overlap call clip_grad_norm_ before step()."
    assert type(model.attach_optimizer(_sgd(model), overlap=True, max_grad_norm=1.0)) is OverlappedOptimizer


def test_a_sharded_optimizer_refuses_join_and_a_second_sharding_of_its_parameters(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    assert type(model.attach_optimizer(_sgd(model), shard=True)) is ShardedOptimizer
    assert type(model.attach_optimizer(_sgd(model))) is OptimizerGuard  # a guard of another optimizer is not refused
    with pytest.raises(ValueError, match=r"SGD holds parameters \(0\.bias, 0\.weight, 1\.bias, 1\.weight\) that a "
                                         "sharded SGD attached before already updates"):
        model.attach_optimizer(_sgd(model), shard=True)
    with pytest.raises(ValueError, match=r"^join\(\) cannot be used with a sharded optimizer \(attach_optimizer\(\.\.\., "
                                         r"shard=True\)\): in step\(\) every rank waits for the broadcasts"):
        model.join_hook()


def test_an_overlapped_optimizer_must_be_detached_before_sharding_and_the_reverse(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    overlapped = model.attach_optimizer(_sgd(model), overlap=True)
    assert type(model.attach_optimizer(_sgd(model))) is OptimizerGuard  # a guard beside it is not refused
    refusal = (
        "attach_optimizer(shard=True) and attach_optimizer(overlap=True) cannot be combined on one model (rank 0): "
        "an overlapped update runs during backward, a sharded one in step(); attach every optimizer of the model "
        "the same way (detach() the overlapped one first)."
    )
    with pytest.raises(RuntimeError) as refused:
        model.attach_optimizer(_sgd(model), shard=True)
    assert str(refused.value) == refusal
    overlapped.detach()
    assert type(model.attach_optimizer(_sgd(model), shard=True)) is ShardedOptimizer
    with pytest.raises(RuntimeError) as refused:
        model.attach_optimizer(_sgd(model), overlap=True)
    assert str(refused.value) == refusal


def _delayed(**kwargs: Any) -> OverlapDDP:
    net = _mlp()
    return OverlapDDP(net, delay_all_reduce_named_params=[("1.weight", net[1].weight)], param_to_hook_all_reduce=net[0].weight,
                      **kwargs)


def _hooked(hook: Any) -> OverlapDDP:
    model = OverlapDDP(_mlp())
    model.register_comm_hook(None, hook)
    return model


def _ignoring() -> OverlapDDP:
    net = _mlp()
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ["1.bias"])
    return OverlapDDP(net)


# The switches of attach_optimizer that shard=True refuses, each named.
SHARD_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("overlap", {"overlap": True}, "cannot be combined with overlap:"),
    ("max_grad_norm", {"max_grad_norm": 1.0}, "cannot be combined with max_grad_norm:"),
    ("allow_unsynced", {"allow_unsynced": True}, "cannot be combined with allow_unsynced:"),
]


@pytest.mark.parametrize(("case", "kwargs", "message"), SHARD_REFUSALS, ids=[c[0] for c in SHARD_REFUSALS])
def test_the_sharding_checks_see_the_switches(one_rank: None, case: str, kwargs: dict, message: str) -> None:
    model = OverlapDDP(_mlp())
    with pytest.raises(ValueError) as refused:
        model.attach_optimizer(_sgd(model), shard=True, **kwargs)
    assert message in str(refused.value)


# Configurations of the reduction that sharding leaves alone (its gradients are DDP's): accepted.
SHARD_ACCEPTS: list[tuple[str, Any]] = [
    ("mixed_precision", lambda: OverlapDDP(_mlp(), mixed_precision=BF16)),
    ("bucket view", lambda: OverlapDDP(_mlp(), gradient_as_bucket_view=True)),
    ("delayed", _delayed),
    ("sparse", lambda: OverlapDDP(_Sparse())),
    ("tuned", lambda: OverlapDDP(_mlp(), bucket_plan="tuned")),
    ("skip", lambda: OverlapDDP(_mlp(), skip_all_reduce_unused_params=True)),
    ("hook", lambda: _hooked(default_hooks.allreduce_hook)),
    ("ignored", _ignoring),
]


@pytest.mark.parametrize(("case", "build"), SHARD_ACCEPTS, ids=[c[0] for c in SHARD_ACCEPTS])
def test_the_reductions_configurations_are_sharded(one_rank: None, case: str, build: Any) -> None:
    model = build()
    assert type(model.attach_optimizer(_sgd(model), shard=True)) is ShardedOptimizer


def test_a_disabled_scaler_does_not_stop_sharding(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert type(model.attach_optimizer(_sgd(model), shard=True, scaler=scaler)) is ShardedOptimizer


def test_the_optimizer_may_be_given_by_keyword(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    assert type(model.attach_optimizer(optimizer=_sgd(model))) is OptimizerGuard


def test_a_framework_may_arm_the_backward_by_keyword(one_rank: None) -> None:
    """As Accelerate's ``trigger_sync_in_backward`` does, with every argument named."""
    model = OverlapDDP(_mlp())
    with model.no_sync():
        out = model(torch.ones(4, 3))
    model.arm_backward(outputs=[out], caller="a framework")
    out.sum().backward()
    assert model._reducer.reductions == 1


def test_a_one_parameter_model_can_be_sharded(one_rank: None) -> None:
    model = OverlapDDP(nn.Linear(3, 1, bias=False))
    assert type(model.attach_optimizer(_sgd(model), shard=True)) is ShardedOptimizer


# -- debugging and layout ------------------------------------------------------------------------


def test_record_fences_logs_every_edge_of_the_next_backward(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    log = model.record_fences()
    assert type(log) is FenceLog and model.fence.log is log and log.edges == []
    _backward(model)
    assert [(e.bucket, e.edge) for e in log.edges] == [
        (0, "produced"), (0, "launched"), (-1, "backward end"), (0, "completed"), (0, "consumed")
    ]
    assert log.violations() == []


def test_count_tokens_refuses_mixed_precision_and_the_delayed_all_reduce(one_rank: None) -> None:
    with pytest.raises(ValueError) as refused:
        OverlapDDP(_mlp(), mixed_precision=BF16).count_tokens(3)
    assert str(refused.value) == (
        "count_tokens cannot be combined with mixed_precision (rank 0): its reduction (cast, sum and division by the "
        "world size in reduce_dtype) is a communication hook; nothing would divide their gradients by the global "
        "token count."
    )
    with pytest.raises(ValueError) as refused:
        _delayed().count_tokens(3)
    assert str(refused.value) == (
        "count_tokens cannot be combined with delay_all_reduce_named_params (rank 0): the delayed parameters are "
        "all-reduced apart from the buckets and divided by the world size; nothing would divide their gradients by "
        "the global token count."
    )


def test_count_tokens_divides_the_summed_gradient_by_the_token_count(one_rank: None) -> None:
    model = OverlapDDP(nn.Linear(3, 1, bias=False))
    model.count_tokens(4)
    model(torch.ones(2, 3)).sum().backward()
    assert torch.equal(model.module.weight.grad, torch.full((1, 3), 0.5))


def test_bucket_indices_are_ddps_reversed_layout_then_the_ready_order(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), bucket_cap_mb=1e-9)  # one parameter per bucket, but DDP's first bucket holds 1 MiB
    assert model.bucket_indices() == [[0, 1, 2, 3]]
    assert model._has_rebuilt_buckets is False and model.bucket_state() == {"ready_order": None, "tuned_buckets": None}
    _backward(model)
    with torch.no_grad():
        model(torch.ones(4, 3))  # a forward without gradients rebuilds nothing
    assert model._has_rebuilt_buckets is False
    model(torch.ones(4, 3))
    assert model._has_rebuilt_buckets is True
    state = model.bucket_state()
    assert state == {"ready_order": [3, 2, 1, 0], "tuned_buckets": None}
    assert model.bucket_indices() == [[3], [2], [1], [0]]


def test_a_loaded_bucket_state_is_adopted(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), bucket_cap_mb=1e-9)
    model.load_bucket_state({"ready_order": [0, 1, 2, 3]})
    assert model.bucket_indices() == [[0], [1], [2], [3]]
    assert model.bucket_state() == {"ready_order": [0, 1, 2, 3], "tuned_buckets": None}


@pytest.mark.parametrize("state", [{"tuned_buckets": None}, ["ready_order"], None])
def test_load_bucket_state_refuses_anything_but_bucket_states_dict(one_rank: None, state: Any) -> None:
    with pytest.raises(ValueError) as refused:
        OverlapDDP(_mlp()).load_bucket_state(state)
    assert str(refused.value) == f"Expected the dict returned by bucket_state(), got {state!r}."


def test_check_nonfinite_gradients_is_on_when_called_and_off_when_told(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    model.check_nonfinite_gradients()
    nan = torch.full((4, 3), float("nan"))
    with pytest.raises(FloatingPointError, match=r"in bucket 0 before its reduction \(rank 0: 0\.weight, 1\.weight\)\."):
        _backward(model, nan)
    model.check_nonfinite_gradients(False)
    model.zero_grad()
    _backward(model, nan)


# -- uneven inputs -------------------------------------------------------------------------------


def test_join_hook_refuses_the_delayed_all_reduce(one_rank: None) -> None:
    with pytest.raises(ValueError) as refused:
        _delayed().join_hook()
    assert str(refused.value) == (
        "join() cannot be used with delay_all_reduce_named_params: a joined rank cannot know where, among the "
        "buckets' collectives, the others start the delayed all-reduce (stock DDP does not shadow it)."
    )


def test_join_hook_and_join_pass_on_divide_by_initial_world_size(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    model.join_hook(divide_by_initial_world_size=False)
    assert model._divide_by_initial_world_size is False
    model.join_hook()
    assert model._divide_by_initial_world_size is True
    model.join(divide_by_initial_world_size=False)
    assert model._divide_by_initial_world_size is False
    join = model.join()
    assert model._divide_by_initial_world_size is True
    assert (join._enable, join._throw_on_early_termination) == (True, False)


@pytest.mark.parametrize(("divide_by_initial_world_size", "grad"), [(True, 2.0), (False, 0.5)])
def test_under_join_the_gradient_is_divided_by_the_ranks_still_training_when_asked(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, divide_by_initial_world_size: bool, grad: float
) -> None:
    training = SimpleNamespace(wait=lambda: None, result=lambda: [torch.tensor([4])])  # as if 4 ranks trained
    monkeypatch.setattr(wrapper.Join, "notify_join_context",
                        staticmethod(lambda joinable: training if joinable._join_config.enable else None))
    model = OverlapDDP(nn.Linear(1, 1, bias=False))
    with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
        model(torch.full((2, 1), 1.0)).sum().backward()
    assert torch.equal(model.module.weight.grad, torch.full((1, 1), grad))


def test_under_join_each_forward_takes_buffers_from_the_highest_training_rank_and_announces_its_sync(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(wrapper, "common_rank", lambda model, candidate: calls.append(("common_rank", candidate)) or 7)
    monkeypatch.setattr(wrapper, "broadcast_buffers", lambda buffers, source, group: calls.append(("broadcast", source)))
    monkeypatch.setattr(wrapper, "announce_backward_sync", lambda model, will_sync: calls.append(("announce", will_sync)))
    model = OverlapDDP(_OneBuffer())
    x = torch.ones(1, 2)
    with model.join():
        model(x).sum().backward()
        with model.no_sync():
            model(x).sum().backward()
    assert calls == [
        ("common_rank", True), ("broadcast", 7), ("announce", True),
        ("common_rank", True), ("broadcast", 7), ("announce", False),
    ]
    calls.clear()
    OverlapDDP(_OneBuffer())(x)  # never joined: from rank 0, nothing announced
    disabled = OverlapDDP(_OneBuffer())
    with disabled.join(enable=False):
        disabled(x)
    assert calls == [("broadcast", 0), ("broadcast", 0)]


@pytest.mark.parametrize("forward_sync_buffers", [True, False])
def test_the_last_joiner_sends_its_unignored_parameters_and_the_buffers_it_syncs(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, forward_sync_buffers: bool
) -> None:
    sent: list[tuple[list[int], list[int], int]] = []
    monkeypatch.setattr(wrapper, "broadcast_state", lambda params, buffers, source, group: sent.append(([id(p) for p in params], [id(b) for b in buffers], source)))
    net = _OneBuffer()
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ["lin.bias"])
    model = OverlapDDP(net, forward_sync_buffers=forward_sync_buffers)
    model.join_hook().post_hook(is_last_joiner=True)
    assert sent == [([id(net.lin.weight)], [id(net.scale)] if forward_sync_buffers else [], 0)]


# -- arming a backward from outside forward ------------------------------------------------------


def test_arm_backward_reduces_the_next_backward_and_rebuilds_only_when_asked(one_rank: None) -> None:
    x = torch.ones(4, 3)
    for asked in ({}, {"rebuild": True}):  # by default a pending rebuild is left to the next forward
        model = OverlapDDP(_mlp())
        out = model.module(x)  # forwards of the bare module: only arm_backward can apply the rebuild
        model.arm_backward([out], caller="Lightning", **asked)
        out.sum().backward()
        assert model._reducer.reductions == 1
        out = model.module(x)
        model.arm_backward([out], caller="Lightning", **asked)
        assert model._has_rebuilt_buckets is bool(asked)
    out.sum().backward()
    assert model._reducer.reductions == 2


def test_arm_backward_refuses_a_static_graphs_first_iteration_naming_the_caller(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), static_graph=True)
    with pytest.raises(RuntimeError) as refused:
        model.arm_backward([model.module(torch.ones(4, 3))], caller="Lightning")
    assert str(refused.value) == (
        "Lightning: OverlapDDP with static_graph=True reduces its first iteration when backward reaches the "
        "forward's outputs, so that iteration must come from a synchronized forward; run the first step with the "
        "usual forward, or set static_graph=False."
    )
    _backward(model)
    out = model.module(torch.ones(4, 3))
    model.arm_backward([out], caller="Lightning")  # the graph is learned: accepted
    out.sum().backward()
    assert model._reducer.reductions == 2


def test_arm_backward_refuses_a_backward_reduced_only_at_its_end_naming_the_caller(one_rank: None) -> None:
    model = OverlapDDP(_Reentrant(), find_unused_parameters=True)
    with pytest.raises(RuntimeError) as refused:
        model.arm_backward([model.module(torch.ones(1, 2))], caller="Accelerate")
    assert str(refused.value) == (
        "Accelerate: with find_unused_parameters=True and a reentrant checkpoint (use_reentrant=True) in the graph, "
        "OverlapDDP reduces when backward reaches the forward's outputs, so the backward must come from a "
        "synchronized forward; use use_reentrant=False, or static_graph=True if the graph does not change."
    )


# -- which outputs go through the end-of-backward trigger ----------------------------------------


def test_each_mode_routes_its_outputs_as_its_backward_needs(one_rank: None) -> None:
    x = torch.ones(4, 3)
    plain = OverlapDDP(_mlp())
    assert _grad_fn_name(plain(x)) == "AddmmBackward0"
    unused = OverlapDDP(_mlp(), find_unused_parameters=True)
    out = unused(x)
    assert _grad_fn_name(out) == "_EndOfBackwardBackward" and out.grad_fn.reducer is None  # DDP's sink
    static = OverlapDDP(_mlp(), static_graph=True)
    out = static(x)
    assert out.grad_fn.reducer is static._reducer
    out.sum().backward()
    assert _grad_fn_name(static(x)) == "AddmmBackward0"  # learned: reduced as it goes
    with static.no_sync():
        assert _grad_fn_name(static(x)) == "AddmmBackward0"
    reentrant = OverlapDDP(_Reentrant(), find_unused_parameters=True)
    out = reentrant(torch.ones(1, 2))
    assert out.grad_fn.reducer is reentrant._reducer
    out.sum().backward()
    assert reentrant._reducer.reductions == 1


def test_a_static_graph_without_synchronization_gets_no_trigger(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), static_graph=True)
    model.require_backward_grad_sync = False
    assert _grad_fn_name(model(torch.ones(4, 3))) == "AddmmBackward0"
    with torch.no_grad():
        assert model(torch.ones(4, 3)).grad_fn is None


def test_an_output_the_loss_never_reaches_still_completes_its_buckets(one_rank: None) -> None:
    model = OverlapDDP(_TwoHeads(), find_unused_parameters=True)
    x = torch.ones(1, 2)
    for _ in range(2):  # the second forward would refuse an unfinished first reduction
        model(x)[0].sum().backward()
    assert model._reducer.reductions == 2
    assert model.module.b.weight.grad is None and torch.equal(model.module.a.weight.grad, torch.full((1, 2), 2.0))


def test_the_trigger_keeps_the_output_and_its_tensors_without_grad_fn(one_rank: None) -> None:
    leaf = torch.ones(2, requires_grad=True)
    constant = torch.zeros(2)
    assert wrapper._end_of_backward_trigger(constant, None) is constant
    nested = {"y": leaf * 2, "aux": [constant, "text"], "leaf": leaf}
    routed = wrapper._end_of_backward_trigger(nested, None)
    assert set(routed) == {"y", "aux", "leaf"} and routed["aux"][0] is constant and routed["aux"][1] == "text"
    assert routed["leaf"] is leaf
    assert _grad_fn_name(routed["y"]) == "_EndOfBackwardBackward" and torch.equal(routed["y"], nested["y"])


def test_the_trigger_queues_the_reduction_once_and_passes_the_gradients_on(monkeypatch: pytest.MonkeyPatch) -> None:
    queued: list[Any] = []
    monkeypatch.setattr(wrapper, "queue_callback", queued.append)
    reducer = SimpleNamespace(reduce_at_end_of_backward=object())
    ctx = SimpleNamespace(reducer=reducer)
    grads = (torch.ones(1), None)
    assert wrapper._EndOfBackward.backward(ctx, *grads) == (None, *grads)
    assert wrapper._EndOfBackward.backward(ctx, *grads) == (None, *grads)
    assert queued == [reducer.reduce_at_end_of_backward]
    assert wrapper._EndOfBackward.backward(SimpleNamespace(reducer=None), *grads) == (None, *grads)
    assert len(queued) == 1


# -- the hooks -----------------------------------------------------------------------------------


class _Holder:
    """A stand-in reducer that can die."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence


def test_the_fence_getter_reads_the_live_reducers_fence_and_a_fresh_one_after(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    fence_of = wrapper._fence_of(weakref.ref(model._reducer))
    assert fence_of() is model.fence
    replacement = Fence()
    model.replace_fence(replacement)
    assert fence_of() is replacement
    holder = _Holder(replacement)
    gone = wrapper._fence_of(weakref.ref(holder))  # type: ignore[arg-type]
    del holder
    gc.collect()
    fresh = gone()
    assert type(fresh) is Fence and fresh is not replacement and fresh is not gone()


@pytest.mark.parametrize("delayed", (False, True))
def test_the_hooks_do_not_keep_a_discarded_wrapper_reducing(one_rank: None, delayed: bool) -> None:
    net = _mlp()
    model = OverlapDDP(net, **(dict(delay_all_reduce_named_params=[("1.weight", net[1].weight)],
                                    param_to_hook_all_reduce=net[0].weight) if delayed else {}))
    reducer = weakref.ref(model._reducer)
    del model
    gc.collect()
    assert reducer() is None
    net(torch.ones(4, 3)).sum().backward()  # the hooks (the delayed ones too) find no reducer and do nothing
    assert torch.equal(net[1].bias.grad, torch.full((1,), 4.0))


def test_the_reduction_ends_after_backward_or_in_the_last_hook_under_compiled_autograd(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[int]] = []
    for compiled in (False, True):
        monkeypatch.setattr(wrapper, "in_compiled_autograd", lambda compiled=compiled: compiled)
        model = OverlapDDP(_mlp())
        # Registered after the wrapper's: runs after its hook on the last gradient of the backward.
        model.module[0].weight.register_post_accumulate_grad_hook(lambda _, fence=model.fence: seen.append(fence.in_flight()))
        _backward(model)
        assert model._reducer.reductions == 1
    assert seen == [[0], []]


def test_the_delayed_hooks_report_late_gradients_and_launch_once(one_rank: None) -> None:
    net = _mlp()
    late = OverlapDDP(net, delay_all_reduce_named_params=[("0.weight", net[0].weight)], param_to_hook_all_reduce=net[1].weight)
    with pytest.raises(RuntimeError, match=r"The gradients of 0\.weight arrived after param_to_hook_all_reduce's, when their delayed all-reduce had already started on rank 0"):
        _backward(late)
    model = _delayed()
    log = model.record_fences()
    _backward(model)
    assert [e.edge for e in log.edges if e.bucket == -2] == ["produced", "launched", "completed", "consumed"]
    assert model._reducer.reductions == 1


def test_the_wrappers_own_work_is_never_traced_by_dynamo() -> None:
    assert OverlapDDP.forward._torchdynamo_disable_recursive is False  # the module's forward is traced
    assert OverlapDDP._pre_forward._torchdynamo_disable_recursive is True
    assert OverlapDDP._post_forward._torchdynamo_disable_recursive is True


def test_the_ready_hooks_run_eagerly(one_rank: None) -> None:
    model = OverlapDDP(_mlp())
    hooks = list(model.module[0].weight._post_accumulate_grad_hooks.values())
    assert [h._torchdynamo_disable_recursive for h in hooks] == [True]


# -- mixed precision -----------------------------------------------------------------------------


def test_mixed_precision_casts_buffers_once_and_inputs_and_parameters_per_forward(one_rank: None) -> None:
    net = _Seen()
    net.register_buffer("running", torch.zeros(2))
    model = OverlapDDP(net, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float64))
    assert net.running.dtype == torch.float64
    ids = torch.ones(1, dtype=torch.long)
    out = model(torch.ones(1, 2), ids, extra=torch.ones(1, 2))
    assert net.seen == [(torch.bfloat16, torch.bfloat16, torch.long, torch.bfloat16)]
    assert net.lin.weight.dtype == torch.bfloat16  # until its bucket is reduced, as in DDP
    out.float().sum().backward()
    assert (net.lin.weight.dtype, net.lin.weight.grad.dtype) == (torch.float32, torch.float32)
    with torch.no_grad():
        model(torch.ones(1, 2), ids, extra=torch.ones(1, 2))
    assert net.seen[-1] == (torch.bfloat16, torch.bfloat16, torch.long, torch.bfloat16)
    assert net.lin.weight.dtype == torch.float32  # no backward would return it


def test_mixed_precision_leaves_ignored_parameters_in_full_precision(one_rank: None) -> None:
    net = _mlp()
    net[0].register_parameter("kept", nn.Parameter(torch.zeros(1)))  # not used by the forward
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ["0.kept"])
    model = OverlapDDP(net, mixed_precision=BF16)
    model(torch.ones(4, 3))
    assert [(n, p.dtype) for n, p in net.named_parameters()][1:4] == [
        ("0.bias", torch.bfloat16), ("0.kept", torch.float32), ("1.weight", torch.bfloat16)]


class _OptionalBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def test_a_skipped_bucket_of_local_gradients_becomes_its_views_as_in_ddp(one_rank) -> None:
    # skip_all_reduce_unused_params: DDP still copies a skipped bucket's gradients into its views.
    seen = []
    for wrap in (torch.nn.parallel.DistributedDataParallel, OverlapDDP):
        torch.manual_seed(0)
        module = _OptionalBranch()
        model = wrap(module, find_unused_parameters=True, skip_all_reduce_unused_params=True,
                     gradient_as_bucket_view=True, bucket_cap_mb=1e-5)
        x = torch.ones(2, 4)
        model(x, False).sum().backward()
        with model.no_sync():
            model(x, True).sum().backward()  # b's gradient stays local
        local = module.b.bias.grad
        model(x, False).sum().backward()  # synchronized, b unused: its bucket is skipped
        grads = [module.b.weight.grad, module.b.bias.grad]
        seen.append((grads[1] is local, [g._base is not None for g in grads], [g.clone() for g in grads]))
    (ddp_local, ddp_views, ddp_grads), (local, views, grads) = seen
    assert (local, views) == (ddp_local, ddp_views) == (False, [True, True])
    assert all(torch.equal(a, b) for a, b in zip(grads, ddp_grads, strict=True))
