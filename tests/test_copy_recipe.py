"""A copy's recipe and its warning, on one process (no ranks): what a new wrapper checks by
default, and where the dropped-hook warning points."""

from __future__ import annotations

import copy
import io
import pickle
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from overlapddp import OverlapDDP


def _hooked() -> OverlapDDP:
    model = OverlapDDP(nn.Linear(3, 2))
    model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    return model


def test_the_dropped_hook_warning_points_at_the_users_copy_or_load(one_rank: None) -> None:
    blob, original = pickle.dumps(_hooked()), _hooked()
    buffer = io.BytesIO()
    torch.save(original, buffer)
    for way in ("pickle", "deepcopy", "torch.load"):
        buffer.seek(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if way == "pickle":
                line = sys._getframe().f_lineno + 1
                pickle.loads(blob)
            elif way == "deepcopy":
                line = sys._getframe().f_lineno + 1
                copy.deepcopy(original)
            else:
                line = sys._getframe().f_lineno + 1
                torch.load(buffer, weights_only=False)
        (warning,) = [w for w in caught if "communication hook" in str(w.message)]
        assert (warning.filename, warning.lineno) == (__file__, line), (way, warning.filename, warning.lineno)


def test_a_new_wrapper_does_not_check_gradients_for_non_finite_values_as_ddp(one_rank: None) -> None:
    model = OverlapDDP(nn.Linear(3, 2))
    model(torch.full((1, 3), float("nan"))).sum().backward()  # DDP reduces NaN gradients as they are
    assert torch.isnan(model.module.weight.grad).all()


def test_a_wrapper_of_one_parameter_is_copied(one_rank: None) -> None:
    model = OverlapDDP(nn.Linear(3, 2, bias=False))
    twin = copy.deepcopy(model)
    assert torch.equal(twin.module.weight, model.module.weight)
