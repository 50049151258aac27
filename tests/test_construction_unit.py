"""The constructor's resolution steps without a spawn: where its warnings point, the device
arguments of a GPU module (on stand-in parameters), the multi-device refusal's listing, the delayed
pairs' shape, the init-time broadcast of delayed parameters, and the plan name read by value."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from overlapddp import OverlapDDP, construction
from overlapddp.construction import (
    Arguments,
    _check_parameters,
    _delayed_parameters,
    _features,
    _reducer_options,
    _resolve_devices,
)
from overlapddp.refusals import Feature


def _on(device: str, count: int, first: int = 0) -> list[tuple[str, Any]]:
    """Stand-in parameters on ``device`` (no tensor: a CPU machine has no GPU to put one on)."""
    return [(f"p{first + i}", SimpleNamespace(device=torch.device(device), is_sparse=False)) for i in range(count)]


@pytest.mark.parametrize(("kwargs", "category", "match"), [
    ({"static_graph": True, "find_unused_parameters": True}, UserWarning, "static_graph enabled"),
    ({"broadcast_buffers": True}, FutureWarning, "`broadcast_buffers` is deprecated"),
    ({"check_reduction": True}, FutureWarning, "`check_reduction` argument is deprecated"),
])
def test_each_constructor_warning_points_at_the_users_line(one_rank: None, kwargs: dict, category: type, match: str) -> None:
    with pytest.warns(category, match=match) as caught:
        OverlapDDP(nn.Linear(2, 2), **kwargs)
    assert [w.filename for w in caught if issubclass(w.category, category)] == [__file__]


@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"static_graph": True}, {}])
def test_no_warning_without_a_reason(one_rank: None, kwargs: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OverlapDDP(nn.Linear(2, 2), **kwargs)


def test_an_ignored_root_parameter_is_warned_at_the_users_line_and_only_it(one_rank: None) -> None:
    """DDP matches a root parameter as '.bias', so listing 'bias' does not stop its reduction: said
    once, at the user's line; a submodule's name, or a frozen root parameter, needs no warning."""
    net = nn.Sequential(nn.Linear(2, 2))
    net.register_parameter("scale", nn.Parameter(torch.ones(1)))
    net.register_parameter("frozen", nn.Parameter(torch.ones(1), requires_grad=False))
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ["scale", "frozen"])
    with pytest.warns(UserWarning) as caught:
        OverlapDDP(net)
    assert [str(w.message).split(":")[0] for w in caught] == ["The parameters to ignore name scale, parameters of the "
                                                               "wrapped module itself"]
    assert [w.filename for w in caught] == [__file__]
    nested = nn.Sequential(nn.Linear(2, 2))
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(nested, ["0.bias"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OverlapDDP(nested)


def test_a_lazy_root_parameter_ignored_by_its_plain_name_is_refused_as_uninitialized(one_rank: None) -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    net.register_parameter("w", nn.parameter.UninitializedParameter())
    OverlapDDP._set_params_and_buffers_to_ignore_for_model(net, ["w"])  # still reduced: matched as '.w'
    with pytest.raises(RuntimeError, match=r"uninitialized parameters can't be used with OverlapDDP \(w\)"):
        OverlapDDP(net)


def test_a_module_on_two_gpus_is_refused_listing_three_names_per_device() -> None:
    named = _on("cuda:0", 3) + _on("cuda:1", 4, first=3)
    listed = "cuda:0: p0, p1, p2; cuda:1: p3, p4, p5, ..."
    with pytest.raises(ValueError, match=f"its parameters are on 2 devices \\({listed}\\)"):
        _check_parameters(named, named)


@pytest.mark.parametrize(("device_ids", "output_device", "resolved"), [
    ([0], None, ([0], 0)),  # the output device defaults to the module's
    ([torch.device("cuda:0")], None, ([0], 0)),
    ([0], 1, ([0], 1)),
    ([0], torch.device("cuda:1"), ([0], 1)),
    (None, None, (None, None)),
])
def test_a_gpu_modules_device_arguments_resolve_to_indices(device_ids: Any, output_device: Any, resolved: tuple) -> None:
    assert _resolve_devices(device_ids, output_device, _on("cuda:0", 2)) == resolved


def test_a_delayed_entry_must_be_a_pair() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for entry in (("0.weight", net[0].weight, "extra"), ("0.weight",), "0.weight"):
        with pytest.raises(TypeError, match="delay_all_reduce_named_params must hold \\(name, parameter\\) pairs, got"):
            _delayed_parameters(net, [entry], net[1].weight)  # type: ignore[list-item]


@pytest.mark.parametrize("delayed", [[], [("0.weight", torch.zeros(2))]])
def test_delayed_parameters_are_broadcast_at_construction_only_when_there_are_some(
    monkeypatch: pytest.MonkeyPatch, delayed: list
) -> None:
    sent: list[tuple] = []
    monkeypatch.setattr(construction, "broadcast_coalesced", lambda tensors, src, group: sent.append((len(tensors), src, group)))
    group = object()
    construction.synchronize(SimpleNamespace(process_group=group, delayed=delayed), init_sync=False)  # type: ignore[arg-type]
    assert sent == ([(1, 0, group)] if delayed else [])


def test_the_tuned_plan_is_read_by_value() -> None:
    args = Arguments(bucket_plan="".join(["tu", "ned"]))  # a name read from a config file
    assert _reducer_options(args).tuned_plan is True
    assert Feature.TUNED_PLAN in _features(args, False, [])
    assert _reducer_options(Arguments()).tuned_plan is False


def test_the_arguments_defaults_are_the_constructors_and_ddps() -> None:
    """``Arguments()`` (what a copy is rebuilt from) defaults as OverlapDDP does, and as DDP does."""
    import dataclasses
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ours = inspect.signature(OverlapDDP.__init__).parameters
    ddp = inspect.signature(DistributedDataParallel.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(Arguments)}
    assert defaults == {name: ours[name].default for name in defaults}
    assert {n: d for n, d in defaults.items() if n in ddp} == {n: ddp[n].default for n in defaults if n in ddp}
    assert set(defaults) - set(ddp) == {"bucket_plan"}


def test_the_delayed_pair_needs_both_halves_and_a_leaf_hook_parameter_that_requires_grad() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="need to be set at the same time"):
        construction.resolve(net, Arguments(param_to_hook_all_reduce=net[1].weight))
    with pytest.raises(ValueError, match="need to be set at the same time"):
        construction.resolve(net, Arguments(delay_all_reduce_named_params=[("0.weight", net[0].weight)]))
    delayed = [("0.weight", net[0].weight)]
    for hook in ("1.weight", torch.zeros(2), net[1].weight * 2, torch.zeros(2, requires_grad=True).detach()):
        with pytest.raises(ValueError, match="param_to_hook_all_reduce must be a parameter \\(a leaf tensor\\)"):
            _delayed_parameters(net, delayed, hook)  # type: ignore[arg-type]
    assert _delayed_parameters(net, delayed, net[1].weight) == delayed


def test_a_device_mesh_must_be_one_dimensional_and_gives_its_first_dimensions_group() -> None:
    asked: list[int] = []
    group = object()
    mesh = SimpleNamespace(ndim=1, get_group=lambda mesh_dim: asked.append(mesh_dim) or group)
    assert construction._resolve_group(None, mesh) is group and asked == [0]
    for ndim in (0, 2):
        with pytest.raises(RuntimeError, match="Only 1D device mesh is supported"):
            construction._resolve_group(None, SimpleNamespace(ndim=ndim))


def test_device_ids_need_a_module_on_one_gpu() -> None:
    for named in (_on("cpu", 2), _on("cuda:0", 1) + _on("cuda:1", 1)):  # frozen ones count too
        with pytest.raises(ValueError, match="device_ids and output_device only work with single-device GPU modules"):
            _resolve_devices([0], None, named)
    with pytest.raises(ValueError, match="device_ids can only be None or contain a single element"):
        _resolve_devices([0, 1], None, _on("cuda:0", 1))
    assert _resolve_devices([], None, _on("cpu", 1)) == (None, None)  # as DDP: an empty list is None


def test_a_module_on_two_device_types_lists_three_names_of_each() -> None:
    named = _on("cuda:0", 1) + _on("cpu", 4, first=1)  # 'cuda' sorts after 'cpu', and comes first here
    with pytest.raises(ValueError, match=r"parameters are on \{'cpu': \['p1', 'p2', 'p3'\], 'cuda': \['p0'\]\}"):
        _check_parameters(named, named)


def test_the_deprecated_buffer_flag_says_when_it_is_ignored() -> None:
    with pytest.warns(FutureWarning) as caught:
        assert construction._resolve_buffer_sync(False, True) == (True, True)
    assert "It is ignored because `forward_sync_buffers` is given." in str(caught[0].message)
    with pytest.warns(FutureWarning) as caught:
        assert construction._resolve_buffer_sync(False, None) == (False, False)
    assert "ignored" not in str(caught[0].message)


def test_a_one_parameter_module_is_wrapped(one_rank: None) -> None:
    model = OverlapDDP(nn.Linear(3, 1, bias=False))
    model(torch.ones(2, 3)).sum().backward()
    assert torch.equal(model.module.weight.grad, torch.full((1, 3), 2.0))
