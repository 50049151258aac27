"""overlapddp.integrations without spawning ranks: each adapter's decisions, in one test process.

``tests/integrations/test_frameworks.py`` and ``tests/integrations/test_ray.py`` show each framework bit-equal to its DDP on two
ranks; they cost a spawn and the framework's start-up. These check, on a one-rank gloo group, the
choices each adapter makes (when it wraps, with which arguments, what it refuses and how it
names the problem), with the framework's objects replaced where only their answers matter.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from overlapddp import OverlapDDP


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (the integrations extra installs it)")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class _Calls:
    """Records each call's arguments; returns ``result`` (or the first argument when it is None)."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.result = result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result if self.result is not None else args[0]


# ---------------------------------------------------------------- Accelerate


def _accelerator(**overrides: Any) -> SimpleNamespace:
    """What ``prepare_model`` reads of an Accelerator, on one CPU process that would build DDP."""
    from accelerate.utils import DistributedType, DynamoBackend

    fields: dict[str, Any] = dict(
        distributed_type=DistributedType.MULTI_CPU, multi_device=False, parallelism_config=None,
        state=SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.NO)), ddp_handler=None,
        device=torch.device("cpu"), local_process_index=0,
    )
    fields.update(overrides)
    accelerator = SimpleNamespace(**fields)

    def accelerate_prepare(model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> nn.Module:
        accelerator.prepared.append((device_placement, evaluation_mode))
        model._is_accelerate_prepared = True
        return model

    accelerator.prepared = []
    accelerator.prepare_model = accelerate_prepare
    accelerator.unwrap_model = _Calls()
    if "trigger_sync_in_backward" not in overrides:
        accelerator.trigger_sync_in_backward = _Calls(result=nullcontext())
    return accelerator


def test_accelerate_decides_when_it_would_build_ddp():
    _needs("accelerate")
    from accelerate.utils import DistributedType

    from overlapddp.integrations.accelerate import _builds_ddp

    multi_gpu = DistributedType.MULTI_GPU
    assert _builds_ddp(_accelerator(), _net(), evaluation_mode=False)
    assert not _builds_ddp(_accelerator(), _net(), evaluation_mode=True)
    prepared = _net()
    prepared._is_accelerate_prepared = True
    assert not _builds_ddp(_accelerator(), prepared, evaluation_mode=False)
    frozen = _net().requires_grad_(False)
    assert not _builds_ddp(_accelerator(), frozen, evaluation_mode=False)
    partly_frozen = _net()
    partly_frozen[0].requires_grad_(False)
    assert _builds_ddp(_accelerator(), partly_frozen, evaluation_mode=False)
    assert _builds_ddp(_accelerator(distributed_type=multi_gpu, multi_device=True), _net(), False)
    assert not _builds_ddp(_accelerator(distributed_type=multi_gpu, multi_device=False), _net(), False)
    tensor_parallel = SimpleNamespace(tp_enabled=True)
    no_tensor_parallel = SimpleNamespace(tp_enabled=False)
    gpus = dict(distributed_type=multi_gpu, multi_device=True)
    assert not _builds_ddp(_accelerator(parallelism_config=tensor_parallel, **gpus), _net(), False)
    assert _builds_ddp(_accelerator(parallelism_config=no_tensor_parallel, **gpus), _net(), False)
    assert not _builds_ddp(_accelerator(parallelism_config=tensor_parallel), _net(), False)  # MULTI_CPU too
    for other in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA):
        assert not _builds_ddp(_accelerator(distributed_type=other), _net(), False), other  # their own wrappers


