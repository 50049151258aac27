"""Copies and pickles of OverlapDDP train on as copies of stock DDP do (pickling.py).

Both wrappers train two steps, are copied (``copy.deepcopy``, ``pickle`` or ``torch.save`` +
``torch.load``), and the copies train three more steps on rank-dependent data, compared with
``torch.equal`` (every parameter, buffer and reduced gradient) and bucket layout after each step.
Small caps give many buckets, so that at world size 3 a layout the copy should not have changes bits.

One exception, measured: DDP's copy of a ``static_graph`` model never reduces again (it carries
``_static_graph_delay_allreduce_enqueued=True`` while its new reducer waits for that delayed
all-reduce), so there the reference is what DDP's ``__setstate__`` means to build: a DDP constructed
over the copied module. ``test_ddp_copy_of_a_static_graph_leaves_ranks_apart`` keeps that fact checked.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import run_ranks
from tests.support.parity import ddp_layout, first_difference, first_grad_difference


def _torch_save_load(wrapper: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIERS = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda wrapper: pickle.loads(pickle.dumps(wrapper)),
    "torch.save": _torch_save_load,
}


@dataclass(frozen=True)
class Case:
    model: str
    copier: str
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()
    hook: bool = False  # fp16_compress_hook on both originals: DDP's copy leaves it behind

    @property
    def name(self) -> str:
        return f"{self.model}-{self.copier}" + "".join(f"-{k}" for k, _ in self.ddp_kwargs) + ("-hook" if self.hook else "")


CASES = [
    Case("transformer", "deepcopy"),
    Case("cnn_bn", "torch.save", (("static_graph", True), ("gradient_as_bucket_view", True))),
    Case("mlp", "pickle", hook=True),
]
STEPS_BEFORE, STEPS_AFTER = 2, 3


@dataclass
class Seen:
    """One rank's view of one case: per compared step, the first difference (None when equal)."""

    differences: list[str | None]
    layouts_equal: list[bool]
    warnings: list[str]
    ddp_copy_in_sync: bool | None = None  # static graph: DDP's own copy kept ranks' gradients equal


def _train_step(pairs: list[tuple[torch.nn.Module, torch.optim.Optimizer]], model: str, rank: int, step: int) -> None:
    for wrapper, optimizer in pairs:
        inputs, target = models.batch(model, rank, step)
        models.loss_of(wrapper(inputs), target).backward()
        optimizer.step()


def _compare(reference: torch.nn.Module, candidate: OverlapDDP, seen: Seen, step: int) -> None:
    difference = first_grad_difference(reference, candidate) or first_difference(reference, candidate)
    seen.differences.append(None if difference is None else f"step {step}: {difference}")
    seen.layouts_equal.append(ddp_layout(reference) == candidate.bucket_indices())


def _run_case(rank: int, case: Case) -> Seen:
    kwargs = dict(case.ddp_kwargs, bucket_cap_mb=0.001)
    reference = DistributedDataParallel(models.build(case.model), **kwargs)
    candidate = OverlapDDP(models.build(case.model), **kwargs)
    if case.hook:
        for wrapper in (reference, candidate):
            wrapper.register_comm_hook(None, default_hooks.fp16_compress_hook)
    pairs = [(w, models.optimizer("sgd", w.parameters())) for w in (reference, candidate)]
    seen = Seen([], [], [])
    for step in range(STEPS_BEFORE):
        _train_step(pairs, case.model, rank, step)
        _compare(reference, candidate, seen, step)
        for _, optimizer in pairs:
            optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference_copy = COPIERS[case.copier](reference)
        caught.clear()
        candidate_copy = COPIERS[case.copier](candidate)
    seen.warnings = [str(w.message) for w in caught]
    if kwargs.get("static_graph"):
        seen.ddp_copy_in_sync = _ddp_copy_keeps_ranks_in_sync(reference_copy, case.model, rank)
        reference_copy = DistributedDataParallel(COPIERS[case.copier](reference.module), **kwargs)
    copies = [(w, models.optimizer("adam", w.parameters())) for w in (reference_copy, candidate_copy)]
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        _train_step(copies, case.model, rank, step)
        _compare(reference_copy, candidate_copy, seen, step)
        for _, optimizer in copies:
            optimizer.zero_grad()
    # The originals are untouched by being copied: one more step, still equal.
    _train_step(pairs, case.model, rank, STEPS_BEFORE)
    _compare(reference, candidate, seen, STEPS_BEFORE)
    return seen


