"""torch.compile, both ways round: bit-equal to the same form with DDP, and still overlapped.

``OverlapDDP(torch.compile(model))`` matches ``DDP(torch.compile(model))`` and
``torch.compile(OverlapDDP(model))`` matches ``torch.compile(DDP(model))`` (the two DDP forms differ
from each other from the second step on, so each needs its own reference). The compiled graphs are
cut where OverlapDDP's buckets close (compile_split.py), so buckets launch during the compiled
backward; a timed test fails when that splitting is switched off.

The ``aot_eager`` backend runs the real Dynamo and AOTAutograd path (graph capture, the compiled
backward, the post-accumulate-grad hooks firing from it) without Inductor's C++ build time; one
small test runs Inductor. Models are user-defined classes: Dynamo does not compile the forward of
torch's own containers (``nn.Sequential``) as a frame of its own, so ``torch.compile(OverlapDDP(seq))``
runs ``seq`` eagerly.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.compile_split import cut_points
from overlapddp.timeline import bucket_spans
from tests.support import models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

FORMS = {False: "OverlapDDP(compile(model))", True: "compile(OverlapDDP(model))"}
SLOW_S = 0.15
STEPS = 3  # DDP rebuilds its buckets before step 1, so steps 1 and 2 run the graphs cut at them


def compiled(wrapper: type, name: str, outer: bool, backend: str = "aot_eager", **kwargs: object) -> nn.Module:
    if outer:
        return torch.compile(wrapper(models.build(name), **kwargs), backend=backend)
    return wrapper(torch.compile(models.build(name), backend=backend), **kwargs)


def unwrapped(model: nn.Module) -> OverlapDDP:
    return getattr(model, "_orig_mod", model)


def _states(name: str, rank: int, steps: int, model: nn.Module) -> list[list[torch.Tensor]]:
    """Every parameter and buffer after each SGD-momentum step on the rank's batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = []
    for step in range(steps):
        inputs, target = models.batch(name, rank, step)
        models.loss_of(model(inputs), target).backward()
        opt.step()
        opt.zero_grad()
        states.append([t.detach().clone() for t in model.state_dict().values()])
    return states


def _parity(rank: int, world_size: int, cases: list[tuple[str, bool, dict]]) -> list[tuple[list[bool], list]]:
    """Per case: per step whether OverlapDDP equals DDP in the same form, and the cuts it compiled.

    DDP trains first, then Dynamo's caches are reset: instances of one class share compiled code,
    and OverlapDDP must trace its own frames to cut them at its own buckets.
    """
    results = []
    for name, outer, kwargs in cases:
        torch._dynamo.reset()
        reference = _states(name, rank, STEPS, compiled(DistributedDataParallel, name, outer, **kwargs))
        torch._dynamo.reset()
        ours = compiled(OverlapDDP, name, outer, **kwargs)
        candidate = _states(name, rank, STEPS, ours)
        equal = [all(map(torch.equal, a, b)) for a, b in zip(reference, candidate, strict=False)]
        results.append((equal, [g.cuts for g in unwrapped(ours)._graph_splitter._compiled]))
    return results


PARITY_CASES = [(name, outer, kwargs) for outer in (False, True)
                for name, kwargs in (("cnn_bn", {}), ("deep_mlp", {"bucket_cap_mb": 1}))]


def test_compiled_training_is_bit_equal_to_ddp_in_the_same_form_with_and_without_splits():
    for rank, results in enumerate(run_ranks(3, _parity, PARITY_CASES, timeout_s=SLOW_TIMEOUT_S)):
        for (name, outer, _), (equal, cuts) in zip(PARITY_CASES, results, strict=False):
            assert equal == [True] * STEPS, f"rank {rank}, {name} as {FORMS[outer]}: {equal}"
            if name == "deep_mlp":  # DDP's rebuilt buckets close at several layers: the graph is cut there
                assert cuts and all(c for c in cuts), f"rank {rank}, {FORMS[outer]}: cuts {cuts}"