def test_accelerate_gives_the_wrapper_ddps_device_ids(monkeypatch):
    _needs("accelerate")
    from accelerate.utils import DistributedType

    from overlapddp.integrations.accelerate import _device_ids

    monkeypatch.delenv("ACCELERATE_BYPASS_DEVICE_MAP", raising=False)
    gpu = dict(distributed_type=DistributedType.MULTI_GPU, local_process_index=3)
    assert _device_ids(_accelerator()) == (None, None)
    assert _device_ids(_accelerator(**gpu, device=torch.device("cuda", 5))) == ([3], 3)
    assert _device_ids(_accelerator(**gpu, device=torch.device("hpu", 5))) == ([5], 5)
    assert _device_ids(_accelerator(**gpu, device=torch.device("xpu", 5))) == ([3], 3)  # only hpu uses its index
    for not_true in ("false", "yes", "1"):  # Accelerate (from 1.16) bypasses on "true" alone, in any case
        monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", not_true)
        assert _device_ids(_accelerator(**gpu, device=torch.device("cuda", 5))) == ([3], 3), not_true
    for true in ("true", "TRUE", "True"):
        monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", true)
        assert _device_ids(_accelerator(**gpu, device=torch.device("cuda", 5))) == (None, None), true


def test_accelerate_prepare_builds_overlapddp_with_the_handlers_arguments_and_hook(one_rank):
    _needs("accelerate")
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from overlapddp.integrations.accelerate import use_overlapddp

    handler = DistributedDataParallelKwargs(bucket_cap_mb=1, comm_hook=DDPCommunicationHookType.FP16)
    accelerator = use_overlapddp(_accelerator(ddp_handler=handler))
    wrapper = accelerator.prepare_model(_net(), device_placement=True)
    assert isinstance(wrapper, OverlapDDP)
    assert accelerator.prepared == [(True, True)]  # Accelerate's own steps, without its DDP wrap
    assert wrapper._is_accelerate_prepared is True
    assert "_is_accelerate_prepared" not in vars(wrapper.module)  # the wrapper carries it, as DDP does
    assert wrapper.bucket_bytes_cap == 1024 * 1024
    assert wrapper.device_ids is None
    state, hook = wrapper._reducer.reduction.comm_hook
    assert hook is default_hooks.fp16_compress_hook and state is None

    plain = use_overlapddp(_accelerator()).prepare_model(_net())
    assert isinstance(plain, OverlapDDP) and plain._reducer.reduction.comm_hook is None
    assert plain.bucket_bytes_cap == 25 * 1024 * 1024  # no handler: DDP's defaults


def test_accelerate_prepare_leaves_what_ddp_would_not_wrap_to_accelerate(one_rank):
    _needs("accelerate")
    from overlapddp.integrations.accelerate import use_overlapddp

    accelerator = use_overlapddp(_accelerator())
    model = accelerator.prepare_model(_net(), device_placement=False, evaluation_mode=True)
    assert not isinstance(model, OverlapDDP)
    assert accelerator.prepared == [(False, True)]


def _compile_backends() -> list[str]:
    try:
        from accelerate.utils import DynamoBackend
    except ImportError:
        return ["INDUCTOR"]  # the test skips without accelerate
    return [b.name for b in DynamoBackend if b.name != "NO"]


@pytest.mark.parametrize("backend", _compile_backends())
def test_accelerate_refuses_its_compile_setting_before_preparing(one_rank, backend):
    _needs("accelerate")
    from accelerate.utils import DynamoBackend

    from overlapddp.integrations.accelerate import use_overlapddp

    compiled = SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend[backend]))
    accelerator = use_overlapddp(_accelerator(state=compiled))
    with pytest.raises(NotImplementedError, match=r"dynamo_backend.*OverlapDDP\(torch.compile\(model\)\)"):
        accelerator.prepare_model(_net())
    assert accelerator.prepared == []


def test_use_overlapddp_twice_changes_nothing(one_rank):
    _needs("accelerate")
    from overlapddp.integrations.accelerate import use_overlapddp

    accelerator = _accelerator()
    originals = accelerator.prepare_model, accelerator.unwrap_model, accelerator.trigger_sync_in_backward
    assert use_overlapddp(accelerator) is accelerator
    replaced = accelerator.prepare_model, accelerator.unwrap_model, accelerator.trigger_sync_in_backward
    assert all(new is not old for new, old in zip(replaced, originals, strict=True))
    assert use_overlapddp(accelerator) is accelerator
    assert (accelerator.prepare_model, accelerator.unwrap_model, accelerator.trigger_sync_in_backward) == replaced
    assert isinstance(accelerator.prepare_model(_net()), OverlapDDP)
    assert len(accelerator.prepared) == 1  # one layer of preparation, not two


