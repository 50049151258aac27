"""Are a bucket's gradients sound? The debug checks around its reduction: no value that is not
finite before it (``check_nonfinite_gradients``), no write into a gradient during it (guarded optimizers).

Both raise instead of letting a wrong value through: a NaN reduced into every rank, or a change
(``clip_grad_norm_`` or ``zero_grad`` from inside backward) silently replaced by the reduced value.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from overlapddp.module_sync import gather_objects


class GradientWriteWatch:
    """Per bucket, each gradient and its version when copied in; checked when the bucket is written back.

    Active while any optimizer guard is attached (``watchers``: each guard counts itself in and out);
    ``taken`` runs right after the copy-in, ``check`` before the copy-out.
    """

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], rank: int) -> None:
        self._names = list(names)
        self._params = list(params)
        self._rank = rank
        self.watchers = 0
        self._copied: dict[int, list[tuple[int, torch.Tensor, int]]] = {}

    def taken(self, bucket: int, members: Sequence[int], params: Sequence[torch.Tensor]) -> None:
        """Bucket ``bucket``'s gradients were copied in: remember what they were."""
        self._copied[bucket] = [
            (i, p.grad, p.grad._version) for i, p in zip(members, params, strict=True) if p.grad is not None
        ]

    def check(self, bucket: int) -> None:
        """A gradient changed in place (or replaced) after it was copied into its bucket would be
        silently overwritten by the reduced value: stop instead."""
        taken = self._copied.pop(bucket, [])
        changed = [self._names[i] for i, grad, version in taken
                   if self._params[i].grad is not grad or grad._version != version]
        if changed:
            raise RuntimeError(
                f"The gradients of {', '.join(changed)} (bucket {bucket}) were changed on rank {self._rank} while "
                "the bucket was being reduced (clip_grad_norm_, zero_grad or another write from inside "
                "backward); the reduced values would silently replace that change. Change gradients only "
                "after loss.backward() has returned."
            )

    def clear(self) -> None:
        """The iteration was abandoned: nothing is in flight any more."""
        self._copied = {}


def nonfinite_error(
    bucket: int,
    members: Sequence[int],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    device: torch.device,
    process_group: dist.ProcessGroup,
) -> FloatingPointError | None:
    """Before bucket ``bucket`` is reduced: the error every rank raises if any rank's gradients there
    are not finite, naming those ranks and parameters (one extra all-reduce per bucket; a debug
    option), else None. The flags are computed on the device; the host reads one count per bucket."""
    present = [(i, p.grad) for i, p in zip(members, params, strict=True) if p.grad is not None]
    flags = torch.stack([torch.isfinite(_values(g)).all().logical_not() for _, g in present]) if present else \
        torch.zeros(0, dtype=torch.bool, device=device)
    count = flags.sum(dtype=torch.int64).reshape(1)
    dist.all_reduce(count, group=process_group)
    if count.item() == 0:
        return None
    bad = [names[i] for (i, _), flag in zip(present, flags.tolist(), strict=True) if flag]
    everyone = gather_objects(bad, process_group, device)
    found = "; ".join(f"rank {r}: {', '.join(ranked)}" for r, ranked in enumerate(everyone) if ranked)
    return FloatingPointError(
        f"Non-finite gradients (NaN or Inf) in bucket {bucket} before its reduction ({found}). "
        "Nothing was reduced, so no rank received them; the wrapper has been reset."
    )


def _values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a dense or sparse gradient."""
    return grad._values() if grad.is_sparse else grad
