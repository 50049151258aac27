"""Bit-equality with stock DDP: every parameter and buffer, every step, world sizes 2, 3 and 4.

World size 2 hides layout and arithmetic mistakes (a sum of two numbers does not depend on order),
so 3 and 4 are the sizes that matter; the fault tests below prove these comparisons can fail.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks
from tests.support.parity import Outcome, Scenario, missing_for, outcomes_by_scenario, run_scenarios

FIND_UNUSED = (("find_unused_parameters", True),)
BUCKET_VIEW = (("gradient_as_bucket_view", True),)
STATIC = (("static_graph", True),)

SCENARIOS = [
    Scenario(model, opt, cap)
    for model in ("mlp", "cnn_bn", "transformer")
    for opt in ("sgd", "adam")
    for cap in (None, 0.001)  # DDP's default caps; ~1 KiB caps (a bucket per parameter or two)
] + [
    Scenario("resnet18", "sgd", None),
    Scenario("resnet18", "adam", 1),
    Scenario("cnn_bn", "sgd", 0.001, accumulate=3),
    Scenario("transformer", "adam", None, accumulate=2, skip_sync_by="assign"),
    # find_unused_parameters: heads chosen per rank from the data, one layer never used.
    Scenario("branchy", "sgd", None, ddp_kwargs=FIND_UNUSED),
    Scenario("branchy", "adam", 0.001, ddp_kwargs=FIND_UNUSED, accumulate=2),
    Scenario("branchy", "sgd", None, ddp_kwargs=FIND_UNUSED, set_to_none=False),
    Scenario("branchy", "sgd", 0.001, ddp_kwargs=FIND_UNUSED + BUCKET_VIEW, set_to_none=False),
    Scenario("branchy_fixed", "sgd", 0.001, ddp_kwargs=FIND_UNUSED + (("skip_all_reduce_unused_params", True),)),
    # gradient_as_bucket_view, with gradients set to None and kept (the true-division branch).
    Scenario("mlp", "sgd", None, ddp_kwargs=BUCKET_VIEW),
    Scenario("cnn_bn", "sgd", 0.001, ddp_kwargs=BUCKET_VIEW, set_to_none=False),
    Scenario("transformer", "adam", 0.001, ddp_kwargs=BUCKET_VIEW, set_to_none=False, accumulate=2),
    # static_graph: the first iteration reduced at its end, rebuild after the second; reentrant checkpoints.
    Scenario("transformer", "adam", None, ddp_kwargs=STATIC),
    Scenario("checkpointed", "sgd", 0.001, ddp_kwargs=STATIC),
    Scenario("mlp", "sgd", 0.001, ddp_kwargs=(("batched_grad_copy", True),)),
    Scenario("transformer", "sgd", None, ddp_kwargs=(("bucket_cap_mb_list", (0.001, 0.004)),)),
    Scenario("cnn_frozen", "sgd", 0.001),
    Scenario("cnn_channels_last", "adam", 0.001),
    Scenario("tied_lm", "adam", 0.001),
]

WORLD_SIZES = (2, 3, 4)


@functools.cache
def outcomes(world_size: int) -> dict[Scenario, list[Outcome]]:
    """Run every scenario the installed DDP can run once per world size (one process group)."""
    return outcomes_by_scenario(world_size, [s for s in SCENARIOS if not missing_for(s)], SLOW_TIMEOUT_S)


def _skip_unless_ddp_runs(scenario: Scenario) -> None:
    if missing_for(scenario):
        pytest.skip(f"torch {torch.__version__} here has no {', '.join(missing_for(scenario))}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_parameters_and_buffers_equal_ddp_after_every_step(world_size, scenario):
    _skip_unless_ddp_runs(scenario)
    for rank, outcome in enumerate(outcomes(world_size)[scenario]):
        assert len(outcome.equal) == scenario.steps
        assert all(outcome.equal), f"rank {rank}: first difference at {outcome.first_difference}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_bucket_layout_equals_ddp_at_every_step(world_size, scenario):
    _skip_unless_ddp_runs(scenario)
    outcome = outcomes(world_size)[scenario][0]
    assert all(outcome.layouts_equal), f"layouts per step: {outcome.ddp_layouts}"


def test_layouts_cover_one_bucket_first_then_the_rebuild():
    """The scenarios really exercise the one-bucket first step and a many-bucket rebuild."""
    _skip_unless_ddp_runs(Scenario("resnet18", "sgd", None))
    result = outcomes(3)
    assert [len(b) for b in result[Scenario("resnet18", "sgd", None)][0].ddp_layouts] == [1, 3, 3, 3, 3]
    assert [len(b) for b in result[Scenario("checkpointed", "sgd", 0.001, ddp_kwargs=STATIC)][0].ddp_layouts] == [
        1, 1, 5, 5, 5
    ]  # static graph: rebuilt after the second iteration
    assert len(result[Scenario("branchy", "adam", 0.001, ddp_kwargs=FIND_UNUSED, accumulate=2)][0].ddp_layouts[0]) > 1
    assert all(len(b) >= 10 for b in result[Scenario("transformer", "adam", 0.001)][0].ddp_layouts[1:])


FAULT_SCENARIOS = [
    Scenario("mlp", "sgd", None, fault="skip_scaling"),
    Scenario("cnn_bn", "adam", None, fault="skip_scaling"),
    Scenario("mlp", "sgd", None, fault="true_division"),
    Scenario("transformer", "sgd", 0.001, fault="true_division"),
    Scenario("mlp", "sgd", None, fault="swap_in_bucket"),
    Scenario("transformer", "sgd", None, fault="swap_in_bucket"),
    Scenario("resnet18", "sgd", None, fault="swap_in_bucket"),
    Scenario("cnn_bn", "sgd", 0.001, accumulate=3, fault="ignore_no_sync"),
    Scenario("branchy", "sgd", None, ddp_kwargs=FIND_UNUSED, fault="write_unused_grads"),
    Scenario("cnn_bn", "sgd", 0.001, ddp_kwargs=BUCKET_VIEW, set_to_none=False, fault="no_alias_division"),
    Scenario("checkpointed", "sgd", 0.001, ddp_kwargs=STATIC, fault="swap_in_bucket"),
]


@functools.cache
def fault_outcomes() -> dict[Scenario, Outcome]:
    runnable = [s for s in FAULT_SCENARIOS if not missing_for(s)]
    return dict(zip(runnable, run_ranks(3, run_scenarios, runnable, timeout_s=SLOW_TIMEOUT_S)[0], strict=False))


@pytest.mark.parametrize("scenario", FAULT_SCENARIOS, ids=lambda s: s.name)
def test_parity_check_catches_injected_fault_in_the_values(scenario):
    """Each deliberate bug makes the parameter comparison itself fail (not only the layout check)."""
    _skip_unless_ddp_runs(scenario)
    outcome = fault_outcomes()[scenario]
    assert not all(outcome.equal), f"{scenario.fault} went unnoticed by the value comparison"


def test_layout_check_catches_a_swap_inside_a_bucket():
    outcome = fault_outcomes()[Scenario("mlp", "sgd", None, fault="swap_in_bucket")]
    assert outcome.layouts_equal[0] and not any(outcome.layouts_equal[1:])
