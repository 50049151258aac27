"""A copied or pickled wrapper keeps every extra it was built with: the one build path (pickling.py).

The constructor and ``__setstate__`` build a wrapper's live parts with one function, so a copy of a
wrapper with the desync records, the delayed all-reduce, mixed precision, the compile splitter, the
tuned plan or a guard trains as the original does: both train side by side from the copy on, and
every parameter and buffer is compared with ``torch.equal`` after every step. A comm hook is left
behind as DDP's copy leaves it (with a warning): that copy trains as DDP's copy does. A desync after
a copy still names the rank behind (tests/test_desync.py).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any, Callable

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import run_ranks

COPIERS: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda wrapper: pickle.loads(pickle.dumps(wrapper)),
}
STEPS = 4


def _delayed(net: torch.nn.Module) -> OverlapDDP:
    middle = net[2].weight  # its own gradient starts its delayed all-reduce
    return OverlapDDP(net, bucket_cap_mb=0.001, delay_all_reduce_named_params=[("2.weight", middle)],
                      param_to_hook_all_reduce=middle)


# Each extra: how the original is built (from a fresh mlp) and the world sizes it runs at.
EXTRAS: dict[str, Callable[[torch.nn.Module], OverlapDDP]] = {
    "plain": lambda net: OverlapDDP(net, bucket_cap_mb=0.001),
    "delayed_all_reduce": _delayed,
    "mixed_precision": lambda net: OverlapDDP(net, bucket_cap_mb=0.001,
                                              mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)),
    "nonfinite_check": lambda net: _checking(OverlapDDP(net, bucket_cap_mb=0.001)),
    "static_graph": lambda net: OverlapDDP(net, bucket_cap_mb=0.001, static_graph=True),
}
# The tuned plan measures and picks layouts on its own clock: original and copy may pick different
# ones, which only world size 2 keeps bit-equal (a sum of two does not depend on the layout).
TUNED = {"tuned_plan": lambda net: OverlapDDP(net, bucket_cap_mb=0.001, bucket_plan="tuned")}


def _checking(model: OverlapDDP) -> OverlapDDP:
    model.check_nonfinite_gradients()
    return model


def _side_by_side(rank: int, original: torch.nn.Module, twin: torch.nn.Module, steps: int) -> list[bool]:
    return models.train_side_by_side("mlp", rank, steps, original, twin)


def _copies(rank: int, world_size: int, extras: list[str]) -> dict[str, Any]:
    builders = {**EXTRAS, **TUNED}
    results: dict[str, Any] = {}
    for name in extras:
        for copier_name, copier in COPIERS.items():
            original = builders[name](models.build("mlp"))
            twin = copier(original)
            steps = twin._reducer.layouts.final_iteration + 2 if name in TUNED else STEPS
            results[f"{name}-{copier_name}"] = _side_by_side(rank, original, twin, steps)
            if name == "plain":  # the desync records and the fence's note of each wait came along
                results[f"records-{copier_name}"] = twin._reducer.progress._store is not None and \
                    twin.fence._before_wait is not None
            if name == "nonfinite_check":
                results[f"check-kept-{copier_name}"] = twin._reducer.stages.check_nonfinite
    if world_size == 2:
        results.update(_hook_left_behind_as_ddp(rank), **_guard_on_a_copy(rank), **_compiled_copy(rank))
    return results


def _hook_left_behind_as_ddp(rank: int) -> dict[str, Any]:
    """A hooked wrapper's copy reduces with the default all-reduce, as a hooked DDP's copy does."""
    out = {}
    for copier_name, copier in COPIERS.items():
        copies = []
        for wrapper in (DistributedDataParallel, OverlapDDP):
            model = wrapper(models.build("mlp"), bucket_cap_mb=0.001)
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                copies.append(copier(model))
            if wrapper is OverlapDDP:
                out[f"hook-warned-{copier_name}"] = any("fp16_compress_hook" in str(w.message) for w in caught)
        out[f"hook-{copier_name}"] = _side_by_side(rank, copies[0], copies[1], STEPS)
    return out


def _guard_on_a_copy(rank: int) -> dict[str, Any]:
    """A guard attached to the copy's optimizer refuses a stale step, as on the original."""
    out = {}
    for copier_name, copier in COPIERS.items():
        said = []
        for model in (original := OverlapDDP(models.build("mlp"))), copier(original):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model.attach_optimizer(opt)
            inputs, target = models.batch("mlp", rank, 0)
            models.loss_of(model(inputs), target).backward()
            opt.step()
            try:
                opt.step()
                said.append("no error")
            except RuntimeError as error:
                said.append(str(error).split(":")[0])
        out[f"guard-{copier_name}"] = said
    return out


def _compiled_copy(rank: int) -> dict[str, Any]:
    """The copy's own graph splitter cuts its compiled graphs: compiled original and compiled copy agree."""
    original = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    twin = copy.deepcopy(original)
    torch._dynamo.reset()
    compiled = [torch.compile(m) for m in (original, twin)]
    return {"compiled-deepcopy": _side_by_side(rank, compiled[0], compiled[1], 2),
            "splitter-own": twin._graph_splitter._reducer is twin._reducer}


@pytest.fixture(scope="module")
def copies_at_3() -> list[dict[str, Any]]:
    return run_ranks(3, _copies, list(EXTRAS), timeout_s=600)


@pytest.fixture(scope="module")
def copies_at_2() -> list[dict[str, Any]]:
    return run_ranks(2, _copies, list(TUNED), timeout_s=600)


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("extra", EXTRAS)
def test_a_copy_trains_bit_equal_to_its_original_at_world_size_3(copies_at_3, extra, copier):
    for rank, result in enumerate(copies_at_3):
        assert result[f"{extra}-{copier}"] == [True] * STEPS, f"rank {rank}"


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_keeps_its_desync_records_and_nonfinite_check(copies_at_3, copier):
    assert all(r[f"records-{copier}"] and r[f"check-kept-{copier}"] for r in copies_at_3)


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_of_the_tuned_plan_trains_bit_equal_through_its_tuning(copies_at_2, copier):
    for result in copies_at_2:
        assert all(result[f"tuned_plan-{copier}"]) and len(result[f"tuned_plan-{copier}"]) > STEPS


@pytest.mark.parametrize("copier", COPIERS)
def test_a_hooked_copy_trains_as_ddps_hooked_copy_and_warns(copies_at_2, copier):
    for result in copies_at_2:
        assert result[f"hook-{copier}"] == [True] * STEPS and result[f"hook-warned-{copier}"]


@pytest.mark.parametrize("copier", COPIERS)
def test_a_guard_on_a_copy_refuses_a_stale_step_as_on_the_original(copies_at_2, copier):
    for result in copies_at_2:
        original, twin = result[f"guard-{copier}"]
        assert original == twin and "stale" in original


def test_a_compiled_copy_trains_bit_equal_to_the_compiled_original(copies_at_2):
    for result in copies_at_2:
        assert result["compiled-deepcopy"] == [True, True] and result["splitter-own"]
