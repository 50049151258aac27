"""The wrapper's contract with a DDP user: signature, state_dict, forward, buffers, errors."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.param_usage import map_tensors, tensors_in
from overlapddp.torch_compat import ddp_accepts
from tests.support import models
from tests.support.multiprocess import run_ranks


def test_constructor_signature_matches_ddp_names_order_and_defaults():
    ours = list(inspect.signature(OverlapDDP.__init__).parameters.values())
    theirs = list(inspect.signature(DistributedDataParallel.__init__).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert [p.default for p in ours[: len(theirs)]] == [p.default for p in theirs]
    assert [p.kind for p in ours[: len(theirs)]] == [p.kind for p in theirs]
    # Our own additions come after DDP's, keyword-only, so no positional call changes meaning.
    extras = ours[len(theirs):]
    assert [(p.name, p.default, p.kind) for p in extras] == [("bucket_plan", "ddp", inspect.Parameter.KEYWORD_ONLY)]


@pytest.mark.parametrize(
    "argument, value, error",
    [("mixed_precision", object(), TypeError), ("delay_all_reduce_named_params", [("weight", None)], ValueError)],
)
def test_bad_mixed_precision_or_delayed_arguments_are_refused_naming_them(argument, value, error):
    net = nn.Linear(2, 2)
    kwargs = {argument: value}
    if argument == "delay_all_reduce_named_params":
        kwargs["param_to_hook_all_reduce"] = net.weight
    with pytest.raises(error, match=argument):
        OverlapDDP(net, **kwargs)


def test_delayed_all_reduce_arguments_must_come_together():
    with pytest.raises(ValueError, match="need to be set at the same time"):
        OverlapDDP(nn.Linear(2, 2), delay_all_reduce_named_params=[])


def _contract_checks(rank: int, world_size: int) -> dict[str, object]:
    """Run on every rank; returns named facts for the tests to assert on."""
    facts: dict[str, object] = {}

    # Init sync: rank-dependent initial values become rank 0's, parameters and buffers alike.
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    net[1].running_mean.fill_(float(rank))
    OverlapDDP(net)
    gathered = [torch.empty(4) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, net[0].bias.detach().clone())
    facts["params_synced"] = all(torch.equal(gathered[0], g) for g in gathered)
    facts["buffer_after_init"] = net[1].running_mean[0].item()

    # A frozen layer initialised differently on each rank: DDP broadcasts every parameter it does not
    # ignore, whether it requires grad or not, so rank 0's values reach every rank.
    for wrapper in (OverlapDDP, DistributedDataParallel):
        torch.manual_seed(rank)
        frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False))
        wrapper(frozen)
        gathered = [torch.empty(4, 4) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, frozen[1].weight.detach().clone())
        facts[f"frozen_synced/{wrapper.__name__}"] = all(torch.equal(gathered[0], g) for g in gathered)

    torch.manual_seed(rank)
    kept = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    kept[1].running_mean.fill_(float(rank))
    with pytest.warns(FutureWarning, match="broadcast_buffers"):
        OverlapDDP(kept, broadcast_buffers=False)
    facts["buffer_kept_without_broadcast"] = kept[1].running_mean[0].item()

    # forward_sync_buffers=False turns off the broadcast at forward only: construction still takes
    # rank 0's buffers, in DDP as here.
    for wrapper in (OverlapDDP, DistributedDataParallel) if ddp_accepts("forward_sync_buffers") else (OverlapDDP,):
        torch.manual_seed(rank)
        unsynced = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        unsynced[1].running_mean.fill_(float(rank))
        wrapper(unsynced, forward_sync_buffers=False)
        facts[f"buffer_at_init_without_forward_sync/{wrapper.__name__}"] = unsynced[1].running_mean[0].item()

    # state_dict: the same keys as DDP, and checkpoints load both ways.
    ddp = DistributedDataParallel(models.build("cnn_bn"))
    ours = OverlapDDP(models.build("cnn_bn"))
    facts["same_keys"] = list(ddp.state_dict()) == list(ours.state_dict())
    facts["all_prefixed"] = all(k.startswith("module.") for k in ours.state_dict())
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(1.0)
    ours.load_state_dict(ddp.state_dict())
    facts["ddp_checkpoint_loads"] = all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False))
    ddp2 = DistributedDataParallel(models.build("cnn_bn"))
    ddp2.load_state_dict(ours.state_dict())
    facts["ours_loads_into_ddp"] = all(torch.equal(a, b) for a, b in zip(ddp2.state_dict().values(), ours.state_dict().values(), strict=False))

    # forward returns what the module returns; train/eval reach the module and return the wrapper.
    x, _ = models.batch("cnn_bn", rank, 0)
    facts["eval_returns_self"] = ours.eval() is ours and not ours.module.training
    with torch.no_grad():
        facts["forward_unchanged"] = torch.equal(ours(x), ours.module(x))
    facts["train_returns_self"] = ours.train() is ours and ours.module.training
    dict_out = OverlapDDP(_DictOut())(torch.ones(2, 3))
    facts["dict_output_kept"] = isinstance(dict_out, dict) and set(dict_out) == {"y", "aux"}

    # A 1-D device mesh stands for its process group.
    mesh = init_device_mesh("cpu", (world_size,))
    on_mesh = OverlapDDP(nn.Linear(3, 3), device_mesh=mesh)
    on_mesh(torch.full((1, 3), float(rank))).sum().backward()
    grads = [torch.empty(3, 3) for _ in range(world_size)]
    torch.distributed.all_gather(grads, on_mesh.module.weight.grad)
    facts["device_mesh_reduces"] = all(torch.equal(grads[0], g) for g in grads)
    return facts


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return {"y": self.lin(x), "aux": [x.sum()]}


@functools.cache
def contract_facts() -> list[dict[str, object]]:
    return run_ranks(3, _contract_checks)


def test_init_sync_broadcasts_rank0_parameters_and_buffers():
    for rank, facts in enumerate(contract_facts()):
        assert facts["params_synced"], rank
        assert facts["buffer_after_init"] == 0.0, rank


def test_init_sync_broadcasts_frozen_parameters_as_ddp_does():
    for rank, facts in enumerate(contract_facts()):
        assert facts["frozen_synced/DistributedDataParallel"], rank
        assert facts["frozen_synced/OverlapDDP"], f"rank {rank}: a frozen layer kept its own initial values"


def test_forward_sync_buffers_false_still_broadcasts_buffers_at_init_as_ddp_does():
    for rank, facts in enumerate(contract_facts()):
        assert facts["buffer_at_init_without_forward_sync/OverlapDDP"] == 0.0, rank
        assert facts.get("buffer_at_init_without_forward_sync/DistributedDataParallel", 0.0) == 0.0, rank


def test_broadcast_buffers_false_keeps_local_buffers_at_init():
    assert [f["buffer_kept_without_broadcast"] for f in contract_facts()] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "fact", ["same_keys", "all_prefixed", "ddp_checkpoint_loads", "ours_loads_into_ddp"]
)
def test_state_dict_is_interchangeable_with_ddp(fact):
    assert all(f[fact] for f in contract_facts())


@pytest.mark.parametrize(
    "fact", ["eval_returns_self", "forward_unchanged", "train_returns_self", "dict_output_kept", "device_mesh_reduces"]
)
def test_module_behaviour_is_passed_through(fact):
    assert all(f[fact] for f in contract_facts())


class _TwoBranch(nn.Module):
    """Uses ``idle`` only when asked: the classic unused-parameter bug."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.idle = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, only_used: bool) -> torch.Tensor:
        return self.used(x) if only_used else self.idle(self.used(x))


