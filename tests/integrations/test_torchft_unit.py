"""The torchft wrapper's own logic in this process, with a stand-in Manager: what each bucket sends
through the manager and in which dtype, what comes back, when buckets launch and complete, the bucket
layout, the completion thread's end, and every refusal. (tests/integrations/test_torchft.py runs real replicas.)"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

pytest.importorskip("torchft")

from torchft.manager import Manager  # noqa: E402

from overlapddp.integrations import torchft as ours  # noqa: E402
from overlapddp.optim.guard import OptimizerGuard  # noqa: E402


class _Work:
    """The manager's work: on ``wait()`` it adds one to the sent tensor in its own dtype (what a
    reduction over the quorum would replace), after ``delay_s``; or raises ``error``."""

    def __init__(self, manager: StandInManager, tensor: torch.Tensor) -> None:
        self.manager, self.tensor = manager, tensor

    def wait(self) -> bool:
        time.sleep(self.manager.delay_s)
        if self.manager.error is not None:
            raise self.manager.error
        self.tensor.add_(1)
        self.manager.events.append(("done", threading.current_thread().name))
        return True


class StandInManager(Manager):
    """A Manager with no lighthouse and no group: it records what the wrapper asks of it."""

    def __init__(self, *, delay_s: float = 0.0, error: Exception | None = None, **attributes: Any) -> None:
        self.delay_s, self.error = delay_s, error
        self.events: list[tuple[str, str]] = []
        self.sent_dtypes: list[torch.dtype] = []
        self.registered: dict[str, tuple[Any, Any]] = {}
        self.__dict__.update(attributes)

    def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.events.append(("launch", threading.current_thread().name))
        self.sent_dtypes.append(tensor.dtype)
        return _Work(self, tensor)

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        self.registered[key] = (load_state_dict, state_dict)


@pytest.fixture(autouse=True, scope="module")
def _no_group_left_behind():
    """The wrapper initializes a one-rank group itself when none is; it is destroyed after this module."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _local_grads(net: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
    local = copy.deepcopy(net)
    local(inputs).square().sum().backward()
    return [p.grad.clone() for p in local.parameters()]


def _four_buckets(manager: StandInManager, hook: Any = None) -> ours.DistributedDataParallel:
    """Each parameter in its own bucket (a one-byte cap), after a first backward whose sends are
    forgotten."""
    model = ours.DistributedDataParallel(manager, _net(), bucket_cap_mb=1e-6)
    if hook is not None:
        model.register_comm_hook(None, hook)
    model(torch.randn(2, 6)).sum().backward()
    model.zero_grad(set_to_none=True)
    manager.events.clear()
    manager.sent_dtypes.clear()
    return model


def test_a_missing_group_is_made_of_this_rank_alone_and_an_existing_one_is_used() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    made = ours._replica_local_group()
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert made is dist.group.WORLD
    assert ours._replica_local_group() is dist.group.WORLD  # initialized: not made again


def test_each_bucket_goes_through_the_manager_and_its_result_is_the_gradient() -> None:
    manager = StandInManager()
    model = _four_buckets(manager)
    inputs = torch.randn(4, 6)
    expected = _local_grads(model.module, inputs)
    model(inputs).square().sum().backward()
    assert manager.sent_dtypes == [torch.float32] * 4
    for param, local in zip(model.parameters(), expected, strict=True):
        assert torch.equal(param.grad, local + 1)


def test_fp16_compression_sends_half_and_copies_the_result_back() -> None:
    manager = StandInManager()
    model = _four_buckets(manager, default_hooks.fp16_compress_hook)
    inputs = torch.randn(4, 6)
    expected = _local_grads(model.module, inputs)
    model(inputs).square().sum().backward()
    assert manager.sent_dtypes == [torch.float16] * 4
    for param, local in zip(model.parameters(), expected, strict=True):
        assert param.grad.dtype == torch.float32
        assert torch.equal(param.grad, (local.half() + 1).float())


def test_bf16_compression_and_the_default_hook() -> None:
    bf16 = _four_buckets(StandInManager(), default_hooks.bf16_compress_hook)
    plain = _four_buckets(StandInManager(), default_hooks.allreduce_hook)  # what the manager already does
    plain.register_comm_hook(None, default_hooks.allreduce_hook)  # even after a backward
    for model, dtype in ((bf16, torch.bfloat16), (plain, torch.float32)):
        model(torch.randn(2, 6)).sum().backward()
        assert model.manager.sent_dtypes == [dtype] * 4


def test_every_bucket_launches_before_the_first_completes_on_the_completion_thread() -> None:
    manager = StandInManager(delay_s=0.1)
    model = _four_buckets(manager)
    model(torch.randn(2, 6)).sum().backward()
    assert [tag for tag, _ in manager.events] == ["launch"] * 4 + ["done"] * 4
    assert {thread for tag, thread in manager.events if tag == "done"} == {"overlapddp-torchft-completion"}


