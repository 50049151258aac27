"""The Bucket a communication hook sees, on its own: its gradients are views of its buffer, shaped
as their parameters, and only a literal ``issues_one_collective = True`` lifts the chaining.
Spawn-free (the mutation run leans on it)."""

from __future__ import annotations

import torch

from overlapddp.bucket.comm_hook import Bucket, is_unchained


def test_gradients_are_views_of_the_buffer_shaped_as_their_parameters():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    buffer = torch.arange(10.0)
    bucket = Bucket(0, buffer, [0, 6], [6, 4], params, is_last=True)
    first, second = bucket.gradients()
    assert torch.equal(first, torch.arange(6.0).view(2, 3)) and torch.equal(second, torch.arange(6.0, 10.0))
    buffer.add_(1)  # a view, not a copy: a hook writing the buffer writes the gradients
    assert torch.equal(second, torch.arange(7.0, 11.0))
    assert bucket.parameters() == params and bucket.is_last() and bucket.index() == 0


def test_only_a_literal_true_declares_a_hook_unchained():
    def custom(state, bucket):
        return bucket.buffer()

    for not_a_declaration in (1, 2, "yes"):
        custom.issues_one_collective = not_a_declaration
        assert not is_unchained(custom), not_a_declaration
    custom.issues_one_collective = True
    assert is_unchained(custom)