def test_accelerate_unwrap_strips_overlapddp_and_passes_its_arguments(one_rank):
    _needs("accelerate")
    from overlapddp.integrations.accelerate import use_overlapddp

    accelerator = _accelerator()
    inner = accelerator.unwrap_model
    use_overlapddp(accelerator)
    wrapper = OverlapDDP(_net())
    assert accelerator.unwrap_model(wrapper) is wrapper.module
    assert inner.calls[-1] == ((wrapper.module,), {"keep_fp32_wrapper": True, "keep_torch_compile": True})
    bare = _net()
    accelerator.unwrap_model(bare, keep_fp32_wrapper=False, keep_torch_compile=False)
    assert inner.calls[-1] == ((bare,), {"keep_fp32_wrapper": False, "keep_torch_compile": False})


def test_accelerate_trigger_sync_arms_the_next_backward_and_restores_the_flags(one_rank, monkeypatch):
    _needs("accelerate")
    from overlapddp.integrations.accelerate import use_overlapddp

    entered = []

    class Trigger:
        def __call__(self, model: nn.Module) -> Any:
            entered.append(model)
            return nullcontext()

    accelerator = _accelerator(trigger_sync_in_backward=Trigger())
    use_overlapddp(accelerator)
    bare = _net()
    with accelerator.trigger_sync_in_backward(bare):
        pass
    assert entered == [bare]  # not an OverlapDDP: Accelerate's own

    wrapper = OverlapDDP(_net())
    armed = _Calls(result=False)
    monkeypatch.setattr(wrapper, "arm_backward", armed)
    wrapper.require_backward_grad_sync, wrapper.require_forward_param_sync = False, False
    with accelerator.trigger_sync_in_backward(wrapper):
        assert wrapper.require_backward_grad_sync is True
        assert armed.calls == [(([],), {"caller": "Accelerator.trigger_sync_in_backward"})]
    assert (wrapper.require_backward_grad_sync, wrapper.require_forward_param_sync) == (False, False)
    wrapper.require_backward_grad_sync, wrapper.require_forward_param_sync = False, True
    with pytest.raises(KeyError):
        with accelerator.trigger_sync_in_backward(wrapper):
            raise KeyError("the body failed")
    assert (wrapper.require_backward_grad_sync, wrapper.require_forward_param_sync) == (False, True)
    assert entered == [bare]

    searching = OverlapDDP(_net(), find_unused_parameters=True)
    with pytest.raises(ValueError, match="trigger_sync_in_backward with find_unused_parameters=True"):
        with accelerator.trigger_sync_in_backward(searching):
            pass


# ---------------------------------------------------------------- Ray Train


