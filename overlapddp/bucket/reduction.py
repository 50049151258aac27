"""What does each bucket's collective do, what does it divide by, and what comes out? DDP's arithmetic.

DDP's default path multiplies each gradient by ``1 / world_size`` while copying it into its bucket,
then sums; a batched copy divides the bucket after the copy instead; a communication hook gets the
unscaled bucket and divides itself. The divisor is the world size, under ``Join`` the ranks still
training (when asked to), or with token weighting the global token count, known only once its
all-reduce (launched at the start of backward) has completed. What comes out, the sum's buffer or
the hook's one tensor, is checked and copied into ``param.grad`` by :class:`GradientCopy`, the first
consumer of every bucket (bucket/consumer.py).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

from overlapddp.bucket.comm_hook import Bucket, CommHook, is_unchained, run_hook
from overlapddp.bucket.consumer import ReducedBucket
from overlapddp.bucket.sparse_storage import SparseBucketStorage
from overlapddp.bucket.storage import BucketStorage
from overlapddp.bucket.token_weighting import TokenCount


class BucketReduction:
    """Starts each bucket's collective(s) and scales the copy into it, per synchronized backward."""

    def __init__(self, process_group: dist.ProcessGroup, batched_grad_copy: bool) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self._batched = batched_grad_copy
        self.comm_hook: tuple[Any, CommHook] | None = None  # (state, hook), see set_comm_hook
        self.tokens: TokenCount | None = None  # token-weighted reduction, see enable_token_weighting
        self._scale: float | None = None  # set per backward by arm
        # Likewise: the world size, the ranks still training under Join, or (None until the first
        # fill) the global token count.
        self._divide_by: float | None = 1
        self._hook_future: torch.futures.Future | None = None  # last hook chain started, see start
        # Under Join: the all-reduce (started by the wrapper's forward) that counts the ranks still
        # training; waited on by the next arm, see set_join_count.
        self._training_ranks_work: dist.Work | None = None

    def enable_token_weighting(self, device: torch.device) -> TokenCount:
        """Divide by the global token count instead of the world size (see bucket/token_weighting.py;
        the wrapper refuses the combinations that would not divide by it: refusals.py)."""
        if self.tokens is None:
            self.tokens = TokenCount(device)
        return self.tokens

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the scaled sum (once: the wrapper
        refuses a second hook and the combinations in refusals.py)."""
        self.comm_hook = (state, hook)

    @property
    def hook_name(self) -> str:
        """The hook's name, for errors about its result."""
        if self.comm_hook is None:
            return "allreduce (default)"
        hook = self.comm_hook[1]
        return getattr(hook, "__qualname__", None) or repr(hook)

    def set_join_count(self, work: dist.Work, divide_by_initial_world_size: bool) -> None:
        """Under ``Join``: ``work`` sums 1 per rank still training; average over those ranks unless
        ``divide_by_initial_world_size``."""
        self._training_ranks_work = None if divide_by_initial_world_size else work

    def arm(self) -> None:
        """A synchronized forward ran: fix this backward's divisor and copy scale."""
        # Scale while copying, as DDP's default path does; a hook or batched copy divides later.
        no_scaling = self.comm_hook is not None or self._batched
        self._divide_by = self._divisor()
        self._scale = None if no_scaling else 1.0 / self._divide_by
        if self.tokens is not None:
            self.tokens.launch(self.process_group)  # overlaps backward; waited at the first fill
            self._divide_by = None

    def _divisor(self) -> int:
        """The world size, or under ``Join`` the number of ranks still training when asked for."""
        if self._training_ranks_work is None:
            return self.process_group.size()
        work, self._training_ranks_work = self._training_ranks_work, None
        work.wait()
        return int(work.result()[0].item())

    def copy_in(self, storage: BucketStorage | SparseBucketStorage) -> torch.Tensor:
        """Copy a complete bucket's gradients in, scaled as DDP scales them (batched, once per bucket);
        returns the buffer written (a sparse bucket's is the gradient itself)."""
        no_hook = self.comm_hook is None
        batched = self._batched
        if self._divide_by is None:  # token weighting: the global count is needed from here on
            self._divide_by = cast(TokenCount, self.tokens).total(self.rank)  # arm left it None
            self._scale = None if batched else 1.0 / self._divide_by
        storage.copy_in(
            [p.grad for p in storage.params],
            self._scale,
            divide_by=self._divide_by if batched and no_hook else None,
            alias_divide_by=self._divide_by if no_hook and not batched else None,
        )
        return storage.buffer

    @property
    def issues_from_callbacks(self) -> bool:
        """Whether the registered hook may issue collectives from its callbacks (PowerSGD): then no
        other collective may start while a chain runs, or ranks issue them in different orders."""
        return self.comm_hook is not None and not is_unchained(self.comm_hook[1])

    def wait_for_hook_chains(self) -> None:
        """Until the last hook chain started (so every earlier one, see start) has issued its last collective."""
        if self._hook_future is not None:
            self._hook_future.wait()

    def start(self, bucket: Bucket) -> torch.futures.Future:
        """Start one bucket's collective(s): the scaled sum's all-reduce, or the registered hook."""
        if self.comm_hook is None:  # an in-place SUM all-reduce of the (already scaled) buffer
            return dist.all_reduce(bucket.buffer(), group=self.process_group, async_op=True).get_future()
        state, hook = self.comm_hook
        # Hook chains run one bucket at a time, see [Note: one hook chain at a time] in
        # bucket/comm_hook.py: bucket b's hook starts once bucket b-1's future (kept here from the
        # previous start of this iteration; finalize consumes it through the fence) is done.
        chained = bucket.index() > 0 and not is_unchained(hook)
        after = self._hook_future if chained else None
        self._hook_future = run_hook(hook, state, bucket, after)
        return self._hook_future


class GradientCopy:
    """DDP's consumer: the collective's result, checked, copied into each written member's ``.grad``
    (with ``gradient_as_bucket_view``, the gradients are the bucket's views).

    A hook's future must resolve to one tensor of the bucket's size; DDP also accepts a one-element
    list. Anything else is an error that names the hook and the bucket instead of a failed stride
    check later.
    """

    name = "copy to param.grad"

    def __init__(self, reduction: BucketReduction, as_view: bool) -> None:
        self._reduction = reduction
        self._as_view = as_view

    def take(self, bucket: ReducedBucket) -> None:
        value, expected = bucket.value, bucket.storage.buffer
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"Communication hook {self._reduction.hook_name} returned a future whose value is "
                f"{type(value).__name__} for bucket {bucket.index}; expected one tensor of {expected.numel()} elements."
            )
        if value.numel() != expected.numel() or not value.is_floating_point() and not value.is_complex():
            raise ValueError(
                f"Communication hook {self._reduction.hook_name} returned a {tuple(value.shape)} {value.dtype} "
                f"tensor for bucket {bucket.index}; expected {expected.numel()} elements of a floating dtype "
                f"(the bucket holds {expected.dtype})."
            )
        bucket.storage.copy_out(value, bucket.write, as_view=self._as_view)

    def all_taken(self) -> None:
        """Nothing waits for the last bucket: every copy was made as its bucket completed."""

    def abandoned(self) -> None:
        """Nothing is kept across buckets."""
