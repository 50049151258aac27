"""``GradScaler.unscale_`` split by bucket, for the overlapped optimizer.

``unscale_`` multiplies every gradient by the inverse scale and notes whether any was not finite;
both are elementwise, so doing it bucket by bucket as each reduction completes gives the same bits
as one call after backward. Afterwards the scaler is told what ``unscale_`` would have told it, so
the user's ``scaler.step(optimizer)`` and ``scaler.update()`` run unchanged. That hand-over writes
the scaler's per-optimizer record (``_per_optimizer_states``), whose layout has been the same since
GradScaler appeared; this module is the only place that touches it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.amp.grad_scaler import OptState


class BucketUnscaler:
    """Unscales one optimizer's gradients bucket by bucket on behalf of ``scaler``."""

    def __init__(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, rank: int) -> None:
        self.scaler = scaler
        self._optimizer = optimizer
        self._rank = rank
        self._inv_scale: torch.Tensor | None = None  # per backward, from the scale the loss was scaled by
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._user_unscale: Callable[[torch.optim.Optimizer], None] = scaler.unscale_
        scaler.unscale_ = self._refuse_unscale  # type: ignore[method-assign]

    @property
    def enabled(self) -> bool:
        return self.scaler.is_enabled()

    def detach(self) -> None:
        """Give the scaler its own ``unscale_`` back."""
        self.scaler.unscale_ = self._user_unscale  # type: ignore[method-assign]

    def unscale(self, params: list[torch.Tensor]) -> None:
        """Unscale one reduced bucket's gradients in place and note any Inf or NaN among them."""
        if self._inv_scale is None:
            scale = self.scaler._scale
            if scale is None:
                raise RuntimeError(
                    "The GradScaler given to attach_optimizer has no scale yet on rank "
                    f"{self._rank}: backpropagate scaler.scale(loss), not the loss itself."
                )
            # As unscale_ does: the reciprocal in float64, then float32.
            self._inv_scale = scale.double().reciprocal().float()
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is None:
                continue
            if p.grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # GradScaler's own refusal
            grad = p.grad._values() if p.grad.is_sparse else p.grad
            by_kind[(grad.device, grad.dtype)].append(grad)
        with torch.no_grad():
            for (device, _), grads in by_kind.items():
                found_inf = self._found_inf.get(device)
                if found_inf is None:
                    found_inf = self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self._inv_scale.to(device))

    def hand_over(self) -> bool:
        """Record the unscale in the scaler, as ``unscale_`` would; True if any gradient was not finite."""
        state = self.scaler._per_optimizer_states[id(self._optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError(
                f"The GradScaler already unscaled or stepped this optimizer since its last update() on rank "
                f"{self._rank}; with attach_optimizer(..., scaler=...) call scaler.step(optimizer) and "
                "scaler.update() once per synchronized backward, and never scaler.unscale_()."
            )
        state["found_inf_per_device"] = self._found_inf
        state["stage"] = OptState.UNSCALED
        found = any(bool(v.item()) for v in self._found_inf.values())
        self._found_inf, self._inv_scale = {}, None
        return found

    def _refuse_unscale(self, optimizer: torch.optim.Optimizer) -> Any:
        if optimizer is not self._optimizer:
            return self._user_unscale(optimizer)
        raise RuntimeError(
            f"scaler.unscale_(optimizer) on rank {self._rank}: this optimizer's gradients are unscaled bucket "
            "by bucket during each synchronized backward (attach_optimizer(..., overlap=True, scaler=...)) "
            "and its updates have already run when backward returns. Call scaler.step(optimizer) only "
            "after a synchronized backward; to clip, pass max_grad_norm to attach_optimizer."
        )
