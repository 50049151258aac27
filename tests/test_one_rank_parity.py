"""Bit-equality with stock DDP in the test process, on a one-rank group: no spawn.

One rank hides nothing about division or summation order (tests/test_parity.py runs 2, 3 and 4
ranks for those), but everything else a bucket goes through is the same code: the layout and its
rebuild, the copies in and out, views, unused parameters, the static graph, accumulation, hooks.
Here a slip there fails within a second, which makes these the first tests the mutation run tries.
"""

from __future__ import annotations

import pytest

from tests.support.parity import Scenario, missing_for, run_scenario

TINY = 0.001  # ~1 KiB caps: a bucket per parameter or two
FIND_UNUSED = (("find_unused_parameters", True),)
BUCKET_VIEW = (("gradient_as_bucket_view", True),)
STATIC = (("static_graph", True),)

SCENARIOS = [
    Scenario("mlp", "sgd", None),
    Scenario("mlp", "sgd", TINY),
    Scenario("rank_ordered", "sgd", TINY),
    Scenario("cnn_bn", "sgd", TINY, accumulate=3),
    Scenario("transformer", "adam", TINY, accumulate=2, skip_sync_by="assign"),
    Scenario("branchy", "sgd", None, ddp_kwargs=FIND_UNUSED),
    Scenario("branchy", "sgd", TINY, ddp_kwargs=FIND_UNUSED + BUCKET_VIEW, set_to_none=False, accumulate=2),
    Scenario("branchy_fixed", "sgd", TINY, ddp_kwargs=FIND_UNUSED + (("skip_all_reduce_unused_params", True),)),
    Scenario("mlp", "sgd", None, ddp_kwargs=BUCKET_VIEW),
    Scenario("cnn_bn", "sgd", TINY, ddp_kwargs=BUCKET_VIEW, set_to_none=False),
    Scenario("checkpointed", "sgd", TINY, ddp_kwargs=STATIC),
    Scenario("mlp", "sgd", TINY, ddp_kwargs=(("batched_grad_copy", True),)),
    Scenario("transformer", "sgd", None, ddp_kwargs=(("bucket_cap_mb_list", (0.001, 0.004)),)),
    Scenario("cnn_frozen", "sgd", TINY),
    Scenario("tied_lm", "adam", TINY),
    Scenario("transformer", "sgd", TINY, hook="fp16_compress"),
    Scenario("cnn_bn", "sgd", None, hook="noop"),
    Scenario("mlp", "adam", None, hook="fp16_wrapper(allreduce)"),
]

# Bugs one rank can see, each shown to fail the comparison (the others need several ranks).
FAULT_SCENARIOS = [
    Scenario("mlp", "sgd", TINY, fault="swap_in_bucket"),
    Scenario("branchy", "sgd", None, ddp_kwargs=FIND_UNUSED, fault="write_unused_grads"),
    Scenario("mlp", "adam", None, hook="fp16_wrapper(allreduce)", fault="ignore_set_buffer"),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_one_rank_equals_ddp_after_every_step(one_rank: None, scenario: Scenario) -> None:
    if missing_for(scenario):
        pytest.skip(f"this torch has no {', '.join(missing_for(scenario))}")
    outcome = run_scenario(0, scenario)
    assert len(outcome.equal) == scenario.steps
    assert all(outcome.equal), f"first difference at {outcome.first_difference}"
    assert all(outcome.layouts_equal), f"DDP's layouts per step: {outcome.ddp_layouts}"


@pytest.mark.parametrize("scenario", FAULT_SCENARIOS, ids=lambda s: s.name)
def test_the_one_rank_comparison_catches_an_injected_fault(one_rank: None, scenario: Scenario) -> None:
    outcome = run_scenario(0, scenario)
    assert not (all(outcome.equal) and all(outcome.layouts_equal)), f"{scenario.fault} went unnoticed"
