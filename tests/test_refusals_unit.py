"""The one table of refused feature pairs (refusals.py), and every place that switches a feature on
asking it: the constructor, register_comm_hook, count_tokens, join() and attach_optimizer."""

from __future__ import annotations

import re
import string

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from overlapddp import OverlapDDP
from overlapddp.refusals import REFUSALS, Feature, refuse_pairs

KNOWN = {"rank": 0, "hook": "my_hook", "sparse_names": "embed.weight"}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


def test_each_row_is_one_pair_named_once_with_a_message_the_callers_can_fill() -> None:
    pairs = [refusal.pair for refusal in REFUSALS]
    assert len(pairs) == len(set(pairs)), "a pair is refused in one row only"
    for refusal in REFUSALS:
        assert 1 <= len(refusal.pair) <= 2 and all(isinstance(f, Feature) for f in refusal.pair)
        fields = {name for _, name, _, _ in string.Formatter().parse(refusal.message) if name}
        assert fields <= set(KNOWN), refusal.message
        assert issubclass(refusal.error, (ValueError, RuntimeError))


def test_adding_a_feature_checks_only_the_pairs_it_is_in_and_the_first_row_wins() -> None:
    refuse_pairs({Feature.GRADIENT_AS_BUCKET_VIEW, Feature.TUNED_PLAN}, Feature.COUNT_TOKENS, **KNOWN)
    with pytest.raises(ValueError, match=r"^count_tokens cannot be combined with mixed_precision \(rank 0\)"):
        refuse_pairs({Feature.MIXED_PRECISION, Feature.COMM_HOOK}, Feature.COUNT_TOKENS, **KNOWN)
    with pytest.raises(RuntimeError, match="^count_tokens cannot be combined with the communication hook my_hook:"):
        refuse_pairs({Feature.COUNT_TOKENS}, Feature.COMM_HOOK, **KNOWN)
    with pytest.raises(RuntimeError, match=r"^register_comm_hook or register_builtin_comm_hook can only be called once\.$"):
        refuse_pairs({Feature.COMM_HOOK}, Feature.COMM_HOOK, **KNOWN)
    refuse_pairs(set(), Feature.COMM_HOOK, **KNOWN)  # a first hook
    refuse_pairs({Feature.COMM_HOOK}, None, **KNOWN)  # the constructor never registers one


def test_at_construction_every_pair_among_the_features_counts() -> None:
    refuse_pairs({Feature.TUNED_PLAN, Feature.MIXED_PRECISION}, **KNOWN)  # no refused pair among them
    with pytest.raises(ValueError, match=re.escape("but embed.weight produce sparse gradients")):
        refuse_pairs({Feature.TUNED_PLAN, Feature.SPARSE_GRADIENTS, Feature.MIXED_PRECISION}, **KNOWN)


def test_the_wrapper_refuses_a_hook_after_count_tokens_and_count_tokens_after_a_hook(one_rank: None) -> None:
    counted = OverlapDDP(_mlp())
    counted.count_tokens(3)
    counted.count_tokens(2)  # again: the same mode
    with pytest.raises(RuntimeError, match="count_tokens cannot be combined with the communication hook fp16_compress_hook"):
        counted.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert counted._reducer.reduction.comm_hook is None
    hooked = OverlapDDP(_mlp())
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="count_tokens cannot be combined with the communication hook allreduce_hook"):
        hooked.count_tokens(3)
    with pytest.raises(RuntimeError, match="can only be called once"):
        hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert hooked._reducer.reduction.comm_hook == (None, default_hooks.allreduce_hook)
    assert hooked._reducer.reduction.tokens is None


def test_the_features_in_force_are_read_from_their_owners(one_rank: None) -> None:
    model = OverlapDDP(_mlp(), gradient_as_bucket_view=True)
    assert model._features() == {Feature.GRADIENT_AS_BUCKET_VIEW}
    model.count_tokens(1)
    assert model._features() == {Feature.GRADIENT_AS_BUCKET_VIEW, Feature.COUNT_TOKENS}
    overlapped = OverlapDDP(_mlp())
    overlapped.attach_optimizer(torch.optim.SGD(overlapped.parameters(), lr=0.1), overlap=True)
    assert overlapped._features() == {Feature.OVERLAPPED_OPTIMIZER}


def test_only_a_one_feature_row_refuses_a_feature_already_in_force() -> None:
    refuse_pairs({Feature.SHARDED_OPTIMIZER}, Feature.SHARDED_OPTIMIZER, **KNOWN)  # Muon and AdamW, each sharded
    refuse_pairs({Feature.OVERLAPPED_OPTIMIZER, Feature.COMM_HOOK}, Feature.OVERLAPPED_OPTIMIZER, **KNOWN)
    with pytest.raises(RuntimeError, match="can only be called once"):
        refuse_pairs({Feature.COMM_HOOK, Feature.SHARDED_OPTIMIZER}, Feature.COMM_HOOK, **KNOWN)


def test_join_and_count_tokens_are_refused_in_either_order(one_rank: None) -> None:
    counted = OverlapDDP(_mlp())
    counted.count_tokens(3)
    with pytest.raises(ValueError, match=r"join\(\) cannot be used with count_tokens \(rank 0\)"):
        counted.join()
    joined = OverlapDDP(_mlp())
    with joined.join():
        with pytest.raises(ValueError, match=r"join\(\) cannot be used with count_tokens \(rank 0\)"):
            joined.count_tokens(3)
