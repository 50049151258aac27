"""``check_shardable`` alone (no spawn): what it accepts, and how many names each refusal lists."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from overlapddp.shard.checks import ShardRequest, check_shardable


def _request(params: list[torch.Tensor], **changes: object) -> ShardRequest:
    names = [f"p{i}" for i in range(len(params))]
    fields: dict[str, object] = dict(params=params, names=names, module_params={id(p): n for p, n in zip(params, names, strict=True)},
                                     options={}, comm_hook=None, backend="gloo")
    return ShardRequest(**{**fields, **changes})  # type: ignore[arg-type]


def _params(count: int) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.zeros(3)) for _ in range(count)]


def test_a_plain_sgd_over_every_reduced_parameter_is_accepted_when_no_option_is_given():
    params = _params(2)
    check_shardable(torch.optim.SGD(params, lr=0.1), _request(params))  # options={}: none set


def test_an_option_set_to_false_is_no_refusal_and_one_set_true_is():
    params = _params(1)
    check_shardable(torch.optim.SGD(params, lr=0.1), _request(params, options={"overlap": False}))
    with pytest.raises(ValueError, match="shard=True cannot be combined with overlap"):
        check_shardable(torch.optim.SGD(params, lr=0.1), _request(params, options={"overlap": True}))


def test_foreign_parameters_are_listed_four_at_most():
    params, foreign = _params(1), _params(5)
    with pytest.raises(ValueError) as refused:
        check_shardable(torch.optim.SGD(params + foreign, lr=0.1), _request(params))
    assert str(refused.value).count("group 0: shape (3,)") == 4


def test_ignored_parameters_are_listed_four_at_most():
    params = _params(6)
    request = _request(params[:1], module_params={id(p): f"p{i}" for i, p in enumerate(params)})  # p1-p5 not reduced
    with pytest.raises(ValueError, match=r"wrapper ignores \(p1, p2, p3, p4\);"):
        check_shardable(torch.optim.SGD(params, lr=0.1), request)


@pytest.mark.parametrize("count, listed", [(4, "p1, p2, p3, p4 receive"), (5, "p1, p2, p3, p4, ... receive")])
def test_missing_parameters_are_listed_four_at_most_with_an_ellipsis_beyond(count, listed):
    params = _params(count + 1)
    with pytest.raises(ValueError, match=listed.replace(".", r"\.")):
        check_shardable(torch.optim.SGD(params[:1], lr=0.1), _request(params))


def test_parameters_not_dense_in_memory_are_listed_four_at_most():
    params = [torch.nn.Parameter(torch.zeros(4, 4).t()[::2]) for _ in range(5)]
    with pytest.raises(ValueError, match=r"Parameters p0, p1, p2, p3 are not dense"):
        check_shardable(torch.optim.SGD(params, lr=0.1), _request(params))


def test_parameters_of_0_elements_are_accepted_whatever_their_strides():
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((0,), (0, 4), (4, 0), (3, 0, 2))]
    assert params[2].stride() == (1, 1)  # not a dense permutation, but nothing to cut
    check_shardable(torch.optim.SGD(params, lr=0.1), _request(params))


def test_a_request_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _request(_params(1)).backend = "nccl"  # type: ignore[misc]