def test_ray_refuses_other_strategies_and_unknown_arguments_by_name():
    _needs("ray")
    from overlapddp.integrations.ray import _wrapper_kwargs, prepare_model

    with pytest.raises(ValueError, match=r"parallel_strategy='fsdp' is not supported"):
        prepare_model(_net(), parallel_strategy="fsdp")
    assert _wrapper_kwargs(None) == {}
    given = {"bucket_cap_mb": 1, "bucket_plan": "tuned"}
    copied = _wrapper_kwargs(given)
    assert copied == given and copied is not given
    with pytest.raises(TypeError, match=r"must be a dict of DDP's keyword arguments, got list"):
        _wrapper_kwargs([("bucket_cap_mb", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"has 'a', 'zeta', which is not an argument") as refused:
        _wrapper_kwargs({"zeta": 1, "bucket_cap_mb": 1, "a": 2})
    takes = str(refused.value).split("it takes ")[1]
    assert "bucket_cap_mb" in takes and "find_unused_parameters" in takes and "bucket_plan" in takes
    assert "self" not in takes.split(", ") and "module" not in takes.split(", ")


def _ray_worker(monkeypatch: pytest.MonkeyPatch, world_size: int, device: Any = None) -> _Calls:
    """Ray's worker-side answers: its own prepare_model (recorded), the world size, the device."""
    import overlapddp.integrations.ray as adapter

    ray_prepare = _Calls()
    monkeypatch.setattr(adapter, "ray_prepare_model", ray_prepare)
    monkeypatch.setattr(adapter, "get_context", lambda: SimpleNamespace(get_world_size=lambda: world_size))
    monkeypatch.setattr(adapter, "get_device", lambda: torch.device("cpu") if device is None else device)
    return ray_prepare


def test_ray_wraps_only_for_ddp_on_several_workers(one_rank, monkeypatch):
    _needs("ray")
    from overlapddp.integrations.ray import prepare_model

    ray_prepare = _ray_worker(monkeypatch, world_size=2)
    net = _net()
    wrapper = prepare_model(net, parallel_strategy_kwargs={"bucket_cap_mb": 1})
    assert isinstance(wrapper, OverlapDDP) and wrapper.module is net
    assert wrapper.bucket_bytes_cap == 1024 * 1024 and wrapper.device_ids is None  # CPU: no device_ids
    assert ray_prepare.calls == [((net,), {"move_to_device": True, "parallel_strategy": None})]
    assert prepare_model(net, parallel_strategy=None) is net
    listed = _ray_worker(monkeypatch, world_size=2, device=[torch.device("cpu")])
    assert isinstance(prepare_model(net, move_to_device=False), OverlapDDP)
    assert listed.calls == [((net,), {"move_to_device": False, "parallel_strategy": None})]
    _ray_worker(monkeypatch, world_size=1)
    assert prepare_model(net) is net  # one worker: not wrapped, as with Ray's


def test_ray_gives_ddps_device_arguments_on_a_gpu(one_rank, monkeypatch):
    _needs("ray")
    import overlapddp.integrations.ray as adapter

    built = _Calls(result="wrapper")
    monkeypatch.setattr(adapter, "OverlapDDP", built)
    monkeypatch.setattr(adapter.torch.cuda, "is_available", lambda: True)
    gpu = torch.device("cuda", 1)
    _ray_worker(monkeypatch, world_size=2, device=[gpu, torch.device("cuda", 2)])
    net = _net()
    assert adapter.prepare_model(net, parallel_strategy_kwargs={"bucket_cap_mb": 1}) == "wrapper"
    assert built.calls[-1] == ((net,), {"device_ids": [gpu], "output_device": gpu, "bucket_cap_mb": 1})
    chosen = torch.device("cuda", 3)
    adapter.prepare_model(net, move_to_device=chosen)
    assert built.calls[-1] == ((net,), {"device_ids": [chosen], "output_device": chosen})
    _ray_worker(monkeypatch, world_size=2, device=torch.device("cpu"))
    adapter.prepare_model(net)
    assert built.calls[-1] == ((net,), {})


# ---------------------------------------------------------------- the Lightning Trainer's strategy steps


class _DDPStrategyStandIn:
    """What the steps call on Lightning's DDPStrategy (its constructor and teardown), and the
    static-graph flush after backward they must not reach (it reads DDP's reducer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.init_args = (args, kwargs)
        self.torn_down = False
        self.flushed = False

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.flushed = True

    def teardown(self) -> None:
        self.torn_down = True


def _strategy(ddp_kwargs: dict[str, Any] | None = None, device_ids: Any = None) -> Any:
    from overlapddp.integrations.trainer_strategy import OverlapDDPStrategySteps

    register = _Calls(result=False)

    class Strategy(OverlapDDPStrategySteps, _DDPStrategyStandIn):
        _redirection = staticmethod(lambda: "redirection")
        _register_comm_hook = staticmethod(register)

    strategy = Strategy("positional", bucket_cap_mb=1)
    strategy.register = register
    strategy._ddp_kwargs = ddp_kwargs or {}
    strategy.determine_ddp_device_ids = lambda: device_ids
    strategy._ddp_comm_hook = strategy._ddp_comm_state = strategy._ddp_comm_wrapper = None
    return strategy


def test_strategy_steps_build_the_wrapper_with_ddps_arguments(one_rank):
    strategy = _strategy({"bucket_cap_mb": 1, "static_graph": True})
    assert strategy.init_args == (("positional",), {"bucket_cap_mb": 1})
    assert strategy._forward_redirection == "redirection"
    assert strategy.strategy_name == "overlap_ddp"
    wrapper = strategy._setup_model(_net())
    assert isinstance(wrapper, OverlapDDP) and wrapper.bucket_bytes_cap == 1024 * 1024
    assert wrapper.static_graph and wrapper.device_ids is None

    manual = _net()
    manual.automatic_optimization = False
    with pytest.raises(ValueError, match=r"static_graph=True\) with manual optimization"):
        strategy._setup_model(manual)
    assert isinstance(_strategy({"static_graph": False})._setup_model(manual), OverlapDDP)
    assert isinstance(_strategy()._setup_model(manual), OverlapDDP)


def test_strategy_steps_register_hooks_only_when_given(one_rank):
    strategy = _strategy()
    strategy.model = "the wrapper"
    strategy._register_ddp_hooks()
    assert strategy.register.calls == []
    strategy._ddp_comm_hook, strategy._ddp_comm_state, strategy._ddp_comm_wrapper = "hook", "state", "wrap"
    strategy._register_ddp_hooks()
    assert strategy.register.calls == [
        ((), {"model": "the wrapper", "ddp_comm_state": "state", "ddp_comm_hook": "hook", "ddp_comm_wrapper": "wrap"})
    ]


def test_strategy_steps_arm_manual_optimizations_backward_from_the_loss(one_rank, monkeypatch):
    strategy = _strategy()
    wrapper = OverlapDDP(_net())
    armed = _Calls(result=False)
    monkeypatch.setattr(wrapper, "arm_backward", armed)
    manual = SimpleNamespace(automatic_optimization=False)
    loss = torch.zeros(())

    strategy.model, strategy.lightning_module = wrapper, manual
    strategy.pre_backward(loss)
    assert armed.calls == [(([loss],), {"caller": "Strategy.pre_backward", "rebuild": True})]
    assert wrapper.require_forward_param_sync

    wrapper.require_backward_grad_sync = False  # under toggle_model(sync_grad=False)
    strategy.pre_backward(loss)
    assert len(armed.calls) == 1 and wrapper.require_forward_param_sync is False
    wrapper.require_backward_grad_sync = wrapper.require_forward_param_sync = True
    with torch.no_grad():
        strategy.pre_backward(loss)
    assert len(armed.calls) == 1 and wrapper.require_forward_param_sync is False

    wrapper.require_forward_param_sync = True
    for model, module in ((wrapper, SimpleNamespace(automatic_optimization=True)), (wrapper, None), (_net(), manual)):
        strategy.model, strategy.lightning_module = model, module
        strategy.pre_backward(loss)
    assert len(armed.calls) == 1 and wrapper.require_forward_param_sync is True
    strategy.post_backward(loss)  # DDP's static-graph flush: OverlapDDP does it itself
    assert not strategy.flushed and len(armed.calls) == 1


def test_strategy_steps_unwrap_at_teardown_and_register_by_name(one_rank):
    strategy = _strategy()
    module = _net()
    strategy.model, strategy.lightning_module = OverlapDDP(module), module
    strategy.teardown()
    assert strategy.model is module and strategy.torn_down
    other = _strategy()
    other.model, other.lightning_module = "not a wrapper", module
    other.teardown()
    assert other.model == "not a wrapper" and other.torn_down

    registry = SimpleNamespace(register=_Calls(result=False))
    type(strategy).register_strategies(registry)
    assert registry.register.calls == [(
        ("overlap_ddp", type(strategy)),
        {"description": "DDP with OverlapDDP as the wrapper", "start_method": "popen", "override": True},
    )]


def test_manual_optimization_redirection_turns_sync_off_inside_the_forward(one_rank):
    from overlapddp.integrations.trainer_strategy import ManualOptimizationRedirection

    redirection = ManualOptimizationRedirection()
    wrapper = OverlapDDP(_net())
    manual, automatic = SimpleNamespace(automatic_optimization=False), SimpleNamespace(automatic_optimization=True)
    redirection.on_after_inner_forward(wrapper, automatic)
    assert wrapper.require_backward_grad_sync is True
    redirection.on_after_inner_forward(wrapper, manual)
    assert wrapper.require_backward_grad_sync is False
    redirection.on_after_outer_forward(wrapper, automatic)
    assert wrapper.require_backward_grad_sync is False
    redirection.on_after_outer_forward(wrapper, manual)
    assert wrapper.require_backward_grad_sync is True
    bare = _net()
    redirection.on_after_inner_forward(bare, manual)
    assert not hasattr(bare, "require_backward_grad_sync")


# ---------------------------------------------------------------- Fabric


def test_fabric_registers_the_strategy_by_name():
    _needs("lightning")
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from overlapddp.integrations.fabric import OverlapDDPFabricStrategy

    entry = STRATEGY_REGISTRY["overlap_ddp"]
    assert entry["strategy"] is OverlapDDPFabricStrategy
    assert entry["init_params"] == {"start_method": "popen"}
    OverlapDDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # a second import replaces the entry
    assert STRATEGY_REGISTRY["overlap_ddp"]["strategy"] is OverlapDDPFabricStrategy


def test_fabric_no_backward_sync_is_the_wrappers_no_sync_and_refuses_a_bare_module(one_rank):
    _needs("lightning")
    from overlapddp.integrations.fabric import OverlapDDPFabricStrategy

    control = OverlapDDPFabricStrategy()._backward_sync_control
    wrapper = OverlapDDP(_net())
    with control.no_backward_sync(wrapper, enabled=True):
        assert wrapper.require_backward_grad_sync is False
    assert wrapper.require_backward_grad_sync is True
    with control.no_backward_sync(wrapper, enabled=False):
        assert wrapper.require_backward_grad_sync is True
    with pytest.raises(TypeError, match=r"needs the module that fabric.setup wrapped in OverlapDDP; got Sequential"):
        control.no_backward_sync(_net(), enabled=True)
    assert isinstance(control.no_backward_sync(_net(), enabled=False), nullcontext)


def test_fabric_setup_and_state_dicts_use_the_bare_module(one_rank):
    _needs("lightning")
    from overlapddp.integrations.fabric import OverlapDDPFabricStrategy

    strategy = OverlapDDPFabricStrategy(bucket_cap_mb=1)
    strategy._determine_ddp_device_ids = lambda: None
    wrapper = strategy.setup_module(_net())
    assert isinstance(wrapper, OverlapDDP) and wrapper.bucket_bytes_cap == 1024 * 1024
    assert wrapper.device_ids is None
    state = strategy.get_module_state_dict(wrapper)
    assert list(state) == list(wrapper.module.state_dict())  # no "module." prefix
    changed = {name: torch.full_like(value, 7.0) for name, value in state.items()}
    strategy.load_module_state_dict(wrapper, changed)
    assert all(torch.equal(value, changed[name]) for name, value in wrapper.module.state_dict().items())
    bare = _net()
    assert list(strategy.get_module_state_dict(bare)) == list(bare.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):
        strategy.load_module_state_dict(wrapper, {})  # strict by default, as Fabric's
    strategy.load_module_state_dict(wrapper, {}, strict=False)
