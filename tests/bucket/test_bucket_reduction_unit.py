"""BucketReduction without spawning ranks: what each backward divides by, what copy-in is told, which
collective each bucket starts, and what DDP's copy into ``param.grad`` accepts of a hook's result, on a
one-rank gloo group.

The multi-rank tests (test_parity, test_ready_order, test_comm_hooks, test_token_weighting) show the
results bit-equal to DDP; these pin the arithmetic handed to the storage with divisors other than
one, which a one- or two-rank run cannot tell apart (1/1 is 1*1, and 2g/(2n) is g/n).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import overlapddp.bucket.reduction as bucket_reduction
from overlapddp.bucket.comm_hook import Bucket
from overlapddp.bucket.consumer import ReducedBucket
from overlapddp.bucket.reduction import BucketReduction, GradientCopy


class _Storage:
    """A bucket's storage that records what copy-in is asked to do."""

    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
        for param in self.params:
            param.grad = torch.full_like(param, 2.0)
        self.copies: list[tuple[Any, ...]] = []
        self.buffer = torch.zeros(5)

    def copy_in(self, grads: list[torch.Tensor | None], multiply_by: float | None, divide_by: float | None,
                alias_divide_by: float | None = None) -> None:
        assert all(g is p.grad for g, p in zip(grads, self.params, strict=True))
        self.copies.append((multiply_by, divide_by, alias_divide_by))


class _CountWork:
    """Join's all-reduce of the ranks still training: ``ranks`` when waited on."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.waited = ranks, 0

    def wait(self) -> bool:
        self.waited += 1
        return True

    def result(self) -> list[torch.Tensor]:
        assert self.waited, "read before wait"
        return [torch.tensor([float(self.ranks)])]


class _Tokens:
    """Token weighting's global count, as BucketReduction uses it."""

    def __init__(self, total: float) -> None:
        self.launched: list[Any] = []
        self.asked: list[int] = []
        self._total = total

    def launch(self, process_group: Any) -> None:
        self.launched.append(process_group)

    def total(self, rank: int) -> float:
        self.asked.append(rank)
        return self._total


def _copy_in(reduction: BucketReduction) -> tuple[Any, ...]:
    storage = _Storage()
    assert reduction.copy_in(storage) is storage.buffer, "the fill returns the buffer it wrote"  # type: ignore[arg-type]
    (copied,) = storage.copies
    return copied


def _joined(batched: bool, ranks: int, hook: Any = None) -> BucketReduction:
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=batched)
    if hook is not None:
        reduction.set_comm_hook(None, hook)
    reduction.set_join_count(_CountWork(ranks), divide_by_initial_world_size=False)  # type: ignore[arg-type]
    reduction.arm()
    return reduction


def test_the_default_copy_in_multiplies_by_the_reciprocal_and_divides_aliased_views(one_rank):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    reduction.arm()
    assert _copy_in(reduction) == (1.0, None, 1)  # the world size of the one-rank group
    assert _copy_in(_joined(batched=False, ranks=3)) == (1.0 / 3, None, 3)
    assert _copy_in(_joined(batched=False, ranks=4)) == (0.25, None, 4)


def test_batched_copy_divides_the_whole_buffer_instead(one_rank):
    assert _copy_in(_joined(batched=True, ranks=3)) == (None, 3, None)


def test_a_hook_gets_unscaled_gradients(one_rank):
    assert _copy_in(_joined(batched=False, ranks=3, hook=default_hooks.allreduce_hook)) == (None, None, None)
    assert _copy_in(_joined(batched=True, ranks=3, hook=default_hooks.allreduce_hook)) == (None, None, None)


def test_join_divides_by_the_ranks_still_training_once_per_count(one_rank):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    work = _CountWork(3)
    reduction.set_join_count(work, divide_by_initial_world_size=False)  # type: ignore[arg-type]
    reduction.arm()
    assert work.waited == 1 and _copy_in(reduction) == (1.0 / 3, None, 3)
    reduction.arm()  # no new count: the world size again
    assert work.waited == 1 and _copy_in(reduction) == (1.0, None, 1)
    initial = _CountWork(3)
    reduction.set_join_count(initial, divide_by_initial_world_size=True)  # type: ignore[arg-type]
    reduction.arm()
    assert initial.waited == 0 and _copy_in(reduction) == (1.0, None, 1)


@pytest.mark.parametrize("batched", [False, True])
def test_token_weighting_divides_by_the_global_count_read_at_the_first_copy(one_rank, batched):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=batched)
    tokens = _Tokens(total=5.0)
    reduction.tokens = tokens  # type: ignore[assignment]
    reduction.arm()
    assert tokens.launched == [dist.group.WORLD] and tokens.asked == []
    expected = (None, 5.0, None) if batched else (1.0 / 5.0, None, 5.0)
    assert _copy_in(reduction) == expected
    assert _copy_in(reduction) == expected  # the second bucket: the same count, not asked again
    assert tokens.asked == [0]


def test_token_weighting_keeps_one_count(one_rank):
    device = torch.device("cpu")
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    counted = reduction.enable_token_weighting(device)
    assert reduction.enable_token_weighting(device) is counted