def _options_parity(rank: int, world_size: int) -> dict[str, list[bool]]:
    """A checkpoint and a graph break inside the compiled model, with DDP's graph options."""
    results = {}
    for label, kwargs in (("default", {}), ("find_unused_parameters", {"find_unused_parameters": True}),
                          ("static_graph", {"static_graph": True})):
        torch._dynamo.reset()
        ddp = compiled(DistributedDataParallel, "tangled_mlp", False, bucket_cap_mb=1, **kwargs)
        reference = _states("tangled_mlp", rank, STEPS + 1, ddp)
        torch._dynamo.reset()
        ours = compiled(OverlapDDP, "tangled_mlp", False, bucket_cap_mb=1, **kwargs)
        candidate = _states("tangled_mlp", rank, STEPS + 1, ours)  # a static graph rebuilds a step later
        results[label] = [all(map(torch.equal, a, b)) for a, b in zip(reference, candidate, strict=False)]
        results[label + " cut"] = [any(g.cuts for g in ours._graph_splitter._compiled)]
    return results


def test_checkpoint_graph_break_and_graph_options_under_compile_match_ddp():
    for rank, results in enumerate(run_ranks(2, _options_parity, timeout_s=SLOW_TIMEOUT_S)):
        assert results == {k: [True] * len(v) for k, v in results.items()}, f"rank {rank}: {results}"


def test_cut_points_close_each_bucket_at_its_earliest_parameter_use():
    first_use = {0: 0, 1: 0, 2: 4, 3: 4, 4: 9, 5: 9, 6: 2}
    # Bucket [6, 2] closes at node 2 (its earliest use); the earliest cut (node 0) is the end of backward.
    assert cut_points(first_use, [[5, 4], [3], [6, 2], [1, 0]]) == (2, 4, 9)
    assert cut_points(first_use, [[0, 1, 2, 3, 4, 5, 6]]) == ()
    assert cut_points(first_use, [[4, 5], [7]]) == ()  # parameters outside this graph do not cut it


# -- overlap, timed ----------------------------------------------------------------------------


@torch.library.custom_op("overlapddp_tests::sleep", mutates_args=())
def _sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """A copy of ``x`` that takes ``seconds``; opaque to the compiler, so it sleeps inside compiled code."""
    time.sleep(seconds)
    return x.clone()


