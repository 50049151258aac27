"""Optimizer overlapped with communication: each bucket's parameters are updated as soon as that
bucket's reduction is complete, while the later buckets are still reducing.

The user's loop is unchanged (backward, ``step()``, ``zero_grad()``): the updates run in the
end-of-backward callback, bucket by bucket, and ``step()`` then only checks they all ran. Only
optimizers whose update of one parameter reads nothing but that parameter's gradient and state can
be split this way; for them, updating bucket by bucket is bit-equal to one ``step()`` after backward.
"""

from __future__ import annotations

from typing import Any

import torch

from overlapddp.reducer import Reducer

# Per-parameter update rules (SGD with momentum, weight decay, nesterov; Adam; AdamW): a parameter's
# new value depends only on its own gradient and state, so the update can be split by bucket.
PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class OverlappedOptimizer:
    """Runs ``optimizer``'s update of each bucket right after the bucket is reduced."""

    def __init__(self, reducer: Reducer, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
            raise ValueError(
                f"{type(optimizer).__name__} cannot be overlapped bucket by bucket; overlap supports "
                f"{', '.join(t.__name__ for t in PER_PARAMETER_OPTIMIZERS)}. Use attach_optimizer(optimizer) "
                "without overlap: its step then runs after backward, as with DDP."
            )
        if any(group.get("fused") for group in optimizer.param_groups):
            raise ValueError("A fused optimizer updates all parameters in one kernel; create it with fused=False.")
        self._reducer = reducer
        self.optimizer = optimizer
        self._update = optimizer.step  # the real step, called per bucket
        self._stepped_at = 0  # reducer.reductions the user's step() has acknowledged
        optimizer.step = self._step  # type: ignore[method-assign]
        reducer.after_bucket_reduced = self._update_bucket

    def detach(self) -> None:
        """Give the optimizer its own ``step()`` back and stop updating during backward."""
        self.optimizer.step = self._update  # type: ignore[method-assign]
        self._reducer.after_bucket_reduced = None

    def _update_bucket(self, params: list[torch.Tensor]) -> None:
        """Step the optimizer with every gradient but this bucket's hidden (it skips params without grad)."""
        members = {id(p) for p in params}
        hidden = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in members and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self._update()
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _step(self, closure: Any = None) -> None:
        """Return once every bucket's update has run (they run during backward's end)."""
        if closure is not None:
            raise NotImplementedError("An overlapped optimizer cannot re-evaluate a closure.")
        if self._reducer.reductions == self._stepped_at:
            raise RuntimeError(
                f"optimizer.step() on rank {self._reducer.rank}: with overlap=True the update runs during a "
                "synchronized backward, and none has run since the last step (a no_sync backward, or no "
                "backward at all)."
            )
        self._stepped_at = self._reducer.reductions
