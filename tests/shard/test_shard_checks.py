"""What ``attach_optimizer(opt, shard=True)`` refuses, on one rank, before any collective, by name."""

from __future__ import annotations

import pytest
import torch

from overlapddp import OverlapDDP
from overlapddp.optim.takeover import PER_PARAMETER, is_per_parameter
from overlapddp.shard.checks import ShardRequest, check_shardable
from tests.support import models


class _AdamSubclass(torch.optim.Adam):
    """A subclass may change the update (e.g. a trust ratio over all parameters): refused until declared."""


class _DeclaredAdam(torch.optim.Adam):
    per_parameter_update = True


class _InheritsTheDeclaration(_DeclaredAdam):
    """The declaration is for the class that makes it: a further subclass declares its own."""


def _request(**switches: bool) -> ShardRequest:
    return ShardRequest(names={}, reduced=frozenset(), taken={}, switches=switches, rank=0, world_size=2)


def test_the_per_parameter_optimizers_and_declared_classes_are_accepted():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    for kind in (*PER_PARAMETER, _DeclaredAdam):
        check_shardable(kind([param]), _request(overlap=False))  # a switch given as False is no refusal
    assert not is_per_parameter(_InheritsTheDeclaration) and not is_per_parameter(_AdamSubclass)


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS cannot be sharded: its line search reads every parameter"),
    (lambda ps: _AdamSubclass(ps), "_AdamSubclass cannot be sharded: it subclasses Adam.*per_parameter_update = True"),
    (lambda ps: _InheritsTheDeclaration(ps), "_InheritsTheDeclaration cannot be sharded: it subclasses"),
    (lambda ps: torch.optim.SparseAdam(ps), "SparseAdam cannot be sharded: it needs an update of each"),
])
def test_optimizers_that_may_read_other_parameters_are_refused_by_name(one_rank, make, match):
    model = OverlapDDP(models.build("mlp"))
    with pytest.raises(ValueError, match=match):
        model.attach_optimizer(make(model.parameters()), shard=True)


@pytest.mark.parametrize("switches, match", [
    ({"overlap": True}, "shard=True cannot be combined with overlap: overlap=True updates each bucket"),
    ({"max_grad_norm": 1.0}, r"cannot be combined with max_grad_norm: .*call torch.nn.utils.clip_grad_norm_"),
    ({"allow_unsynced": True}, "cannot be combined with allow_unsynced"),
])
def test_switches_that_cannot_work_are_refused_by_name(one_rank, switches, match):
    model = OverlapDDP(models.build("mlp"))
    with pytest.raises(ValueError, match=match):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard=True, **switches)


def test_a_parameter_in_two_sharded_optimizers_is_refused_naming_both(one_rank):
    model = OverlapDDP(models.build("mlp"))
    model.attach_optimizer(torch.optim.Muon([model.module[0].weight]), shard=True)
    with pytest.raises(ValueError, match=r"AdamW holds parameters \(0\.weight\) that a sharded Muon attached before"):
        model.attach_optimizer(torch.optim.AdamW(model.parameters()), shard=True)


def test_join_and_new_groups_and_closures_are_refused_by_name(one_rank):
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, shard=True)
    with pytest.raises(ValueError, match="join.. cannot be used with a sharded optimizer"):
        model.join()
    with pytest.raises(RuntimeError, match=r"SGD.add_param_group\(\) after attach_optimizer\(..., shard=True\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    inputs, target = models.batch("mlp", 0, 0)
    models.loss_of(model(inputs), target).backward()
    with pytest.raises(ValueError, match=r"SGD.step\(closure\) cannot be sharded"):
        opt.step(lambda: 0.0)


def test_a_step_on_gradients_accumulated_under_no_sync_is_refused(one_rank):
    model = OverlapDDP(models.build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt, shard=True)
    inputs, target = models.batch("mlp", 0, 0)
    with model.no_sync():
        models.loss_of(model(inputs), target).backward()
    with pytest.raises(RuntimeError, match="accumulated under no_sync.* on rank 0 that were never reduced"):
        opt.step()
