"""Who takes a reduced bucket? One protocol for every consumer, attached in one list on the reducer.

A bucket's pipeline completes its collective (the fence's edge 3), then hands the same
:class:`ReducedBucket` to each attached consumer in order, then marks the bucket consumed (edge 4).
The first consumer is always :class:`GradientCopy`, the copy into ``param.grad`` that DDP makes;
an overlapped optimizer is attached after it and updates the parameters whose gradients it wrote.
At the end of a synchronized backward every consumer hears ``all_taken`` once; when an iteration is
dropped (a failed reduction), ``abandoned``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from overlapddp.bucket.reduction import BucketReduction
from overlapddp.bucket.sparse_storage import SparseBucketStorage
from overlapddp.bucket.storage import BucketStorage


@dataclass(frozen=True)
class ReducedBucket:
    """One bucket whose collective has completed, as every consumer of it sees it."""

    index: int
    storage: BucketStorage | SparseBucketStorage  # its buffer and the parameters, in bucket order
    value: object  # what the collective's (or the comm hook's) future resolved to
    write: Sequence[bool]  # per member: some rank produced its gradient (a globally unused one is left alone)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.storage.params


class BucketConsumer(Protocol):
    """Whoever takes reduced buckets; every method runs on the end-of-backward callback's thread."""

    name: str  # what the fence's log calls this consumer

    def take(self, bucket: ReducedBucket) -> None:
        """Bucket by bucket, in index order, as each completes (later buckets may still reduce)."""

    def all_taken(self) -> None:
        """Once per synchronized backward, after the last bucket (and the delayed all-reduce)."""

    def abandoned(self) -> None:
        """The iteration was dropped: forget what was kept for the rest of it."""


class GradientCopy:
    """DDP's consumer: the hook's result checked and copied into each written member's ``.grad``
    (with ``gradient_as_bucket_view``, the gradients are the bucket's views)."""

    name = "copy to param.grad"

    def __init__(self, reduction: BucketReduction, as_view: bool) -> None:
        self._reduction = reduction
        self._as_view = as_view

    def take(self, bucket: ReducedBucket) -> None:
        storage = bucket.storage
        result = hook_result(bucket.value, self._reduction.hook_name, bucket.index, storage.buffer)
        storage.copy_out(result, bucket.write, as_view=self._as_view)

    def all_taken(self) -> None:
        """Nothing waits for the last bucket: every copy was made as its bucket completed."""

    def abandoned(self) -> None:
        """Nothing is kept across buckets."""


def hook_result(value: object, hook_name: str, bucket_index: int, expected: torch.Tensor) -> torch.Tensor:
    """The one tensor a hook's future must resolve to, checked against the bucket's size.

    DDP accepts a tensor or a one-element list; anything else, or a tensor of another size, is an
    error that names the hook and the bucket instead of a failed stride check later.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Communication hook {hook_name} returned a future whose value is {type(value).__name__} "
            f"for bucket {bucket_index}; expected one tensor of {expected.numel()} elements."
        )
    if value.numel() != expected.numel() or not value.is_floating_point() and not value.is_complex():
        raise ValueError(
            f"Communication hook {hook_name} returned a {tuple(value.shape)} {value.dtype} tensor for "
            f"bucket {bucket_index}; expected {expected.numel()} elements of a floating dtype "
            f"(the bucket holds {expected.dtype})."
        )
    return value
