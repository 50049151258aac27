"""Deliberate bugs, injected in a rank process only, to prove that parity tests can fail.

Each fault breaks one rule DDP's numbers depend on; a parity test that still passes with a fault
on is not testing that rule.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from overlapddp import bucket_storage, reducer, wrapper


def _skip_scaling() -> tuple[object, str, object]:
    """Copy gradients into buckets without multiplying by 1/world_size (sum instead of mean)."""
    original = bucket_storage.BucketStorage.copy_in

    def copy_in(self, grads, multiply_by, divide_by=None, alias_divide_by=None):
        return original(self, grads, None, divide_by, alias_divide_by)

    return bucket_storage.BucketStorage, "copy_in", copy_in


def _true_division() -> tuple[object, str, object]:
    """Divide by world_size instead of multiplying by its reciprocal (differs at world size 3)."""
    original = bucket_storage.BucketStorage.copy_in

    def copy_in(self, grads, multiply_by, divide_by=None, alias_divide_by=None):
        if multiply_by is None:
            return original(self, grads, multiply_by, divide_by, alias_divide_by)
        return original(self, grads, None, round(1.0 / multiply_by), alias_divide_by)

    return bucket_storage.BucketStorage, "copy_in", copy_in


def _swap_in_bucket() -> tuple[object, str, object]:
    """After the rebuild, swap the first and last parameters of the bucket with most members."""
    original = reducer.rebuilt_plan

    def rebuilt_plan(*args, **kwargs):
        plan = original(*args, **kwargs)
        largest = max(range(len(plan.buckets)), key=lambda b: len(plan.buckets[b]))
        members = list(plan.buckets[largest])
        members[0], members[-1] = members[-1], members[0]
        buckets = list(plan.buckets)
        buckets[largest] = tuple(members)
        return type(plan)(tuple(buckets), plan.size_limits)

    return reducer, "rebuilt_plan", rebuilt_plan


def _ignore_no_sync() -> tuple[object, str, object]:
    """Make ``no_sync()`` do nothing, so every micro-step is reduced and broadcasts buffers."""

    @contextmanager
    def no_sync(self):
        yield

    return wrapper.OverlapDDP, "no_sync", no_sync


def _write_unused_grads() -> tuple[object, str, object]:
    """Treat every parameter as globally used, so never-used ones get zero gradients instead of None."""
    return reducer.Reducer, "_globally_used", lambda self, index: True


def _no_alias_division() -> tuple[object, str, object]:
    """Never recognise a gradient that already is its bucket view: copy and multiply instead of dividing."""
    return bucket_storage.BucketStorage, "aliases", lambda self, slot, grad: False


FAULTS = {
    "write_unused_grads": _write_unused_grads,
    "no_alias_division": _no_alias_division,
    "skip_scaling": _skip_scaling,
    "true_division": _true_division,
    "swap_in_bucket": _swap_in_bucket,
    "ignore_no_sync": _ignore_no_sync,
}


@contextmanager
def injected(name: str | None) -> Iterator[None]:
    """Patch the named fault in for the duration of the block (no-op for ``None``)."""
    if name is None:
        yield
        return
    owner, attribute, replacement = FAULTS[name]()
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        setattr(owner, attribute, original)
