"""CUDA: every wait of the fence is needed and sufficient, over gloo and over NCCL.

Each scenario (tests/gpu/scenarios.py) delays, with sleep kernels, the stream whose ordering it
tests, and must be bit-equal to stock DDP; the mutation run leaves out each wait in turn and the
scenario that exposes it must then fail. One spawn runs them all per backend: two ranks on one GPU
over gloo, one rank on a world-size-1 NCCL group (where only the waits one rank can show are left out).

Skips without a GPU; the two-GPU check skips with fewer than two.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlapddp.device_streams import WAITS
from tests.gpu import scenarios
from tests.support.multiprocess import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=["gloo", "nccl"])
def results(request) -> tuple[str, list[dict[str, list[bool]]]]:
    backend = request.param
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    world_size = 2 if backend == "gloo" else 1
    return backend, run_ranks(world_size, scenarios.all_scenarios, backend, timeout_s=240)


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_scenario_is_bit_equal_to_ddp_at_every_step(results, name):
    backend, per_rank = results
    for rank, outcome in enumerate(per_rank):
        assert outcome[name] == [True] * scenarios.STEPS, f"{backend} rank {rank}: {outcome[name]}"


def test_every_wait_has_a_scenario_that_exposes_it():
    assert set(scenarios.EXPOSES) == set(WAITS)


@pytest.mark.parametrize("wait", WAITS)
def test_leaving_out_a_wait_makes_its_scenario_fail(results, wait):
    backend, per_rank = results
    if backend == "nccl" and wait not in scenarios.EXPOSED_ON_ONE_RANK:
        pytest.skip(f"one NCCL rank cannot show a missing '{wait}' wait (a one-rank sum changes nothing)")
    outcomes = [outcome[f"without {wait}"] for outcome in per_rank]
    assert any(not all(steps) for steps in outcomes), (
        f"without the '{wait}' wait on {backend}, '{scenarios.EXPOSES[wait]}' still matched DDP: {outcomes}"
    )


@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL")
def test_a_training_step_does_not_sync_the_host():
    [outcomes] = run_ranks(1, scenarios.no_host_syncs, timeout_s=120)
    assert outcomes == {"find_unused_parameters": "ok", "token weighting": "ok", "default": "ok"}


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs two GPUs and NCCL")
def test_device_ids_alone_is_enough_on_two_gpus():
    for rank, equal in enumerate(run_ranks(2, scenarios.without_set_device, timeout_s=120)):
        assert equal == [True] * scenarios.STEPS, f"rank {rank}: {equal}"