def _unused_parameter(rank: int, world_size: int) -> dict[str, object]:
    wrapped = OverlapDDP(_TwoBranch())
    x = torch.ones(2, 3)
    wrapped(x, only_used=True).sum().backward()
    facts: dict[str, object] = {"grad_left_local": wrapped.module.used.weight.grad is not None}
    try:
        wrapped(x, only_used=True)
        facts["message"] = "no error"
    except RuntimeError as error:
        facts["message"] = str(error)
    # Usable again after the error: a full iteration reduces every gradient.
    wrapped(x, only_used=False).sum().backward()
    grads = [torch.empty(3, 3) for _ in range(world_size)]
    torch.distributed.all_gather(grads, wrapped.module.idle.weight.grad)
    facts["recovered"] = all(torch.equal(grads[0], g) for g in grads)
    return facts


def test_unused_parameter_error_names_the_parameters_and_rank_and_recovers():
    for rank, facts in enumerate(run_ranks(2, _unused_parameter)):
        message = facts["message"]
        assert "Expected to have finished reduction in the prior iteration" in message
        assert "idle.weight" in message and "idle.bias" in message and "used.weight" not in message
        assert f"for rank {rank}" in message
        assert "find_unused_parameters=True" in message
        assert facts["recovered"]


def _mismatched_shapes(rank: int, world_size: int) -> str:
    net = nn.Sequential(nn.Linear(4, 4 + (rank == 1)))
    try:
        OverlapDDP(net)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_mismatched_parameter_shapes_raise_on_every_rank_naming_parameter_and_rank():
    for message in run_ranks(3, _mismatched_shapes):
        assert "parameter 0 differs" in message and "0.weight" in message
        assert "rank 1 has 0.weight with shape [5, 4]" in message


