"""The optimizer-step guard: ``step()`` only ever reads complete, reduced, fresh gradients.

Attached with ``OverlapDDP.attach_optimizer(optimizer)``. Before ``step()`` reads a gradient it
checks the reducer: no bucket of the current backward may still be reducing, the gradients must
come from a synchronized backward (not only ``no_sync`` ones), and they must be new since the last
step. On CUDA it also makes the stream that runs ``step()`` (or ``zero_grad()``, or the scaler's
``unscale_``) wait for the reductions and the copies into ``param.grad``, so a step on another
stream than backward still reads final values.

The same checks guard ``zero_grad()`` and, when a scaler is given, ``scaler.unscale_(optimizer)``
(also called by ``scaler.step``), before they touch a gradient. Other in-place writes from inside
backward (``clip_grad_norm_`` in a hook) cannot be intercepted beforehand; the reducer then reports
them at the end of backward, before any step (see bucket/gradient_checks.py).
"""

from __future__ import annotations

from typing import Any

import torch

from overlapddp.reducer import Reducer


class OptimizerGuard:
    """Checks one optimizer's reads of the gradients of one OverlapDDP.

    ``strict`` raises where the lenient mode can wait (a step on another CUDA stream than the
    reduction's consumer); ``allow_unsynced`` permits steps on local gradients (e.g. local SGD).
    """

    def __init__(
        self,
        reducer: Reducer,
        optimizer: torch.optim.Optimizer,
        strict: bool,
        allow_unsynced: bool,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self._reducer = reducer
        self.optimizer = optimizer
        self.strict = strict
        self.allow_unsynced = allow_unsynced
        self._stepped_at = 0  # reducer.reductions when the last step ran
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        self._unguarded_zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self._zero_grad  # type: ignore[method-assign]
        self._scaler = scaler
        if scaler is not None:
            self._unguarded_unscale = scaler.unscale_
            scaler.unscale_ = self._unscale  # type: ignore[method-assign]
        reducer.stages.write_watch.watchers += 1

    def detach(self) -> None:
        """Remove the guard from the optimizer."""
        for handle in self._handles:
            handle.remove()
        self.optimizer.zero_grad = self._unguarded_zero_grad  # type: ignore[method-assign]
        if self._scaler is not None and self._scaler.unscale_ == self._unscale:
            self._scaler.unscale_ = self._unguarded_unscale  # type: ignore[method-assign]
        self._reducer.stages.write_watch.watchers -= 1

    def check(self, action: str) -> None:
        """Raise unless ``action`` may read the gradients now."""
        busy = self._reducer.unfinished_buckets()
        if busy:
            raise RuntimeError(
                f"{action} was called while buckets {busy} of the current backward are still being reduced "
                f"on rank {self._reducer.rank}; their gradients are not final until loss.backward() returns. "
                "Call it after backward (or use attach_optimizer(..., overlap=True) to overlap the step)."
            )
        if self.allow_unsynced:
            return
        if self._reducer.local_gradients_since_reduction:
            raise RuntimeError(
                f"{action} would read gradients accumulated under no_sync() on rank {self._reducer.rank} that "
                "were never reduced across ranks. Run the last micro-batch's forward and backward outside "
                "no_sync(), or attach the optimizer with allow_unsynced=True if local steps are intended."
            )
        if self._reducer.reductions == self._stepped_at:
            raise RuntimeError(
                f"{action} would read stale gradients on rank {self._reducer.rank}: "
                + ("no synchronized backward has run yet." if self._stepped_at == 0 else
                   "they were already used by the previous step and no synchronized backward ran since.")
            )

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.check("optimizer.step()")
        self._make_visible()

    def _make_visible(self) -> None:
        """Order the current stream after the reductions and copy-outs of every gradient."""
        gradients = [p.grad for p in self._reducer.params if p.grad is not None]
        self._reducer.fence.make_visible(strict=self.strict, gradients=gradients)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped_at = self._reducer.reductions

    def _zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        busy = self._reducer.unfinished_buckets()
        if busy:
            raise RuntimeError(
                f"optimizer.zero_grad() was called while buckets {busy} are still being reduced on rank "
                f"{self._reducer.rank}; the reduction would write into or read from cleared gradients."
            )
        self._make_visible()
        return self._unguarded_zero_grad(*args, **kwargs)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.optimizer:
            self.check("GradScaler.unscale_()")
            self._make_visible()
        self._unguarded_unscale(optimizer)