def _ddp_copy_keeps_ranks_in_sync(ddp_copy: DistributedDataParallel, model: str, rank: int) -> bool:
    """One backward of DDP's copy on rank-dependent data: are the gradients equal on every rank?"""
    inputs, target = models.batch(model, rank, 0)
    models.loss_of(ddp_copy(inputs), target).backward()
    grad = next(p for p in ddp_copy.parameters() if p.grad is not None).grad
    first = grad.clone()
    dist.broadcast(first, src=0)
    agreed = torch.tensor([int(torch.equal(first, grad))])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def _run_cases(rank: int, world_size: int) -> list[Seen]:
    return [_run_case(rank, case) for case in CASES]


@functools.cache
def _seen(world_size: int) -> list[list[Seen]]:
    return run_ranks(world_size, _run_cases)


@pytest.mark.parametrize("world_size", (2, 3))
def test_copies_train_on_bit_equal_to_copies_of_ddp(world_size):
    per_rank = _seen(world_size)
    for index, case in enumerate(CASES):
        for rank, seen in enumerate(r[index] for r in per_rank):
            assert seen.differences == [None] * len(seen.differences), f"{case.name}, rank {rank}"
            assert all(seen.layouts_equal), f"{case.name}, rank {rank}: bucket layouts differ from DDP's"
            dropped = [w for w in seen.warnings if "communication hook" in w]
            assert len(dropped) == int(case.hook), f"{case.name}, rank {rank}: {seen.warnings}"


def test_ddp_copy_of_a_static_graph_leaves_ranks_apart():
    # Why the static-graph case above compares with a new DDP, not DDP's copy (docs/compatibility.md).
    static = [i for i, case in enumerate(CASES) if dict(case.ddp_kwargs).get("static_graph")]
    assert static and all(rank[i].ddp_copy_in_sync is False for rank in _seen(2) for i in static)


@contextmanager
def _one_rank_group() -> Iterator[None]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_unpickling_without_a_default_group_says_to_initialize_one():
    with _one_rank_group():
        pickled = pickle.dumps(OverlapDDP(models.build("mlp")))
    with pytest.raises(RuntimeError, match="no default process group.*init_process_group"):
        pickle.loads(pickled)


def test_a_wrapper_on_another_group_cannot_be_copied_as_with_ddp():
    with _one_rank_group():
        group = dist.new_group([0])
        with pytest.raises(RuntimeError, match="default process group"):
            copy.deepcopy(OverlapDDP(models.build("mlp"), process_group=group))


def test_a_loaded_copy_binds_to_the_default_group_and_reduces_with_its_own_hooks():
    with _one_rank_group():
        model = OverlapDDP(models.build("mlp"))
        twin = _torch_save_load(model)
        assert twin.process_group == dist.group.WORLD
        inputs, target = models.batch("mlp", 0, 0)
        models.loss_of(twin(inputs), target).backward()
        # The copy's hooks reduce the copy's gradients; the original saw no backward.
        assert twin._reducer.reductions == 1 and model._reducer.reductions == 0
        assert all(p.grad is None for p in model.parameters())


def test_a_copy_of_a_wrapper_has_its_own_graph_splitter():
    with _one_rank_group():
        model = OverlapDDP(models.build("mlp"))
        twin = copy.deepcopy(model)
        assert twin._graph_splitter is not model._graph_splitter
        assert twin._graph_splitter._reducer is twin._reducer


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_keeps_require_backward_grad_sync_as_ddp_copies_it(copier):
    # A copy taken inside a gradient-accumulation loop (the flag assigned False, as nanoGPT does)
    # must not start reducing: DDP's copy keeps the flag, and so does ours.
    with _one_rank_group():
        copies = []
        for wrapper in (DistributedDataParallel, OverlapDDP):
            model = wrapper(models.build("mlp"))
            model.require_backward_grad_sync = False
            copies.append(COPIERS[copier](model))
        assert [c.require_backward_grad_sync for c in copies] == [False, False]
        inputs, target = models.batch("mlp", 0, 0)
        models.loss_of(copies[1](inputs), target).backward()
        assert copies[1]._reducer.reductions == 0  # the backward stayed local