class _Branches(nn.Module):
    """A forward that leaves a parameter out, as torchft's DDP accepts (it searches unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_forward_that_leaves_parameters_out_trains_as_with_torchfts_ddp() -> None:
    """No find_unused_parameters to pass: the used parameters are reduced, the unused keep no gradient."""
    model = ours.DistributedDataParallel(StandInManager(), _Branches())
    inputs = torch.randn(4, 6)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(inputs).square().sum().backward()
        local = _Branches()
        local(inputs).square().sum().backward()
        assert torch.equal(model.module.used.weight.grad, local.used.weight.grad + 1)
        assert model.module.unused.weight.grad is None


def test_an_error_in_the_completion_reaches_backward() -> None:
    manager = StandInManager()
    model = _four_buckets(manager)
    manager.error = RuntimeError("the stand-in's wait failed")
    with pytest.raises(RuntimeError, match="the stand-in's wait failed"):
        model(torch.randn(2, 6)).sum().backward()


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


@pytest.mark.parametrize("kwargs", [{}, {"bucket_cap_mb": 1 / 1024}, {"bucket_cap_mb": 1},
                                    {"bucket_cap_mb_list": [0.5, 2]}], ids=["default", "1KiB", "1MiB", "list"])
def test_the_layout_is_torchfts_ddps_and_stays_so_nothing_travels_with_the_state(kwargs: dict[str, Any]) -> None:
    """Each bucket's parameters, in launch order, equal torchft's DDP's (DDP's find_unused_parameters
    layout), before and after backwards (DDP would rebuild after the first): a recovering replica's
    first buckets are its peers'. No state is registered with the manager for it."""
    from torchft import DistributedDataParallel as TorchftDDP

    for width, depth in ((24, 3), (512, 8), (1024, 3)):
        manager = StandInManager()
        model = ours.DistributedDataParallel(manager, _mlp(width, depth), **kwargs)
        theirs = TorchftDDP(StandInManager(), _mlp(width, depth), **kwargs)
        expected = theirs._get_ddp_logging_data()["bucket_sizes"]  # bytes per bucket, in launch order
        for _ in range(3):
            sizes = [sum(model.module.get_parameter(model._reducer.names[i]).numel() * 4 for i in bucket)
                     for bucket in model.bucket_indices()]
            assert ", ".join(map(str, sizes)) == expected, (width, depth, sizes, expected)
            model(torch.randn(2, width)).sum().backward()
        assert manager.registered == {}


def test_a_compression_hook_is_registered_once_and_before_the_first_backward() -> None:
    twice = ours.DistributedDataParallel(StandInManager(), _net())
    twice.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(RuntimeError, match=r"once, before the first backward \(found wire dtype torch.float16, "
                                           "started=False"):
        twice.register_comm_hook(None, default_hooks.bf16_compress_hook)
    late = _four_buckets(StandInManager())
    late(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match=r"\(found wire dtype None, started=True\)"):
        late.register_comm_hook(None, default_hooks.fp16_compress_hook)


def test_other_hooks_and_builtin_hooks_are_refused_by_name() -> None:
    model = _four_buckets(StandInManager())

    def my_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="the communication hook .*my_hook cannot be registered: every bucket is already reduced"):
        model.register_comm_hook(None, my_hook)
    with pytest.raises(ValueError, match="_register_builtin_comm_hook is not supported: built-in hooks"):
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)


def test_the_guard_is_attached_and_overlap_and_shard_are_refused() -> None:
    model = _four_buckets(StandInManager())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"attach_optimizer\(overlap=True\) is not supported: each bucket's update"):
        model.attach_optimizer(sgd, overlap=True)
    with pytest.raises(ValueError, match=r"attach_optimizer\(shard=True\) is not supported: each replica group"):
        model.attach_optimizer(sgd, shard=True)
    with pytest.raises(ValueError, match="max_grad_norm is for overlap=True"):  # the keywords reach OverlapDDP's
        model.attach_optimizer(sgd, max_grad_norm=1.0)
    assert isinstance(model.attach_optimizer(sgd), OptimizerGuard)


def test_tokens_join_and_copies_are_refused() -> None:
    model = _four_buckets(StandInManager())
    with pytest.raises(ValueError, match="count_tokens is not supported: the global token count"):
        model.count_tokens(3)
    with pytest.raises(ValueError, match=r"join\(\) is not supported: a replica that runs out of data"):
        model.join()
    with pytest.raises(ValueError, match="pickling or copy.deepcopy is not supported: a copy cannot hold"):
        copy.deepcopy(model)


def test_the_manager_and_the_module_are_checked_first() -> None:
    with pytest.raises(TypeError, match="manager must be a torchft.Manager, got Sequential"):
        ours.DistributedDataParallel(_net(), _net())
    with pytest.raises(TypeError, match="module must be an nn.Module, got int"):
        ours.DistributedDataParallel(StandInManager(), 3)




