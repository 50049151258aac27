"""Sparse gradients (``Embedding``/``EmbeddingBag`` with ``sparse=True``) reduced as DDP reduces them.

Stock DDP is the reference: per step, every parameter, every gradient (sparse indices and values
included) and every buffer must be bit-equal, at world sizes 2 and 3, with sparse and dense
parameters mixed and rank-dependent indices that repeat within a rank and differ across ranks. A
planted bug (the sparse bucket not divided by the world size) must make the same comparison fail.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.bucket import sparse_storage as sparse_reduction
from tests.support.multiprocess import run_ranks

STEPS = 4


class Recommender(nn.Module):
    """Sparse embeddings next to dense layers (one dense layer between them in registration order)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(50, 8, sparse=True)
        self.mix = nn.Linear(16, 8)
        self.items = nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.users(users), self.items(items, offsets)], dim=1)
        return self.head(torch.relu(self.mix(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
    """Indices that repeat within a rank (3 and 7 every time) and differ across ranks and steps."""
    g = torch.Generator().manual_seed(100 * step + rank)
    users = torch.cat([torch.tensor([3, 3, 7]), torch.randint(0, 50, (5,), generator=g)])
    items = torch.cat([torch.tensor([1, 1, 5, 1]), torch.randint(0, 38, (12,), generator=g) + rank])
    offsets = torch.arange(0, 16, 2)
    target = torch.randn(8, 1, generator=g)
    return users, items, offsets, target


def _same_grad(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.is_sparse or b.is_sparse:
        return (
            a.is_sparse and b.is_sparse and a.is_coalesced() == b.is_coalesced()
            and torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values())
        )
    return torch.equal(a, b)


def _differences(reference: nn.Module, candidate: nn.Module) -> list[str]:
    found = [f"{n}.grad" for (n, p), (_, q) in zip(reference.named_parameters(), candidate.named_parameters(), strict=False)
             if not _same_grad(p.grad, q.grad)]
    found += [n for (n, x), (_, y) in zip(reference.state_dict().items(), candidate.state_dict().items(), strict=False)
              if not torch.equal(x, y)]
    return found


@contextmanager
def _undivided() -> Iterator[None]:
    """Planted bug: the sparse bucket is reduced without the division by the world size."""
    original = sparse_reduction.SparseBucketStorage.copy_in

    def copy_in(self, grads, multiply_by, divide_by=None, alias_divide_by=None):
        return original(self, grads, multiply_by, None, None)

    sparse_reduction.SparseBucketStorage.copy_in = copy_in
    try:
        yield
    finally:
        sparse_reduction.SparseBucketStorage.copy_in = original


SCENARIOS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "allreduce_hook": {"hook": default_hooks.allreduce_hook},
    "no_sync": {"accumulate": 2},
    "static_graph": {"static_graph": True},
    "planted_bug_undivided": {"fault": _undivided},
}


def _scenario(rank: int, name: str) -> list[list[str]]:
    options = dict(SCENARIOS[name])
    hook, accumulate, fault = options.pop("hook", None), options.pop("accumulate", 1), options.pop("fault", None)
    reference = DistributedDataParallel(Recommender(), **options)
    with fault() if fault is not None else _nothing():
        candidate = OverlapDDP(Recommender(), **options)
        if hook is not None:
            reference.register_comm_hook(dist.group.WORLD, hook)
            candidate.register_comm_hook(dist.group.WORLD, hook)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, candidate)]
        per_step = []
        for step in range(STEPS):
            for model in (reference, candidate):
                for micro in range(accumulate):
                    users, items, offsets, target = _batch(rank, step * accumulate + micro)
                    context = model.no_sync() if micro < accumulate - 1 else _nothing()
                    with context:
                        nn.functional.mse_loss(model(users, items, offsets), target).backward()
            differences = _differences(reference, candidate)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            per_step.append(differences + _differences(reference, candidate))
    return per_step


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _hooks_on_sparse_buckets(rank: int) -> dict[str, str]:
    """What a stock hook does on a sparse bucket: fp16_compress_hook fails in DDP (no sparse Half
    add); it must fail here too, with the bucket named. PowerSGD hangs in DDP; here it is refused."""
    facts = {}
    model = OverlapDDP(Recommender())
    model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    users, items, offsets, target = _batch(rank, 0)
    try:
        nn.functional.mse_loss(model(users, items, offsets), target).backward()
        facts["fp16"] = "passed"
    except RuntimeError as error:
        facts["fp16"] = str(error)
    try:
        OverlapDDP(Recommender()).register_comm_hook(
            powerSGD_hook.PowerSGDState(dist.group.WORLD), powerSGD_hook.powerSGD_hook
        )
        facts["powersgd"] = "accepted"
    except ValueError as error:
        facts["powersgd"] = str(error)
    return facts


def _all(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {name: _scenario(rank, name) for name in SCENARIOS}
    results["hooks"] = _hooks_on_sparse_buckets(rank)
    return results


@pytest.fixture(scope="module", params=[2, 3])
def results(request) -> list[dict[str, object]]:
    return run_ranks(request.param, _all)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.startswith("planted")])
def test_bit_equal_to_ddp_every_step(results, name):
    for rank, per_rank in enumerate(results):
        assert per_rank[name] == [[]] * STEPS, f"rank {rank}: differences per step {per_rank[name]}"


def test_the_comparison_fails_without_the_division(results):
    for per_rank in results:
        planted = per_rank["planted_bug_undivided"]
        assert all("module.users.weight.grad" in step and "module.items.weight.grad" in step for step in planted), planted


def test_stock_hooks_on_sparse_buckets_fail_as_in_ddp_or_are_refused(results):
    for per_rank in results:
        assert "bucket" in per_rank["hooks"]["fp16"] and "cadd_sparse" in per_rank["hooks"]["fp16"]
        assert "users.weight" in per_rank["hooks"]["powersgd"]


def test_a_sparse_parameter_is_alone_in_its_bucket():
    storage = sparse_reduction.SparseBucketStorage(0, [nn.Parameter(torch.zeros(4, 2))], "emb.weight")
    with pytest.raises(RuntimeError, match="emb.weight"):
        storage.copy_in([None], None, 2)
    with pytest.raises(RuntimeError, match="sparse gradient"):
        storage.copy_in([torch.zeros(4, 2)], None, 2)
    with pytest.raises(ValueError, match="exactly one"):
        sparse_reduction.SparseBucketStorage(0, [torch.zeros(1), torch.zeros(1)], "a")
