"""ReducerOptions: its defaults are the wrapper's, it cannot change after construction, and the
unused-parameter search runs exactly when DDP's does. Spawn-free (the mutation run leans on it)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from overlapddp import OverlapDDP
from overlapddp.options import ReducerOptions


def test_default_options_are_the_wrappers_default_arguments():
    """Reducer() without options must behave as OverlapDDP(module) with no keyword arguments."""
    defaults = inspect.signature(OverlapDDP.__init__).parameters
    options = ReducerOptions()
    for field in dataclasses.fields(ReducerOptions):
        if field.name == "tuned_plan":
            expected = defaults["bucket_plan"].default == "tuned"
        else:
            expected = defaults[field.name].default
        assert getattr(options, field.name) is expected, field.name


def test_options_cannot_change_after_construction():
    """Several modules read one ReducerOptions; a change through one would leave the others stale."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReducerOptions().static_graph = True  # type: ignore[misc]


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("static_graph", [False, True])
def test_unused_parameters_are_searched_each_forward_only_without_a_static_graph(find_unused, static_graph):
    options = ReducerOptions(find_unused_parameters=find_unused, static_graph=static_graph)
    assert options.searches_unused_each_forward is (find_unused and not static_graph)
