"""The delayed all-reduce (``delay_all_reduce_named_params`` + ``param_to_hook_all_reduce``), fenced.

At world size 2 every averaging order gives the same bits (a two-term sum commutes, and dividing by 2
is exact), so OverlapDDP with the delay must be bit-equal to stock DDP *without* it, every step, with
Adam's ``step()`` right after ``backward()``. Stock DDP *with* the delay never waits for the delayed
work; the same comparison shows its race. A planted bug that skips our wait (with one rank's launch
late, so the collective is surely in flight) must fail the comparison every step. At world size 3 a
true division by 3 and a multiply by 1/3 round differently, so there the reference is stock DDP with the
same delay, given time to finish its unwaited all-reduce.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.delayed_reduction import FENCE_KEY, DelayedReduction
from tests.support.multiprocess import run_ranks

STEPS = 3
LATE_LAUNCH_S = 0.2
SETTLE_S = 1.0  # far longer than a 4 MiB all-reduce between two local ranks takes


class Net(nn.Module):
    """A small input layer, then a 4 MiB layer (the delayed one), then a small head. In backward the
    delayed gradient is ready just before the input layer's, whose weight is the hook parameter. The
    input layer is left alone by the wrapper (as by DDP), so no bucket's collective follows the delayed
    one: stock DDP's end of backward, which waits for its buckets, then does not wait for it by chance."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 1024)
        self.big = nn.Linear(1024, 1024, bias=False)
        self.head = nn.Sequential(nn.Linear(1024, 32), nn.ReLU(), nn.Linear(32, 4))
        OverlapDDP._set_params_and_buffers_to_ignore_for_model(self, ["embed.weight", "embed.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.big(self.embed(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 16, generator=g) * (1 + rank), torch.randn(8, 4, generator=g)


def _delayed(net: Net, hook_on_itself: bool = False) -> dict:
    hook = net.big.weight if hook_on_itself else net.embed.weight
    return {"delay_all_reduce_named_params": [("big.weight", net.big.weight)], "param_to_hook_all_reduce": hook}


def _differences(a: nn.Module, b: nn.Module) -> list[str]:
    found = [f"{n}.grad" for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=False)
             if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad))]
    return found + [n for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=False) if not torch.equal(x, y)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, accumulate: int) -> None:
    for micro in range(accumulate):
        x, y = _batch(rank, step * accumulate + micro)
        if micro < accumulate - 1:
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
        else:
            nn.functional.mse_loss(model(x), y).backward()


def _against_ddp_without_delay(
    rank: int, make, accumulate: int = 1, settle_s: float = 0.0, make_reference=None
) -> list[list[str]]:
    """Per step: what differs from DDP without the delay (or ``make_reference()``), after backward and
    after Adam's step (``settle_s``: a pause between backward and step, the workaround for stock DDP's race)."""
    reference = DistributedDataParallel(Net()) if make_reference is None else make_reference()
    candidate = make()
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (reference, candidate)]
    per_step = []
    for step in range(STEPS):
        _train(reference, optimizers[0], rank, step, accumulate)
        _train(candidate, optimizers[1], rank, step, accumulate)
        time.sleep(settle_s)
        for opt in optimizers:
            opt.step()  # right after backward: nothing waits in between
        per_step.append(_differences(reference, candidate))
        for opt in optimizers:
            opt.zero_grad()
    return per_step


@contextmanager
def _unwaited_and_late(rank: int) -> Iterator[None]:
    """Planted bug: the delayed all-reduce's value is taken without waiting, while rank 1 starts it late."""
    launch, finish = DelayedReduction.launch, DelayedReduction.finish
    skipped = []

    def late_launch(self, fence):
        if rank == 1:
            time.sleep(LATE_LAUNCH_S)
        launch(self, fence)

    def finish_without_waiting(self, fence):
        if not self.launched:
            self.launch(fence)
        skipped.append(fence._in_flight.pop(FENCE_KEY))
        self._launched = False
        self._storage.copy_out(self._storage.buffer, [True] * len(self.params), as_view=False)

    DelayedReduction.launch, DelayedReduction.finish = late_launch, finish_without_waiting
    try:
        yield
    finally:
        for future in skipped:
            future.wait()
        DelayedReduction.launch, DelayedReduction.finish = launch, finish


def _fence_edges(rank: int) -> list[str]:
    """The delayed all-reduce's edges in the fence log, per iteration, and any broken rule."""
    net = Net()
    model = OverlapDDP(net, **_delayed(net))
    log = model.record_fences()
    for step in range(2):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
    edges = [f"{e.iteration}:{e.edge}" for e in log.edges if e.bucket == FENCE_KEY]
    return edges + log.violations()


