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
    _Features,
    _reducer_options,
    _resolve_devices,
)


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
    assert _Features(args, False, []).tuned is True
    assert _reducer_options(Arguments()).tuned_plan is False
