"""Distributed checkpoints (DCP) see OverlapDDP as they see DDP: the same keys, both ways.

DCP's state-dict helpers drop DDP's ``module.`` prefix; they drop OverlapDDP's too
(``torch_compat.let_dcp_unwrap``), so a ``dcp.save`` from one loads into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import models
from tests.support.multiprocess import run_ranks

MODEL = "cnn_bn"  # parameters and buffers


@dataclass
class Seen:
    model_keys: tuple[list[str], list[str]]  # get_model_state_dict: DDP's, OverlapDDP's
    optim_keys: tuple[list[str], list[str]]  # get_state_dict: the optimizer state's parameter keys
    set_model_equal: bool  # set_model_state_dict(OverlapDDP, DDP's dict) gives DDP's values
    loaded_equal: dict[str, bool]  # dcp.save from one, dcp.load + set_state_dict into either


def _trained(wrapper_type: type, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    wrapper = wrapper_type(models.build(MODEL))
    optimizer = torch.optim.Adam(wrapper.parameters(), lr=1e-2)
    inputs, target = models.batch(MODEL, rank, 0)
    models.loss_of(wrapper(inputs), target).backward()
    optimizer.step()
    return wrapper, optimizer


def _scrambled(wrapper_type: type) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A wrapper whose values differ from every trained one: loading must overwrite them all."""
    wrapper = wrapper_type(models.build(MODEL))
    with torch.no_grad():
        for tensor in wrapper.state_dict().values():
            tensor.add_(1)
    return wrapper, torch.optim.Adam(wrapper.parameters(), lr=1e-2)


def _same(a: dict, b: dict) -> bool:
    """Equal keys and, leaf by leaf (nested optimizer state too), equal values."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not (isinstance(y, dict) and _same(x, y)):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _loaded(target: tuple[torch.nn.Module, torch.optim.Optimizer], directory: str) -> tuple[dict, dict]:
    """``target``'s state after ``dcp.load`` of ``directory`` and ``set_state_dict``."""
    model_sd, optim_sd = get_state_dict(*target)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(*target, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return get_state_dict(*target)


def _moves_both_ways(source: tuple[torch.nn.Module, torch.optim.Optimizer], directory: str) -> bool:
    """Saved from ``source``, loaded into a DDP and into an OverlapDDP: the same state, and the
    source's parameters and optimizer state. (Buffers differ by rank, so DCP keeps one rank's.)"""
    model_sd, optim_sd = get_state_dict(*source)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    into_ddp = _loaded(_scrambled(DistributedDataParallel), directory)
    into_ours = _loaded(_scrambled(OverlapDDP), directory)
    parameters = {name: model_sd[name] for name, _ in source[0].module.named_parameters()}
    return (
        _same(into_ddp[0], into_ours[0]) and _same(into_ddp[1], into_ours[1])
        and _same({name: into_ours[0][name] for name in parameters}, parameters) and _same(into_ours[1], optim_sd)
    )


def _checks(rank: int, world_size: int, directory: str) -> Seen:
    ddp, ddp_optim = _trained(DistributedDataParallel, rank)
    ours, our_optim = _trained(OverlapDDP, rank)
    model_keys = (list(get_model_state_dict(ddp)), list(get_model_state_dict(ours)))
    optim_keys = tuple(list(get_state_dict(m, o)[1]["state"]) for m, o in ((ddp, ddp_optim), (ours, our_optim)))
    fresh, _ = _scrambled(OverlapDDP)
    set_model_state_dict(fresh, get_model_state_dict(ddp))
    set_model_equal = _same(fresh.module.state_dict(), ddp.module.state_dict())
    loaded = {
        "saved from DDP": _moves_both_ways((ddp, ddp_optim), f"{directory}/from_ddp"),
        "saved from OverlapDDP": _moves_both_ways((ours, our_optim), f"{directory}/from_overlapddp"),
    }
    return Seen(model_keys, optim_keys, set_model_equal, loaded)


def test_dcp_keys_match_ddp_and_checkpoints_move_both_ways(tmp_path):
    for rank, seen in enumerate(run_ranks(2, _checks, str(tmp_path))):
        ddp_keys, our_keys = seen.model_keys
        assert our_keys == ddp_keys and not any(k.startswith("module.") for k in our_keys), f"rank {rank}"
        assert seen.optim_keys[1] == seen.optim_keys[0], f"rank {rank}"
        assert seen.set_model_equal, f"rank {rank}"
        assert seen.loaded_equal == {k: True for k in seen.loaded_equal}, f"rank {rank}"
