"""The sharded optimizer's DCP checkpoint on one rank (no spawn): a checkpoint of another model's
shapes is refused by name, whichever of the two is larger (spawned ranks and world-size changes:
test_sharded_optimizer.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapddp import OverlapDDP
from overlapddp.shard.checkpoint import load_sharded, save_sharded


def _sharded_after_a_step(width: int, inputs: float = 1.0):
    model = OverlapDDP(nn.Sequential(nn.Linear(width, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sharded = model.attach_optimizer(opt, shard=True)
    model(torch.full((3, width), inputs)).sum().backward()
    opt.step()  # momentum buffers exist
    return sharded


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (3, 2)], ids=["smaller-saved", "larger-saved"])
def test_a_checkpoint_of_other_shapes_is_refused_naming_entry_parameter_and_sizes(one_rank, tmp_path, saved, loaded):
    save_sharded(_sharded_after_a_step(saved), tmp_path)
    target = _sharded_after_a_step(loaded)
    with pytest.raises(ValueError, match=rf"'momentum_buffer' of 0\.weight has \({2 * saved},\) elements; "
                                         rf"the parameter has {2 * loaded}\."):
        load_sharded(target, tmp_path)


def test_a_checkpoint_of_the_same_shapes_loads_its_values(one_rank, tmp_path):
    source = _sharded_after_a_step(2)
    save_sharded(source, tmp_path)
    target = _sharded_after_a_step(2, inputs=5.0)  # other momentum buffers, to be overwritten
    load_sharded(target, tmp_path)
    saved, got = source.local_state(), target.local_state()
    assert [(p.param, sorted(e)) for p, e in got] == [(p.param, sorted(e)) for p, e in saved]
    assert all(torch.equal(e[key], s[key]) for (_, e), (_, s) in zip(got, saved, strict=True) for key in e)


class _WithEmptyParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(0, 4))
        self.linear = nn.Linear(4, 2)
        self.columns = nn.Parameter(torch.zeros(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.rows.sum() + self.columns.sum()


def _adam_after_two_steps(inputs: float):
    model = OverlapDDP(_WithEmptyParameters(), bucket_cap_mb=1e-9)  # DDP's rebuild: every parameter alone
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sharded = model.attach_optimizer(opt, shard=True)
    for _ in range(2):
        model(torch.full((3, 4), inputs)).sum().backward()
        opt.step()
    return sharded, opt


def test_empty_pieces_of_parameters_of_0_elements_are_saved_and_loaded(one_rank, tmp_path):
    """Their (empty) state is saved and loaded like any other's, in the parameter's shape."""
    source, source_opt = _adam_after_two_steps(1.0)
    save_sharded(source, tmp_path)
    target, target_opt = _adam_after_two_steps(5.0)
    load_sharded(target, tmp_path)
    saved, got = source_opt.state_dict()["state"], target_opt.state_dict()["state"]
    assert saved[0]["exp_avg"].shape == (0, 4) and saved[1]["exp_avg_sq"].shape == (4, 0)  # rows, columns
    assert got.keys() == saved.keys() == {0, 1, 2, 3}
    assert all(torch.equal(got[i][key], saved[i][key]) for i in saved for key in saved[i])
