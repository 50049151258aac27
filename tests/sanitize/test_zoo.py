"""Every racy loop of the zoo is found, with the right kind, tensor, lines and rank; no clean loop is.

All loops run in one spawn per world size (2 and 3), each inside its own ``detect()``; every rank
must report the race itself (each rank's own accesses are what it checks).
"""

from __future__ import annotations

from typing import Any

import pytest

from overlapddp.sanitize import DROPPED, NEVER, READ, WRITE
from tests.sanitize import zoo
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

# loop: (kind, the tensor as named, (marker of the launch line), (marker of the access line) or None)
EXPECTED: dict[str, tuple[str, str, tuple[str, str], tuple[str, str] | None]] = {
    "manual_step": (READ, "0.weight.grad (float32[12, 6])", ("manual_step", "launch"), ("manual_step", "access")),
    "manual_zero_grad": (WRITE, "2.bias.grad (float32[6])", ("manual_zero_grad", "launch"),
                         ("manual_zero_grad", "access")),
    "manual_clip": (READ, "2.weight.grad (float32[6, 12])", ("manual_clip", "launch"), ("manual_clip", "access")),
    "late_hook": (WRITE, "float32[162]", ("late_hook", "launch"), ("late_hook", "access")),
    "ddp_delayed": (READ, "module.0.weight.grad (float32[12, 6])", ("ddp_delayed", "launch"),
                    ("ddp_delayed", "access")),
    "gather": (READ, "0.weight (float32[12, 6])", ("gather", "launch"), ("forward", "access")),
    "dropped": (DROPPED, "float32[", ("dropped", "launch"), None),
}
OPS = {"late_hook": "all_reduce", "gather": "all_gather_into_tensor", "dropped": "all_gather_into_tensor"}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def zoo_run(request: Any) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    return world_size, run_ranks(world_size, zoo.run_zoo, [*zoo.RACY, *zoo.CLEAN], timeout_s=SLOW_TIMEOUT_S)


def _matches(finding: dict[str, Any], loop: str, world_size: int, rank: int) -> bool:
    kind, tensor, launch, access = EXPECTED[loop]
    collective = f"{OPS.get(loop, 'all_reduce')} over {world_size} ranks"
    return (finding["kind"] == kind and finding["tensor"].startswith(tensor) and finding["rank"] == rank
            and finding["collective"] == collective
            and finding["launched_at"].endswith("sanitize/" + zoo.marked_line(*launch))
            and (access is None or finding["accessed_at"].endswith("sanitize/" + zoo.marked_line(*access))))


@pytest.mark.parametrize("loop", list(zoo.RACY))
def test_every_racy_loop_is_found_on_every_rank_named_and_located(zoo_run, loop):
    world_size, ranks = zoo_run
    for rank, results in enumerate(ranks):
        findings, _ = results[loop]
        assert any(_matches(f, loop, world_size, rank) for f in findings), \
            f"rank {rank} of {world_size}: {EXPECTED[loop]} not among {findings}"


@pytest.mark.parametrize("loop", list(zoo.CLEAN))
def test_no_clean_loop_has_a_finding(zoo_run, loop):
    _, ranks = zoo_run
    assert [results[loop][0] for results in ranks] == [[] for _ in ranks]


def test_a_collective_never_waited_for_is_never_completed_at_the_next_launch_on_its_memory(zoo_run):
    # DDP's delayed all-reduce: each backward launches it again on the same buffer, unwaited.
    world_size, ranks = zoo_run
    for results in ranks:
        never = [f for f in results["ddp_delayed"][0] if f["kind"] == NEVER]
        assert any(f["launched_at"] == f["accessed_at"] == never[0]["launched_at"] for f in never)
        assert never[0]["launched_at"].endswith(zoo.marked_line("ddp_delayed", "launch"))
