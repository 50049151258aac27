"""The sync flag set too late is reported: DDP decides at the forward whether its backward reduces,
so a flag changed between a forward and its backward is silently ignored there; here it warns once
per wrapper, saying what happened to the gradients. Correct loops do not warn."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overlapddp import OverlapDDP
from overlapddp.sync_checks import SyncFlagCheck


def _model() -> OverlapDDP:
    torch.manual_seed(0)
    return OverlapDDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))


def _x() -> torch.Tensor:
    return torch.ones(3, 4)


def _messages(loop) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop()
    return [str(w.message) for w in caught
            if issubclass(w.category, UserWarning) and "OverlapDDP (rank" in str(w.message)]


def test_flag_set_true_after_the_forward_warns_that_nothing_was_reduced(one_rank):
    model = _model()

    def loop():
        for _ in range(2):  # warned once per wrapper
            _late_flag(model)  # set to True after the forward: too late, the forward decided

    messages = _messages(loop)
    assert len(messages) == 1
    assert "were NOT reduced" in messages[0] and "require_backward_grad_sync" in messages[0]
    assert "before the forward" in messages[0]
    other = _model()  # another wrapper warns again
    assert len(_messages(lambda: _late_flag(other))) == 1


def _late_flag(model: OverlapDDP) -> None:
    model.require_backward_grad_sync = False
    out = model(_x())
    model.require_backward_grad_sync = True
    out.sum().backward()


def test_no_sync_holding_the_backward_but_not_its_forward_warns_that_it_was_reduced(one_rank):
    model = _model()

    def loop():
        out = model(_x())
        with model.no_sync():
            out.sum().backward()

    messages = _messages(loop)
    assert len(messages) == 1
    assert "ARE being reduced" in messages[0] and "no_sync()" in messages[0]


def test_zero_grad_discarding_unreduced_no_sync_gradients_warns(one_rank):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop():
        with model.no_sync():
            model(_x()).sum().backward()
        optimizer.zero_grad()  # the no_sync micro-batch is lost
        model(_x()).sum().backward()

    messages = _messages(loop)
    assert len(messages) == 1
    assert "clears gradients accumulated under no_sync()" in messages[0]


def test_a_second_backward_of_one_forward_warns_that_it_was_not_reduced(one_rank):
    model = _model()

    def loop():
        out = model(_x())
        out.sum().backward(retain_graph=True)
        out.pow(2).sum().backward()

    messages = _messages(loop)
    assert len(messages) == 1 and "second backward of one forward" in messages[0]


@pytest.mark.parametrize("how", ["no_sync", "assign"])
def test_correct_accumulation_loops_do_not_warn(one_rank, how):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop():
        for _ in range(2):
            for micro in range(3):
                last = micro == 2
                if how == "assign":  # nanoGPT: set before the forward
                    model.require_backward_grad_sync = last
                    model(_x()).sum().backward()
                elif last:
                    model(_x()).sum().backward()
                else:
                    with model.no_sync():
                        model(_x()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            model(_x())

    assert _messages(loop) == []


def test_a_new_wrapper_and_a_new_flag_check_require_backward_grad_sync_as_ddp_does(one_rank):
    """DDP starts with the flag True. A Reducer built without a wrapper's flags makes its own
    SyncFlagCheck, so the check's default must be DDP's too, not only the wrapper's assignment."""
    reference = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    assert _model().require_backward_grad_sync is reference.require_backward_grad_sync is True
    assert SyncFlagCheck().requested is True


def test_a_backward_without_any_forward_is_not_blamed_on_the_sync_flag(one_rank):
    """The flag was never False, so the warning must not say that a forward ran with it False."""
    model = _model()
    messages = _messages(lambda: model.module(_x()).sum().backward())  # the wrapper's forward never ran
    assert len(messages) == 1 and "were NOT reduced" in messages[0]
    assert "require_backward_grad_sync=False" not in messages[0]
