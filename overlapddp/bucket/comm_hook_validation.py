"""DDP's checks on a communication hook and its state before it is registered, and its built-in hooks."""

from __future__ import annotations

import inspect
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from overlapddp.bucket.comm_hook import Bucket, CommHook


class CommHookSignatureError(TypeError, KeyError):
    """A hook without a ``bucket`` parameter (a ``KeyError`` in DDP, kept catchable as one)."""

    def __str__(self) -> str:
        return str(self.args[0])


def check_comm_hook(hook: CommHook, process_group: dist.ProcessGroup) -> None:
    """Reject a hook DDP would reject, with a message that names the hook."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable, got {hook!r}.")
    name = getattr(hook, "__qualname__", repr(hook))
    signature = inspect.signature(hook)
    if "bucket" not in signature.parameters:
        raise CommHookSignatureError(
            f"Communication hook {name} must take a parameter named 'bucket'; its parameters are "
            f"{list(signature.parameters)}."
        )
    annotation = signature.parameters["bucket"].annotation
    if annotation is not inspect.Parameter.empty and annotation not in (dist.GradBucket, Bucket, "dist.GradBucket"):
        raise ValueError(
            f"Communication hook {name}: bucket annotation should be dist.GradBucket, got {annotation!r}."
        )
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and returned not in (
        torch.futures.Future[torch.Tensor],
        "torch.futures.Future[torch.Tensor]",
    ):
        raise ValueError(
            f"Communication hook {name}: return annotation should be torch.futures.Future[torch.Tensor], "
            f"got {returned!r}."
        )


def check_hook_state(state: object, sparse_names: list[str], layout_final_at: int) -> None:
    """Refuse a hook state that cannot work with these buckets: PowerSGD over a sparse gradient's
    bucket, or PowerSGD keeping per-bucket state (from ``start_powerSGD_iter`` on) before the tuned
    layout is final (``layout_final_at``; DDP's own rebuild comes early enough for PowerSGD's minimum
    of 2)."""
    if not isinstance(state, PowerSGDState):
        return
    if sparse_names:
        raise ValueError(
            f"PowerSGD compresses flat dense buckets, but {', '.join(sparse_names)} produce sparse "
            "gradients (stock DDP hangs here); use sparse=False for them or another hook."
        )
    if state.start_powerSGD_iter < layout_final_at:
        raise ValueError(
            f"PowerSGD keeps per-bucket state from iteration start_powerSGD_iter={state.start_powerSGD_iter} on, "
            f"but the buckets change until iteration {layout_final_at} (bucket_plan='tuned'); set "
            f"start_powerSGD_iter >= {layout_final_at} or use bucket_plan='ddp'."
        )


def builtin_hook(comm_hook_type: dist.BuiltinCommHookType) -> CommHook:
    """The Python hook with the same arithmetic as DDP's C++ built-in of that type."""
    # torch types these hooks for its GradBucket; a Bucket offers the same methods.
    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return cast(CommHook, default_hooks.allreduce_hook)
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return cast(CommHook, default_hooks.fp16_compress_hook)
    raise ValueError(f"Unknown built-in communication hook type {comm_hook_type!r}.")