@_sleep.register_fake
def _(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("overlapddp_tests::slow_grad", mutates_args=())
def slow_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity whose backward sleeps SLOW_S."""
    return x.clone()


@slow_grad.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


slow_grad.register_autograd(lambda ctx, grad: _sleep(grad, SLOW_S))


class SlowStem(nn.Module):
    """Its stem's backward sleeps SLOW_S inside the compiled graph: the last part of backward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 64)
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = slow_grad(torch.relu(self.stem(x)))
        return self.head(torch.relu(self.body(x)))


def launch_fractions(model: nn.Module, ours: OverlapDDP, steps: int = 5) -> list[dict[int, float]]:
    """Per iteration after the rebuild: when each bucket launched, as a fraction of backward."""
    log = ours.record_fences()
    windows = {}
    for step in range(steps):
        inputs, target = models.batch("mlp", 0, step)
        loss = models.loss_of(model(inputs), target)
        start = time.perf_counter()
        loss.backward()
        windows[step] = (start, time.perf_counter())
    launched: dict[int, dict[int, float]] = {}
    for span in bucket_spans(log):
        if span.launched is not None and span.iteration in windows:
            start, end = windows[span.iteration]
            launched.setdefault(span.iteration, {})[span.bucket] = (span.launched - start) / (end - start)
    return [launched[it] for it in range(2, steps)]


def first_launch_fractions(model: nn.Module, ours: OverlapDDP, steps: int = 5) -> list[float]:
    """Per iteration after the rebuild: when the first bucket launched, as a fraction of backward."""
    return [min(per_bucket.values()) for per_bucket in launch_fractions(model, ours, steps)]


def _slow_stem_model(outer: bool, split: bool, backend: str = "aot_eager") -> tuple[nn.Module, OverlapDDP]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    if outer:
        model = torch.compile(OverlapDDP(SlowStem(), bucket_cap_mb=0.001), backend=backend)
    else:
        model = OverlapDDP(torch.compile(SlowStem(), backend=backend), bucket_cap_mb=0.001)
    unwrapped(model)._graph_splitter.enabled = split
    return model, unwrapped(model)


@pytest.mark.parametrize("outer", [False, True], ids=FORMS.values())
def test_every_bucket_but_the_stems_launches_in_the_first_half_of_a_compiled_backward(one_rank, outer):
    # The stem's backward sleeps SLOW_S at the end of backward; every bucket of the head and body must
    # launch before it, well before backward's halfway point (not only the first: a lost cut merges
    # a later bucket's piece into the stem's, and that bucket then launches at the end).
    model, ours = _slow_stem_model(outer, split=True)
    fractions = launch_fractions(model, ours)
    stem = {i for i, (name, _) in enumerate(SlowStem().named_parameters()) if name.startswith("stem.")}
    before_stem = [b for b, members in enumerate(ours.bucket_indices()) if not stem & set(members)]
    assert len(before_stem) >= 2, ours.bucket_indices()  # a body bucket, not only the head's
    assert max(min(f.values()) for f in fractions) < 0.5, fractions  # the first launch, every iteration
    # Each bucket's median over the iterations: one iteration slowed by a loaded machine does not
    # decide; a lost cut puts the bucket at the end of every one (0.98 and more).
    medians = {b: statistics.median(f[b] for f in fractions) for b in before_stem}
    assert all(m < 0.5 for m in medians.values()), (ours.bucket_indices(), fractions)


@pytest.mark.parametrize("outer", [False, True], ids=FORMS.values())
def test_without_splitting_the_first_bucket_launches_at_the_end_of_backward(one_rank, outer):
    # The same measurement fails when the splitting is switched off: the check above can fail.
    fractions = first_launch_fractions(*_slow_stem_model(outer, split=False))
    assert min(fractions) > 0.5, fractions


# -- compiled autograd and Inductor ---------------------------------------------------------------


def _compiled_autograd_reduces(rank: int, world_size: int) -> list[bool]:
    """Under compiled autograd every rank ends each backward with the same (reduced) gradients."""
    torch._dynamo.reset()
    model = OverlapDDP(torch.compile(models.build("deep_mlp"), backend="aot_eager"), bucket_cap_mb=0.5)
    same = []
    for step in range(3):
        inputs, target = models.batch("deep_mlp", rank, step)
        loss = models.loss_of(model(inputs), target)
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(world_size)]
        dist.all_gather(gathered, grads)
        same.append(all(torch.equal(g, gathered[0]) for g in gathered))
        model.zero_grad(set_to_none=True)
    return same


def test_compiled_autograd_still_reduces_every_backward():
    for rank, same in enumerate(run_ranks(2, _compiled_autograd_reduces, timeout_s=SLOW_TIMEOUT_S)):
        assert same == [True] * 3, f"rank {rank}: {same}"


def test_inductor_in_both_forms_splits_and_launches_early(one_rank):
    # Inductor builds C++ on the CPU: one small model, few steps.
    for outer in (False, True):
        model, ours = _slow_stem_model(outer, split=True, backend="inductor")
        fractions = first_launch_fractions(model, ours, steps=6)
        assert statistics.median(fractions) < 0.5, (FORMS[outer], fractions)
        assert all(g.cuts for g in ours._graph_splitter._compiled), FORMS[outer]


@pytest.mark.parametrize("plan", ["ddp", "tuned"])
def test_the_compiled_cuts_follow_every_bucket_layout(one_rank, plan):
    # After the rebuild and after a tuned re-plan the frames are traced again and cut at the new buckets.
    torch._dynamo.reset()
    model = OverlapDDP(torch.compile(models.build("deep_mlp"), backend="aot_eager"), bucket_cap_mb=0.5, bucket_plan=plan)
    splitter = model._graph_splitter
    for step in range(model._reducer.layouts.final_iteration + 2):
        inputs, target = models.batch("deep_mlp", 0, step)
        models.loss_of(model(inputs), target).backward()
        graphs = splitter._compiled  # before the rebuild: DDP's byte cuts (None)
        expected = [cut_points(g.first_use, model.bucket_indices()) if model._has_rebuilt_buckets else None for g in graphs]
        assert graphs and [g.cuts for g in graphs] == expected, step
    assert splitter.recompiles >= 1