def test_unknown_arguments_are_named_with_the_accepted_ones() -> None:
    with pytest.raises(TypeError) as raised:
        ours.DistributedDataParallel(StandInManager(), _net(), zeta=1, bucket_cap=2)
    message = str(raised.value)
    assert message.startswith("overlapddp.integrations.torchft: 'bucket_cap', 'zeta' is not an argument")
    accepted = message.split("it takes ")[1].rstrip(".").split(", ")
    assert accepted == sorted(accepted) and "bucket_cap_mb" in accepted
    assert not set(ours.REFUSED) & set(accepted)


def test_refused_options_name_themselves_and_defaults_pass() -> None:
    net = _net()
    for name, value, shown in (
        ("mixed_precision", object(), "mixed_precision"),
        ("mixed_precision", "ddp", "mixed_precision='ddp'"),
        ("bucket_plan", "tuned", "bucket_plan='tuned'"),
        ("bucket_plan", "auto", "bucket_plan='auto'"),  # sorts before 'ddp': refused here, not by OverlapDDP
        ("process_group", object(), "process_group"),
        ("find_unused_parameters", False, "find_unused_parameters=False"),
        ("static_graph", True, "static_graph=True"),
    ):
        with pytest.raises(ValueError, match=rf"torchft: {shown} is not supported: {ours.REFUSED[name][:30]}"):
            ours.DistributedDataParallel(StandInManager(), net, **{name: value})
    ours.DistributedDataParallel(StandInManager(), net, bucket_plan="ddp", process_group=None, device_mesh=None,
                                 find_unused_parameters=True, static_graph=False)
    read_from_a_config = "".join(["dd", "p"])  # equal to the default, not the same object
    ours.DistributedDataParallel(StandInManager(), net, bucket_plan=read_from_a_config)


def test_arguments_go_by_keyword_as_torchfts_ddps_and_the_guards() -> None:
    model = ours.DistributedDataParallel(manager=StandInManager(), module=_net(), bucket_cap_mb=1)
    assert model.bucket_bytes_cap == 2**20
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(model.attach_optimizer(optimizer=sgd), OptimizerGuard)
    with pytest.raises(TypeError):  # DDP's arguments by keyword only, as torchft's DDP: a third positional is a mistake
        ours.DistributedDataParallel(StandInManager(), _net(), [0])


def test_a_group_of_several_ranks_gives_each_rank_a_group_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    own = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "new_subgroups", lambda group_size: (made.append(group_size), own)[1:] + ([],))
    assert ours._replica_local_group() is own
    assert made == [1]


# Run in a fresh interpreter: its first exit function, so the last to run, fails the process (exit 3)
# if a completion thread is still alive then; the model stays alive at exit (a global, as in a script).
_EXIT_SCRIPT = """
import atexit, os, threading
atexit.register(lambda: any(t.name == "overlapddp-torchft-completion" for t in threading.enumerate()) and os._exit(3))
import torch
from tests.integrations.test_torchft_unit import StandInManager, _net
from overlapddp.integrations.torchft import DistributedDataParallel
model = DistributedDataParallel(StandInManager(delay_s=0.3), _net(), bucket_cap_mb=1e-6)
model(torch.randn(2, 6)).sum().backward()
model._manager_reduction.launch(torch.zeros(3))  # a bucket still in flight at exit
"""


def test_the_completion_thread_is_joined_before_the_interpreter_is_torn_down() -> None:
    """[Note: a clean exit]: stopped from atexit and joined once the bucket still in flight is
    complete; and the process ends (the thread never keeps it alive)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], cwd=root, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_no_work_is_held_once_its_bucket_is_complete() -> None:
    """The completion thread keeps no collective's work while it waits for the next bucket (else the
    last one would be freed on it at exit: see [Note: a clean exit])."""
    manager = StandInManager()
    made: list[weakref.ref] = []
    launch = manager.allreduce

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = launch(tensor)
        made.append(weakref.ref(work))
        return work

    manager.allreduce = recorded  # type: ignore[method-assign]
    model = _four_buckets(manager)
    model(torch.randn(2, 6)).sum().backward()
    deadline = time.monotonic() + 10
    while any(ref() is not None for ref in made) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(made) == 8 and all(ref() is None for ref in made), [ref() for ref in made]  # two backwards


def test_the_completion_thread_ends_with_its_wrapper() -> None:
    model = _four_buckets(StandInManager())
    stop = model._manager_reduction.stop
    assert stop.alive
    del model
    gc.collect()
    assert not stop.alive  # the finalizer ran: the thread was told to stop, and joined


def test_sparse_embeddings_are_listed_and_dense_ones_pass() -> None:
    sparse = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Linear(2, 2), nn.Embedding(5, 2, sparse=True))
    with pytest.raises(ValueError, match=r"sparse gradients \(0, 2 have sparse=True\) is not supported"):
        ours.DistributedDataParallel(StandInManager(), sparse)
    ours.DistributedDataParallel(StandInManager(), nn.Sequential(nn.Embedding(5, 2, sparse=False), nn.Linear(2, 2)))
    counted = nn.Linear(2, 2)
    counted.sparse = 1  # an attribute of the same name that is not the flag (a count, a ratio)
    ours.DistributedDataParallel(StandInManager(), nn.Sequential(counted))
