"""Race forcing: delayed communication must not change a single bit; without the fence it must.

Two ranks see deliberately different data, so a gradient read before its all-reduce completes is
the local gradient, not the average, and the next weights differ. One rank's communication is
delayed so that the collective is still in flight when an unfenced reader would look.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.testing import SynchronousReference, delay_communication, unfenced
from tests.support import models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

REPETITIONS = 20
STEPS = 3
DELAY_S = 0.03


def _train(wrapper: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, sync: SynchronousReference | None = None) -> None:
    inputs, target = models.batch("mlp", rank, step)
    models.loss_of(wrapper(inputs), target).backward()
    if sync is not None:
        sync.reduce_gradients()
    opt.step()
    opt.zero_grad(set_to_none=False)  # reuse the same gradient tensors every step


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=False))


def _one_repetition(rank: int, mode: str, stage: str, cap: float | None) -> dict[str, object]:
    """Three steps of DDP, the synchronous reference and OverlapDDP with rank 1 delayed."""
    ddp = DistributedDataParallel(models.build("mlp"), bucket_cap_mb=cap)
    reference = SynchronousReference(models.build("mlp"))
    ours = OverlapDDP(models.build("mlp"), bucket_cap_mb=cap)
    log = ours.record_fences()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, reference, ours)]
    matches: list[bool] = []
    with delay_communication(ours, rank=1, seconds=DELAY_S, stage=stage):
        if mode == "unfenced":
            unsafe = unfenced(ours)
            unsafe.__enter__()
        try:
            for step in range(STEPS):
                _train(ddp, optimizers[0], rank, step)
                _train(reference, optimizers[1], rank, step, sync=reference)
                _train(ours, optimizers[2], rank, step)
                matches.append(_equal(ddp, reference) and _equal(reference.module, ours.module))
        finally:
            if mode == "unfenced":
                unsafe.__exit__(None, None, None)
    return {"matches": matches, "violations": log.violations(), "edges": len(log.edges)}


def _repetitions(rank: int, world_size: int, mode: str, stage: str, cap: float | None) -> list[dict[str, object]]:
    return [_one_repetition(rank, mode, stage, cap) for _ in range(REPETITIONS)]


@functools.cache
def outcomes(mode: str, stage: str, cap: float | None) -> list[dict[str, object]]:
    """Rank 0's view of every repetition (ranks agree on parameters; rank 0 is never delayed)."""
    return run_ranks(2, _repetitions, mode, stage, cap, timeout_s=SLOW_TIMEOUT_S)[0]


CASES = [("launch", None), ("launch", 0.001), ("completion", 0.001)]


@pytest.mark.parametrize("stage, cap", CASES)
def test_fenced_training_matches_ddp_and_synchronous_reference_every_step_every_repetition(stage, cap):
    results = outcomes("fenced", stage, cap)
    passed = sum(all(r["matches"]) and len(r["matches"]) == STEPS for r in results)
    assert passed == REPETITIONS, f"{passed}/{REPETITIONS} repetitions matched"


@pytest.mark.parametrize("stage, cap", CASES)
def test_fence_log_shows_every_edge_in_order(stage, cap):
    for r in outcomes("fenced", stage, cap):
        assert r["violations"] == []
        assert r["edges"] >= 4 * STEPS  # produced, launched, completed, consumed per bucket per step


@pytest.mark.parametrize("stage, cap", [("launch", None), ("launch", 0.001)])
def test_race_test_fails_without_the_fence(stage, cap):
    """The same test on the test-only unfenced mode fails in at least 19 of 20 repetitions."""
    results = outcomes("unfenced", stage, cap)
    failed = sum(not all(r["matches"]) for r in results)
    assert failed >= REPETITIONS - 1, f"only {failed}/{REPETITIONS} unfenced repetitions failed"


def test_unfenced_run_shows_reads_before_completion_and_buffer_reuse_in_the_log():
    violations = [v for r in outcomes("unfenced", "launch", None) for v in r["violations"]]
    assert any("'consumed'" in v and "launched" in v for v in violations)
    assert any("buffer reused while the collective" in v for v in violations)


def _recording_allreduce(records: list[tuple[int, torch.Tensor]]):
    """DDP's default hook, recording what each bucket's collective is handed when it starts."""

    def hook(state, bucket):
        records.append((bucket.index(), bucket.buffer().clone()))
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def _handed_to_collectives(rank: int, world_size: int) -> dict[str, str | None]:
    """Per cap, the first difference between what DDP's and OverlapDDP's collectives were handed
    (every bucket, every step; the buffer is read when the collective starts), or None."""
    differences: dict[str, str | None] = {}
    for cap in (None, 0.001):
        records: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for wrapper_class in (DistributedDataParallel, OverlapDDP):
            seen = records[wrapper_class.__name__] = []
            wrapper = wrapper_class(models.build("mlp"), bucket_cap_mb=cap)
            wrapper.register_comm_hook(None, _recording_allreduce(seen))
            opt = torch.optim.SGD(wrapper.parameters(), lr=0.1, momentum=0.9)
            try:
                for step in range(STEPS):
                    _train(wrapper, opt, rank, step)
            except RuntimeError as error:  # what was handed over before the error still counts
                seen.append((-1, torch.tensor([float(len(str(error)))])))
        ddp, ours = records["DistributedDataParallel"], records["OverlapDDP"]
        differences[f"cap={cap}"] = next(
            (f"collective {n}: DDP's bucket {a[0]}, OverlapDDP's bucket {b[0]}, other values"
             for n, (a, b) in enumerate(zip(ddp, ours, strict=False)) if a[0] != b[0] or not torch.equal(a[1], b[1])),
            None if len(ddp) == len(ours) else f"{len(ddp)} collectives vs {len(ours)}",
        )
    return differences


def test_each_collective_is_handed_the_complete_bucket_as_in_ddp():
    """A bucket launched before its last gradient was copied in hands its collective other values
    than DDP's: compared where the collective starts, not only after the step."""
    for rank, differences in enumerate(run_ranks(3, _handed_to_collectives)):
        assert differences == {"cap=None": None, "cap=0.001": None}, f"rank {rank}: {differences}"


def test_unfenced_inside_a_delay_keeps_the_delay(one_rank):
    from overlapddp.testing import DelayedFence, UnfencedFence

    model = OverlapDDP(models.build("mlp"))
    with delay_communication(model, rank=0, seconds=0.01), unfenced(model):
        fence = model._reducer.fence
        assert isinstance(fence, DelayedFence) and isinstance(fence.inner, UnfencedFence)
    assert type(model._reducer.fence).__name__ == "Fence"