def _errors(rank: int) -> dict[str, str]:
    facts = {}
    net = Net()
    for name, kwargs in {
        "wrong name": {"delay_all_reduce_named_params": [("head.0.weight", net.big.weight)],
                       "param_to_hook_all_reduce": net.embed.weight},
        "only one": {"delay_all_reduce_named_params": [("big.weight", net.big.weight)]},
        "everything": {"delay_all_reduce_named_params": list(net.named_parameters()),
                       "param_to_hook_all_reduce": net.embed.weight},
    }.items():
        try:
            OverlapDDP(net, **kwargs)
            facts[name] = "accepted"
        except (ValueError, TypeError, NotImplementedError) as error:
            facts[name] = f"{type(error).__name__}: {error}"
    try:
        OverlapDDP(net, **_delayed(net)).join()
        facts["join"] = "accepted"
    except ValueError as error:
        facts["join"] = str(error)
    # The hook parameter's gradient comes before the delayed one's: an error, and the next iteration runs.
    model = OverlapDDP(net, delay_all_reduce_named_params=[("big.weight", net.big.weight)],
                       param_to_hook_all_reduce=net.head[2].weight)
    x, y = _batch(rank, 0)
    try:
        nn.functional.mse_loss(model(x), y).backward()
        facts["late"] = "accepted"
    except RuntimeError as error:
        facts["late"] = str(error)
    model.zero_grad()
    model.load_state_dict(model.state_dict())
    return facts


def _all(rank: int, world_size: int) -> dict[str, object]:
    def ours(hook_on_itself: bool = False):
        net = Net()
        return OverlapDDP(net, **_delayed(net, hook_on_itself))

    def stock(hook_on_itself: bool = False):
        net = Net()
        return DistributedDataParallel(net, **_delayed(net, hook_on_itself))

    results: dict[str, object] = {
        "ours": _against_ddp_without_delay(rank, ours),
        "ours_no_sync": _against_ddp_without_delay(rank, ours, accumulate=2),
        "ours_hook_on_itself": _against_ddp_without_delay(rank, functools.partial(ours, True)),
        "stock": _against_ddp_without_delay(rank, stock),
        "stock_after_a_pause": _against_ddp_without_delay(rank, stock, settle_s=SETTLE_S),
        "stock_hook_on_itself_after_a_pause": _against_ddp_without_delay(
            rank, functools.partial(stock, True), settle_s=SETTLE_S
        ),
        "fence": _fence_edges(rank),
        "errors": _errors(rank),
    }
    with _unwaited_and_late(rank):
        results["planted_unwaited"] = _against_ddp_without_delay(rank, ours)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_ranks(2, _all)


def _against_stock_delay_at_three(rank: int, world_size: int) -> list[list[str]]:
    """At world size 3 the delayed buffer's true division by 3 differs from a multiply by 1/3 (what
    DDP's buckets do), so the reference is stock DDP with the same delay, given time to finish."""
    def make(wrapper):
        net = Net()
        return wrapper(net, **_delayed(net))

    return _against_ddp_without_delay(
        rank, functools.partial(make, OverlapDDP), settle_s=SETTLE_S,
        make_reference=functools.partial(make, DistributedDataParallel),
    )


def test_bit_equal_to_stock_ddp_with_the_delay_at_world_size_3():
    for rank, per_step in enumerate(run_ranks(3, _against_stock_delay_at_three)):
        assert per_step == [[]] * STEPS, f"rank {rank}: {per_step}"


def test_bit_equal_to_ddp_without_the_delay_every_step_with_the_step_right_after_backward(results):
    for rank, per_rank in enumerate(results):
        assert per_rank["ours"] == [[]] * STEPS, f"rank {rank}: {per_rank['ours']}"
        assert per_rank["ours_no_sync"] == [[]] * STEPS, f"rank {rank}: {per_rank['ours_no_sync']}"
        # The hook parameter may be a delayed one: its own gradient is accumulated before the launch.
        assert per_rank["ours_hook_on_itself"] == [[]] * STEPS, f"rank {rank}: {per_rank['ours_hook_on_itself']}"


def test_the_comparison_fails_when_the_wait_is_skipped(results):
    planted = results[0]["planted_unwaited"]  # rank 0 reads while rank 1 has not even started
    assert all("module.big.weight.grad" in step and "module.big.weight" in step for step in planted), planted


def test_the_delayed_all_reduce_is_an_edge_set_in_the_fence(results):
    for per_rank in results:
        assert per_rank["fence"] == [f"{i}:{e}" for i in range(2) for e in ("produced", "launched", "completed", "consumed")]


def test_bad_arguments_and_late_gradients_are_named(results):
    for per_rank in results:
        errors = per_rank["errors"]
        assert errors["wrong name"].startswith("ValueError") and "head.0.weight" in errors["wrong name"]
        assert errors["only one"].startswith("ValueError") and "same time" in errors["only one"]
        assert errors["everything"].startswith("NotImplementedError")
        assert "join()" in errors["join"]
        assert "big.weight" in errors["late"] and "arrived after" in errors["late"]


def test_stock_ddp_reads_the_delayed_gradients_before_they_are_reduced(results):
    """Not ours: documents the race the fence removes. Stock DDP with the delay differs from DDP
    without it when the step follows backward at once, and agrees when it waits a second."""
    for per_rank in results:
        assert per_rank["stock_after_a_pause"] == [[]] * STEPS, per_rank["stock_after_a_pause"]
    stock = results[0]["stock"] + results[1]["stock"]
    if not any(step for step in stock):
        # A race shows only when the step wins it; our own unfenced mode is the deterministic check
        # (test_the_comparison_fails_when_the_wait_is_skipped).
        pytest.xfail("stock DDP's unwaited all-reduce happened to finish before the step in this run")
        # DDP's hook runs before the hook parameter's own gradient is accumulated: when that parameter
        # is itself delayed, no pause helps.
        assert all("module.big.weight.grad" in step for step in per_rank["stock_hook_on_itself_after_a_pause"])
