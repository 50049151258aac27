"""Every refusal comes before the first collective: a bad argument fails on every rank alike, and no
rank is left waiting in a collective that another rank never reached.

The process group's collectives are recorded (every ``torch.distributed`` collective the package can
call is wrapped while a case runs); each refusal of docs/errors.md that a constructor or a
registration makes must raise with zero collectives issued. The recorder's own check: a valid
construction is seen issuing its init-time collectives. Refusals at run time (a rank behind, a
gradient unused, a step while reducing) are not in this list: they are raised by the collectives'
outcome and are tested where they happen (test_desync.py, test_wrapper.py, test_guard.py).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP

# Every collective (and object collective) a module of the package could call, by name in torch.distributed.
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "all_gather_into_tensor",
    "reduce_scatter_tensor", "reduce_scatter", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "_broadcast_coalesced",
)


@pytest.fixture
def issued(one_rank, monkeypatch) -> list[str]:
    """The names of the collectives issued while the test runs, in order."""
    calls: list[str] = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def recording(*args: Any, __name: str = name, __original: Callable = original, **kwargs: Any) -> Any:
            calls.append(__name)
            return __original(*args, **kwargs)

        monkeypatch.setattr(dist, name, recording)
    return calls


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)


class _SparseParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.table = nn.Parameter(torch.eye(3).to_sparse())


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()


def _wrap(module: Callable[[], nn.Module], **kwargs: Any) -> Callable[[], Any]:
    return lambda: OverlapDDP(module(), **kwargs)


def _delayed(**extra: Any) -> Callable[[], Any]:
    def build() -> Any:
        net = _mlp()
        kwargs = {"delay_all_reduce_named_params": [("0.weight", net[0].weight)],
                  "param_to_hook_all_reduce": net[0].weight}
        kwargs.update({k: v(net) if callable(v) else v for k, v in extra.items()})
        return OverlapDDP(net, **kwargs)

    return build


def _all_delayed() -> Any:
    net = nn.Linear(4, 2)
    return OverlapDDP(net, delay_all_reduce_named_params=list(net.named_parameters()),
                      param_to_hook_all_reduce=net.weight)


def _delayed_two_dtypes() -> Any:
    net = _MixedDtypes()
    return OverlapDDP(net, delay_all_reduce_named_params=[("a.weight", net.a.weight), ("b.weight", net.b.weight)],
                      param_to_hook_all_reduce=net.a.weight)


MP = _MixedPrecision(param_dtype=torch.bfloat16)
# (case, what builds and is refused, the exception, a regex the message must match)
REFUSALS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("no trainable parameters", _wrap(lambda: nn.Linear(2, 2).requires_grad_(False)), RuntimeError,
     "requires a gradient"),
    ("lazy parameters", _wrap(lambda: nn.Sequential(nn.LazyLinear(3))), RuntimeError, r"uninitialized.*0\.weight"),
    ("mixed device types", _wrap(lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))),
     ValueError, "one type of device"),
    ("a sparse parameter tensor", _wrap(_SparseParameter), ValueError, "table are sparse tensors"),
    ("device_ids for a CPU module", _wrap(_mlp, device_ids=[0]), ValueError, "single-device GPU modules"),
    ("two device ids", _wrap(_mlp, device_ids=[0, 1]), ValueError, "single element"),
    ("bad bucket_cap_mb", _wrap(_mlp, bucket_cap_mb=-1), ValueError, "bucket_cap_mb"),
    ("bad bucket_cap_mb_list", _wrap(_mlp, bucket_cap_mb_list=[1, -1]), ValueError, r"bucket_cap_mb_list\[1\]"),
    ("process_group and device_mesh", _wrap(_mlp, process_group=object(), device_mesh=object()), RuntimeError,
     "both process_group and device_mesh"),
    ("one of the delayed pair", _wrap(_mlp, delay_all_reduce_named_params=[]), ValueError, "at the same time"),
    ("a delayed name not in the module", _delayed(delay_all_reduce_named_params=lambda n: [("nope", n[0].weight)]),
     ValueError, "'nope' does not name"),
    ("a hook parameter not in the module", _delayed(param_to_hook_all_reduce=lambda n: nn.Parameter(torch.ones(1))),
     ValueError, "param_to_hook_all_reduce must be a parameter of the wrapped module"),
    ("every parameter delayed", _all_delayed, NotImplementedError, "leave at least one parameter"),
    ("delayed parameters of two dtypes", _delayed_two_dtypes, ValueError, "one dtype and device"),
    ("mixed_precision not a config", _wrap(_mlp, mixed_precision=object()), TypeError, "param_dtype"),
    ("an unknown bucket_plan", _wrap(_mlp, bucket_plan="fastest"), ValueError, "bucket_plan must be one of"),
    ("tuned plan with sparse gradients", _wrap(_Sparse, bucket_plan="tuned"), ValueError, "embed.weight produce"),
    ("tuned plan with the unused search", _wrap(_mlp, bucket_plan="tuned", find_unused_parameters=True),
     ValueError, "never does on a dynamic graph"),
    ("mixed precision with bucket views", _wrap(_mlp, mixed_precision=MP, gradient_as_bucket_view=True),
     ValueError, "gradient_as_bucket_view"),
    ("mixed precision with the unused search", _wrap(_mlp, mixed_precision=MP, find_unused_parameters=True),
     ValueError, "find_unused_parameters"),
    ("mixed precision with the delayed all-reduce", _delayed(mixed_precision=MP), ValueError,
     "delay_all_reduce_named_params"),
    ("mixed precision with sparse gradients", _wrap(_Sparse, mixed_precision=MP), ValueError, "sparse gradients"),
]

# (case, a valid wrapper, the refused registration on it, the exception, a regex of the message)
REGISTRATION_REFUSALS: list[tuple[str, Callable[[], Any], Callable[[Any], Any], type[Exception], str]] = [
    ("a comm hook that is not callable", _wrap(_mlp), lambda m: m.register_comm_hook(None, "hook"), TypeError,
     "callable"),
    ("a comm hook registered twice", _wrap(_mlp),
     lambda m: [m.register_comm_hook(None, default_hooks.allreduce_hook) for _ in range(2)], RuntimeError,
     "only be called once"),
    ("PowerSGD over sparse gradients", _wrap(_Sparse),
     lambda m: m.register_comm_hook(powerSGD_hook.PowerSGDState(None), powerSGD_hook.powerSGD_hook), ValueError,
     "sparse gradients"),
    ("join with the delayed all-reduce", _delayed(), lambda m: m.join_hook(), ValueError, "join"),
    ("an optimizer overlap cannot split", _wrap(_mlp),
     lambda m: m.attach_optimizer(torch.optim.LBFGS(m.parameters()), overlap=True), ValueError, "LBFGS"),
    ("max_grad_norm without overlap", _wrap(_mlp),
     lambda m: m.attach_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), max_grad_norm=1.0), ValueError,
     "max_grad_norm is for overlap=True"),
    ("token weighting with a comm hook", _wrap(_mlp),
     lambda m: (m.register_comm_hook(None, default_hooks.allreduce_hook), m.count_tokens(3)), RuntimeError,
     "cannot be combined"),
]


def test_the_recorder_sees_the_collectives_of_a_valid_construction(issued):
    OverlapDDP(_mlp())
    assert "broadcast" in issued and "all_gather_object" in issued, issued


@pytest.mark.parametrize("case, build, error, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_constructor_refusal_comes_before_the_first_collective(issued, case, build, error, message):
    with pytest.raises(error, match=message):
        build()
    assert issued == [], f"{case}: collectives {issued} ran before the refusal"


@pytest.mark.parametrize("case, build, register, error, message", REGISTRATION_REFUSALS,
                         ids=[r[0] for r in REGISTRATION_REFUSALS])
def test_every_registration_refusal_issues_no_collective(issued, case, build, register, error, message):
    model = build()
    issued.clear()
    with pytest.raises(error, match=message):
        register(model)
    assert issued == [], f"{case}: collectives {issued} ran before the refusal"
