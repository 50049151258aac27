"""Who takes a reduced bucket? One protocol for every consumer, attached in one list on the reducer.

A bucket's pipeline completes its collective (the fence's edge 3), then hands the same
:class:`ReducedBucket` to each attached consumer in order, then marks the bucket consumed (edge 4).
The first consumer is always DDP's copy into ``param.grad`` (``GradientCopy``, bucket/reduction.py);
an overlapped optimizer is attached after it and updates the parameters whose gradients it wrote.
At the end of a synchronized backward every consumer hears ``all_taken`` once; when an iteration is
dropped (a failed reduction), ``abandoned``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

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
