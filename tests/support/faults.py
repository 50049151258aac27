"""Deliberate bugs, injected for one scenario (in a rank process, or the test process on one rank), to prove that parity tests can fail.

Each fault breaks one rule DDP's numbers depend on; a parity test that still passes with a fault
on is not testing that rule.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

from overlapddp import reducer, wrapper
from overlapddp.bucket import comm_hook
from overlapddp.bucket import reduction as bucket_reduction
from overlapddp.bucket import storage as bucket_storage
from overlapddp.layout import lifecycle as layout_lifecycle


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
    original = layout_lifecycle.rebuilt_plan

    def rebuilt_plan(*args, **kwargs):
        plan = original(*args, **kwargs)
        largest = max(range(len(plan.buckets)), key=lambda b: len(plan.buckets[b]))
        members = list(plan.buckets[largest])
        members[0], members[-1] = members[-1], members[0]
        buckets = list(plan.buckets)
        buckets[largest] = tuple(members)
        return type(plan)(tuple(buckets), plan.size_limits)

    return layout_lifecycle, "rebuilt_plan", rebuilt_plan


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


def _ignore_set_buffer() -> tuple[object, str, object]:
    """``Bucket.set_buffer`` does nothing: fp16/bf16 wrappers then reduce the float32 buffer."""

    def set_buffer(self, tensor):
        return None

    return comm_hook.Bucket, "set_buffer", set_buffer


def _ignore_hook_result() -> tuple[object, str, object]:
    """Copy the bucket's own buffer into ``.grad`` instead of the tensor the hook's future holds."""
    original = bucket_reduction.GradientCopy.take

    def take(self, bucket):
        original(self, dataclasses.replace(bucket, value=bucket.storage.buffer))

    return bucket_reduction.GradientCopy, "take", take


def _hook_not_registered() -> tuple[object, str, object]:
    """Accept ``register_comm_hook`` and ``_register_builtin_comm_hook`` but keep the default reduction."""

    def set_comm_hook(self, state, hook):
        return None

    return bucket_reduction.BucketReduction, "set_comm_hook", set_comm_hook


def _is_last_never() -> tuple[object, str, object]:
    """``Bucket.is_last()`` is always False: hooks that count iterations with it never advance."""

    def is_last(self):
        return False

    return comm_hook.Bucket, "is_last", is_last


def _unchained_hooks() -> tuple[object, str, object]:
    """Start each bucket's hook as soon as it is ready, not after the previous bucket's hook chain."""
    original = bucket_reduction.run_hook

    def run_hook(hook, state, bucket, after):
        return original(hook, state, bucket, None)

    return bucket_reduction, "run_hook", run_hook


def _join_ignores_remaining_ranks() -> tuple[object, str, object]:
    """Under Join, always divide by the initial world size, even when told to count remaining ranks."""
    return bucket_reduction.BucketReduction, "set_join_count", lambda self, work, divide_by_initial_world_size: None


FAULTS = {
    "join_ignores_remaining_ranks": _join_ignores_remaining_ranks,
    "write_unused_grads": _write_unused_grads,
    "no_alias_division": _no_alias_division,
    "skip_scaling": _skip_scaling,
    "true_division": _true_division,
    "swap_in_bucket": _swap_in_bucket,
    "ignore_no_sync": _ignore_no_sync,
    "ignore_set_buffer": _ignore_set_buffer,
    "ignore_hook_result": _ignore_hook_result,
    "hook_not_registered": _hook_not_registered,
    "is_last_never": _is_last_never,
    "unchained_hooks": _unchained_hooks,
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
