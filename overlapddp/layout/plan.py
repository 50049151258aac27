"""Which gradients go together: a pure planning step, parameters in, an immutable plan out.

No collectives and no autograd here, so every layout rule of DDP can be unit-tested alone.
The rules reproduce DDP 2.14.1 (see ``shared/reference/ddp_semantics.md`` sections 1 and 2):

- the first iteration uses one bucket per (dtype, device) unless ``find_unused_parameters``;
- buckets fill in walk order and close when their size reaches the current cap, so a bucket
  usually ends a little above its cap;
- each (dtype, device) key has its own accumulator and its own position in the cap list;
- a rebuild walks parameters in gradient-ready order and keeps that order (no sort).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
NO_SIZE_LIMIT = 0  # the cap recorded for a sparse-gradient bucket, which holds one parameter


@dataclass(frozen=True)
class BucketCaps:
    """The byte caps a user asked for, resolved once.

    ``per_bucket`` is set only from ``bucket_cap_mb_list``; ``None`` means the two-cap scheme
    (a small first bucket, then ``bytes_cap``) that DDP uses when rebuilding.
    """

    first_bytes: int
    bytes_cap: int
    per_bucket: tuple[int, ...] | None = None

    @classmethod
    def from_user(
        cls, bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None
    ) -> BucketCaps:
        """Resolve DDP's ``bucket_cap_mb`` / ``bucket_cap_mb_list`` arguments into byte caps."""
        if bucket_cap_mb is not None:
            _check_cap("bucket_cap_mb", bucket_cap_mb)
        if bucket_cap_mb_list is not None:
            if isinstance(bucket_cap_mb_list, (str, bytes)) or len(bucket_cap_mb_list) == 0:
                raise ValueError(
                    f"bucket_cap_mb_list must be a non-empty list of sizes in MiB, got {bucket_cap_mb_list!r}."
                )
            for i, mb in enumerate(bucket_cap_mb_list):
                _check_cap(f"bucket_cap_mb_list[{i}]", mb)
            per_bucket = tuple(int(mb * MIB) for mb in bucket_cap_mb_list)
            return cls(first_bytes=per_bucket[0], bytes_cap=max(per_bucket), per_bucket=per_bucket)
        cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
        first = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
        return cls(first_bytes=first, bytes_cap=cap)

    def initial_limits(self, searches_unused_each_forward: bool) -> list[int]:
        """Caps for the first iterations: one unlimited bucket unless unused parameters are searched
        each forward (then DDP never rebuilds, so the constructor's caps are final)."""
        if self.per_bucket is not None:
            return list(self.per_bucket)
        if not searches_unused_each_forward:
            return [sys.maxsize]
        return self.rebuild_limits() if self.first_bytes < self.bytes_cap else [self.bytes_cap]

    def rebuild_limits(self) -> list[int]:
        """Caps for the one rebuild in gradient-ready order."""
        if self.per_bucket is not None:
            return list(self.per_bucket)
        return [self.first_bytes, self.bytes_cap]


def _check_cap(name: str, mb: object) -> None:
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:  # NaN is not > 0 either
        raise ValueError(f"{name} must be a positive number of MiB, got {mb!r}.")


@dataclass(frozen=True)
class BucketPlan:
    """Bucket membership in launch order; inside a bucket, the order of the flat buffer."""

    buckets: tuple[tuple[int, ...], ...]
    size_limits: tuple[int, ...]

    def locate(self) -> dict[int, tuple[int, int]]:
        """Map each parameter index to (bucket index, position inside the bucket)."""
        return {
            param: (bucket, slot)
            for bucket, members in enumerate(self.buckets)
            for slot, param in enumerate(members)
        }


def assign_by_size(
    params: Sequence[torch.Tensor],
    limits: Sequence[int],
    sparse_gradient: Sequence[bool],
    order: Sequence[int] | None = None,
) -> list[tuple[tuple[int, ...], int]]:
    """Group parameters into (indices, cap) buckets by accumulated byte size.

    ``order`` lists parameter indices to walk; ``None`` walks registration order and then
    sorts buckets by their smallest index (DDP's initial assignment). With an explicit order
    (a rebuild) buckets stay in the order they were closed.
    """
    if not limits:
        raise ValueError("assign_by_size needs at least one size limit.")
    walk = range(len(params)) if order is None else order
    closed: list[tuple[tuple[int, ...], int]] = []
    open_members: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    limit_position: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in walk:
        param = params[index]
        if param.is_sparse:
            raise ValueError(f"Parameter {index} is a sparse tensor; only gradients may be sparse.")
        if sparse_gradient[index]:
            closed.append(((index,), NO_SIZE_LIMIT))
            continue
        key = (param.dtype, param.device)
        members = open_members.setdefault(key, [])
        members.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + param.numel() * param.element_size()
        position = limit_position.get(key, 0)
        limit = limits[min(position, len(limits) - 1)]
        if open_bytes[key] >= limit:
            closed.append((tuple(members), limit))
            open_members[key] = []
            open_bytes[key] = 0
            limit_position[key] = position + 1
    for key, members in open_members.items():
        if members:
            position = limit_position.get(key, 0)
            closed.append((tuple(members), limits[min(position, len(limits) - 1)]))
    if order is None:
        closed.sort(key=lambda bucket: min(bucket[0]))
    return closed


def initial_plan(
    params: Sequence[torch.Tensor],
    sparse_gradient: Sequence[bool],
    caps: BucketCaps,
    searches_unused_each_forward: bool,
) -> BucketPlan:
    """The layout before any backward ran: DDP assigns in registration order, then reverses the list."""
    limits = caps.initial_limits(searches_unused_each_forward)
    buckets = list(reversed(assign_by_size(params, limits, sparse_gradient)))
    return BucketPlan(tuple(b for b, _ in buckets), tuple(cap for _, cap in buckets))


def explicit_plan(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> BucketPlan:
    """A plan with the given membership (the tuned layout, or a checkpoint's); each bucket's recorded
    cap is its size."""
    return BucketPlan(
        tuple(tuple(members) for members in buckets),
        tuple(sum(params[i].numel() * params[i].element_size() for i in members) for members in buckets),
    )


def rebuilt_plan(
    params: Sequence[torch.Tensor],
    sparse_gradient: Sequence[bool],
    caps: BucketCaps,
    ready_order: Sequence[int],
) -> BucketPlan:
    """The layout after the one rebuild: first-ready gradients go in bucket 0."""
    if sorted(ready_order) != list(range(len(params))):
        raise ValueError(
            f"A rebuild needs every parameter exactly once in the ready order; got {len(ready_order)} "
            f"indices for {len(params)} parameters."
        )
    buckets = assign_by_size(params, caps.rebuild_limits(), sparse_gradient, ready_order)
    return BucketPlan(tuple(b for b, _ in buckets), tuple(cap for _, cap in buckets))