def test_gradient_as_bucket_view_makes_gradients_views_of_the_buckets(one_rank):
    model = OverlapDDP(models.build("mlp"), gradient_as_bucket_view=True)
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    buckets = {p.storage.buffer.untyped_storage().data_ptr() for p in model._reducer.pipelines}
    assert all(p.grad.untyped_storage().data_ptr() in buckets for p in model.parameters())


# -- DDP's remaining public and widely used private entry points -------------------------------


def test_to_kwargs_returns_what_ddp_returns(one_rank):
    ddp, ours = DistributedDataParallel(nn.Linear(3, 3)), OverlapDDP(nn.Linear(3, 3))
    x = torch.arange(6.0).reshape(2, 3)
    pair = collections.namedtuple("pair", "a b")
    cases = [((x, [x, {"a": x}]), {"k": x}), ((), {"k": x}), ((x,), None), ((x, x), {}), ([x, x], None), ((pair(x, x),), None)]
    for inputs, kwargs in cases:
        theirs, mine = ddp.to_kwargs(inputs, kwargs, 0), ours.to_kwargs(inputs, kwargs, 0)
        assert repr(mine) == repr(theirs)  # same nesting, same values


def test_comm_hooks_record_the_registered_hook_as_ddp_does(one_rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp, ours = DistributedDataParallel(nn.Linear(3, 3)), OverlapDDP(nn.Linear(3, 3))
    assert ours._comm_hooks == ddp._comm_hooks == []
    for wrapper in (ddp, ours):
        wrapper.register_comm_hook(None, default_hooks.allreduce_hook)
    assert ours._comm_hooks == ddp._comm_hooks == [(default_hooks.allreduce_hook, None)]


def test_a_refused_bucket_state_changes_nothing(one_rank):
    model = OverlapDDP(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    refused = {"ready_order": [3, 2, 1, 0], "tuned_buckets": [[0, 1], [2, 3]]}  # needs bucket_plan="tuned"
    with pytest.raises(ValueError, match="construct with bucket_plan='tuned'"):
        model.load_bucket_state(refused)
    assert model.bucket_state() == {"ready_order": None, "tuned_buckets": None}
    assert not model._has_rebuilt_buckets  # DDP's own rebuild still happens


def test_the_constructor_hands_every_argument_to_its_steps():
    from overlapddp.construction import Arguments

    fields = [field.name for field in dataclasses.fields(Arguments)]
    assert fields == list(inspect.signature(OverlapDDP.__init__).parameters)[2:]  # less self and module


def test_set_params_and_buffers_to_ignore_marks_the_module_as_ddp_does(one_rank):
    marked = []
    for wrapper in (DistributedDataParallel, OverlapDDP):
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        wrapper._set_params_and_buffers_to_ignore_for_model(net, ["0.bias", "1.running_mean"])
        tensors = [*net.named_parameters(), *net.named_buffers()]
        marked.append((net._ddp_params_and_buffers_to_ignore, [n for n, t in tensors if getattr(t, "_ddp_ignored", False)]))
    assert marked[0] == marked[1] == (["0.bias", "1.running_mean"], ["0.bias", "1.running_mean"])


def _ignored_by_one_name(rank: int, world_size: int) -> list[list[bool]]:
    """DDP reduces a tied weight ignored under its first name (its second admits it, later in the
    order) and a root parameter ignored by its plain name (DDP matches it as '.scale'): per step,
    whether both wrappers' states are bit-equal, a small bucket cap making the order count."""
    equal = []
    for name, ignore in (("tied_lm", ["embed.weight"]), ("scaled_mlp", ["scale"])):
        ddp_net, our_net = models.build(name), models.build(name)
        for net in (ddp_net, our_net):
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ignore)
        ddp = DistributedDataParallel(ddp_net, bucket_cap_mb=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = OverlapDDP(our_net, bucket_cap_mb=0.01)
        assert [str(w.message).count("it would skip '.scale'") for w in caught] == ([1] if name == "scaled_mlp" else [])
        equal.append(models.train_side_by_side(name, rank, 3, ddp, ours))
    return equal


def test_a_parameter_ignored_by_one_of_its_names_is_reduced_as_ddp_reduces_it():
    assert run_ranks(3, _ignored_by_one_name) == [[[True] * 3] * 2] * 3


def test_the_reduced_parameters_are_ddps_in_its_order_whatever_names_are_ignored(one_rank):
    class Aliased(nn.Module):
        """A root parameter, a weight tied between two Linears and one between a Linear and a sparse
        Embedding (each module with a sparse flag of its own), a frozen weight, a module under two names."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.a, self.b, self.shared = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
            self.b.weight = self.a.weight
            self.c = self.shared
            self.head = nn.Linear(4, 10, bias=False)
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.emb.weight = self.head.weight
            self.frozen = nn.Linear(2, 2)
            self.frozen.weight.requires_grad_(False)

    for ignore in (["a.weight"], ["b.weight"], ["a.weight", "b.weight"], ["w"], [".w"], ["shared.weight"],
                   ["c.weight"], ["a.bias"], ["head.weight"], ["emb.weight"], ["frozen.weight"]):
        reduced = []
        for wrapper in (DistributedDataParallel, OverlapDDP):
            torch.manual_seed(0)
            net = Aliased()
            wrapper._set_params_and_buffers_to_ignore_for_model(net, ignore)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the root parameter's warning, tested above
                wrapped = wrapper(net)
            if wrapper is DistributedDataParallel:
                params, sparse = wrapped._build_params_for_reducer()
            else:
                params, sparse = wrapped._reducer.params, wrapped._reducer.sparse_gradient
                names = dict(zip(map(id, params), wrapped._reducer.names, strict=True))
            first = {id(p): n for n, p in net.named_parameters()}  # each parameter by its first name
            reduced.append(([first[id(p)] for p in params], [bool(s) for s in sparse]))
        assert reduced[0] == reduced[1], ignore
        # Ours is named by the alias it was admitted under, which messages show.
        tied = {"a.weight": ("a.weight", "b.weight"), "head.weight": ("head.weight", "emb.weight")}
        for first_name, (name, other) in tied.items():
            if first_name in reduced[1][0]:
                assert names[id(net.get_parameter(first_name))] == (other if first_name in ignore else name), ignore


def _late_static_graph(rank: int, world_size: int, switch_ours: bool, find_unused: bool = False) -> list[bool] | str:
    """DDP and OverlapDDP each switched to a static graph after construction, as older scripts do
    (with find_unused_parameters, both keep the buckets sized at construction)."""
    ddp = DistributedDataParallel(models.build("checkpointed"), bucket_cap_mb=0.001, find_unused_parameters=find_unused)
    ours = OverlapDDP(models.build("checkpointed"), bucket_cap_mb=0.001, find_unused_parameters=find_unused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn that find_unused_parameters is not needed
        ddp._set_static_graph()
        if switch_ours:
            ours._set_static_graph()
    try:
        equal = models.train_side_by_side("checkpointed", rank, 4, ddp, ours)
        with pytest.warns(UserWarning, match="no need to set it again"):
            ours._set_static_graph()  # a second call only warns, as in DDP
    except RuntimeError as error:
        return str(error)
    return equal


@pytest.mark.parametrize("find_unused", (False, True))
def test_set_static_graph_after_construction_is_bit_equal_to_ddp(find_unused):
    assert run_ranks(3, _late_static_graph, True, find_unused) == [[True] * 4] * 3
    # Without the switch the never-used layer stops training: the switch is what makes it work.
    assert all("Parameters which did not receive grad" in r for r in run_ranks(3, _late_static_graph, False))


def test_set_static_graph_after_a_backward_or_a_loaded_layout_is_refused(one_rank):
    model = OverlapDDP(models.build("mlp"))
    inputs, target = models.batch("mlp", 0, 0)
    for _ in range(2):  # the second forward rebuilds the buckets
        models.loss_of(model(inputs), target).backward()
    with pytest.raises(RuntimeError, match="only be turned on before the first backward"):
        model._set_static_graph()
    resumed = OverlapDDP(models.build("mlp"))
    resumed.load_bucket_state(model.bucket_state())
    with pytest.raises(RuntimeError, match="before load_bucket_state"):
        resumed._set_static_graph()


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: dict


def test_one_walk_finds_and_maps_tensors_in_dataclasses_named_tuples_and_dicts():
    pair = collections.namedtuple("pair", "a b")
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    tree = [pair(a, {"k": _Output(b, {"c": c})}), "text", 3]
    assert [t is x for t, x in zip(tensors_in(tree), (a, b, c), strict=False)] == [True, True, True]
    doubled = map_tensors(tree, lambda t: t * 2)
    assert isinstance(doubled[0], pair) and isinstance(doubled[0].b["k"], _Output)
    assert [t.item() for t in tensors_in(doubled)] == [2.0, 0.0, 4.0] and doubled[1:] == ["text", 3]
    assert map_tensors(tree, lambda t: t) is tree  # nothing changed: nothing rebuilt


class _DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.linear(x), {})


def test_static_graph_first_iteration_is_reduced_for_a_dataclass_output(one_rank):
    # The end-of-backward trigger must reach the tensors inside a dataclass, or iteration 1 is never reduced.
    model = OverlapDDP(_DataclassNet(), static_graph=True)
    for step in range(2):
        model(torch.ones(3, 4)).logits.sum().backward()
        assert model._reducer.reductions == step + 1