def test_hook_names_and_which_hooks_issue_from_callbacks(one_rank):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    assert reduction.hook_name == "allreduce (default)" and not reduction.issues_from_callbacks
    reduction.comm_hook = (None, powerSGD_hook.powerSGD_hook)
    assert reduction.hook_name == "powerSGD_hook" and reduction.issues_from_callbacks
    reduction.comm_hook = (None, default_hooks.fp16_compress_hook)
    assert not reduction.issues_from_callbacks

    def mine(state: Any, bucket: Any) -> Any:
        return bucket

    reduction.comm_hook = (None, mine)
    assert reduction.issues_from_callbacks and reduction.hook_name.endswith("<locals>.mine")
    mine.issues_one_collective = True  # type: ignore[attr-defined]
    assert not reduction.issues_from_callbacks
    unnamed = SimpleNamespace(__qualname__="")
    reduction.comm_hook = (None, unnamed)
    assert reduction.hook_name == repr(unnamed)


def _bucket(index: int) -> Bucket:
    params = [torch.nn.Parameter(torch.zeros(2))]
    return Bucket(index, torch.arange(2.0) + index, [0], [2], params, is_last=False)


def test_each_bucket_starts_its_all_reduce(one_rank):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    reduced = reduction.start(_bucket(1)).wait()
    assert torch.equal(reduced[0], torch.tensor([1.0, 2.0]))  # one rank's SUM is its own buffer


def test_chained_hooks_start_after_the_previous_buckets_future(one_rank, monkeypatch):
    runs: list[tuple[int, Any]] = []

    def run_hook(hook: Any, state: Any, bucket: Bucket, after: Any) -> torch.futures.Future:
        runs.append((bucket.index(), after))
        return torch.futures.Future()

    monkeypatch.setattr(bucket_reduction, "run_hook", run_hook)
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    reduction.set_comm_hook(None, powerSGD_hook.powerSGD_hook)
    first = reduction.start(_bucket(0))
    second = reduction.start(_bucket(1))
    reduction.start(_bucket(2))
    assert [index for index, _ in runs] == [0, 1, 2]
    assert runs[1][1] is first and runs[2][1] is second
    restart = reduction.start(_bucket(0))  # the next iteration's first bucket waits for nothing
    assert runs[3][1] is None and reduction._hook_future is restart

    unchained = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    unchained.set_comm_hook(None, default_hooks.fp16_compress_hook)
    unchained.start(_bucket(0))
    unchained.start(_bucket(1))
    assert runs[4][1] is None and runs[5][1] is None


def test_waiting_for_hook_chains_waits_for_the_last_one_started(one_rank):
    reduction = BucketReduction(dist.group.WORLD, batched_grad_copy=False)
    reduction.wait_for_hook_chains()  # nothing started: returns at once
    waited: list[str] = []
    reduction._hook_future = SimpleNamespace(wait=lambda: waited.append("last"))  # type: ignore[assignment]
    reduction.wait_for_hook_chains()
    assert waited == ["last"]


# -- GradientCopy: the hook's result, checked, then copied out ------------------------------------------

EXPECTED = torch.zeros(6)


def _take(value: object, write: list[bool] | None = None, as_view: bool = False) -> list[tuple[Any, ...]]:
    """What the copy-out of bucket 3 (6 float32 elements) is asked, when the hook ``my_hook`` returned ``value``."""
    copied: list[tuple[Any, ...]] = []
    storage = SimpleNamespace(buffer=EXPECTED, copy_out=lambda result, w, as_view: copied.append((result, w, as_view)))
    copy = GradientCopy(SimpleNamespace(hook_name="my_hook"), as_view)  # type: ignore[arg-type]
    copy.take(ReducedBucket(3, storage, value, write or [True]))  # type: ignore[arg-type]
    return copied


@pytest.mark.parametrize("wrap", (lambda t: t, lambda t: [t], lambda t: (t,)), ids=("tensor", "list", "tuple"))
def test_a_hook_may_return_a_tensor_or_one_in_a_list_or_tuple(wrap: Any) -> None:
    reduced = torch.ones(6)
    ((result, write, as_view),) = _take(wrap(reduced), [True, False], as_view=True)
    assert result is reduced and write == [True, False] and as_view is True


def test_a_complex_result_of_the_right_size_is_accepted() -> None:
    reduced = torch.zeros(6, dtype=torch.complex64)
    assert _take(reduced)[0][0] is reduced


@pytest.mark.parametrize(
    ("value", "kind"),
    [([torch.ones(6), torch.ones(6)], "list"), (None, "NoneType"), ([], "list"), ("done", "str")],
)
def test_a_result_that_is_not_one_tensor_is_a_type_error_naming_hook_and_bucket(value: object, kind: str) -> None:
    with pytest.raises(TypeError) as raised:
        _take(value)
    assert str(raised.value) == (
        f"Communication hook my_hook returned a future whose value is {kind} for bucket 3; "
        "expected one tensor of 6 elements."
    )


@pytest.mark.parametrize("value", [torch.ones(5), torch.ones(2, 4), torch.ones(6, dtype=torch.int64), torch.ones(6, dtype=torch.bool)])
def test_a_tensor_of_another_size_or_an_integer_dtype_is_a_value_error(value: torch.Tensor) -> None:
    with pytest.raises(ValueError) as raised:
        _take(value)
    assert str(raised.value) == (
        f"Communication hook my_hook returned a {tuple(value.shape)} {value.dtype} tensor for bucket 3; "
        "expected 6 elements of a floating dtype (the bucket holds torch.float32)."
    )

