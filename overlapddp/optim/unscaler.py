"""``GradScaler.unscale_`` split by bucket, for the overlapped optimizer.

``unscale_`` multiplies every gradient of the optimizer by the inverse scale and notes whether any
was not finite; both are elementwise, so doing it bucket by bucket as each reduction completes gives
the same bits as one call after backward. Afterwards the scaler is told what ``unscale_`` would have
told it, so the user's ``scaler.step(optimizer)`` and ``scaler.update()`` run unchanged. That
hand-over writes the scaler's per-optimizer record (``_per_optimizer_states``), whose layout has been
the same since GradScaler appeared; this module is the only place that touches it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.amp.grad_scaler import OptState


class BucketUnscaler:
    """Unscales one optimizer's gradients bucket by bucket on behalf of ``scaler``.

    ``iteration()`` names the reducer's current iteration (it changes after every finished or
    abandoned one), so that nothing noted during a failed backward leaks into the next.
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        optimizer: torch.optim.Optimizer,
        reduced: Iterable[torch.Tensor],
        iteration: Callable[[], int],
        rank: int,
    ) -> None:
        self.scaler = scaler
        self._optimizer = optimizer
        self._reduced = {id(p) for p in reduced}  # parameters whose gradients arrive in buckets
        self._iteration = iteration
        self._rank = rank
        # Per iteration: which it is, the inverse scale the loss was scaled by, the optimizer's
        # parameters, and the Inf/NaN flag per device.
        self._noted_in: int | None = None
        self._inv_scale = torch.ones(())
        self._owned: set[int] = set()
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._user_unscale: Callable[[torch.optim.Optimizer], None] = scaler.unscale_
        scaler.unscale_ = self._refuse_unscale  # type: ignore[method-assign]

    def detach(self) -> None:
        """Give the scaler its own ``unscale_`` back."""
        # A bound method of the scaler, read back as a plain callable: mypy calls the types different.
        self.scaler.unscale_ = self._user_unscale  # type: ignore[method-assign, assignment]

    def unscale(self, params: list[torch.Tensor]) -> None:
        """Unscale one reduced bucket's gradients (those of this optimizer) and note any Inf or NaN."""
        self._start_iteration()
        self._unscale([p for p in params if id(p) in self._owned])

    def hand_over(self) -> bool:
        """Unscale this optimizer's gradients that no bucket carried, then record the unscale in the
        scaler as ``unscale_`` would; True if any gradient was not finite."""
        self._start_iteration()
        self._unscale([p for p in self._optimizer_params() if id(p) not in self._reduced])
        state = self.scaler._per_optimizer_states[id(self._optimizer)]
        state["found_inf_per_device"] = self._found_inf
        state["stage"] = OptState.UNSCALED
        found = any(bool(v.item()) for v in self._found_inf.values())
        self._noted_in = None
        return found

    def _start_iteration(self) -> None:
        """On the first bucket of an iteration: check the scaler can be unscaled, forget older notes."""
        iteration = self._iteration()
        if self._noted_in == iteration:
            return
        scale = self.scaler._scale
        if scale is None:
            raise RuntimeError(
                "The GradScaler given to attach_optimizer has no scale yet on rank "
                f"{self._rank}: backpropagate scaler.scale(loss), not the loss itself."
            )
        if self.scaler._per_optimizer_states[id(self._optimizer)]["stage"] is not OptState.READY:
            raise RuntimeError(
                f"The GradScaler already unscaled or stepped this optimizer since its last update() on rank "
                f"{self._rank}; with attach_optimizer(..., scaler=...) call scaler.step(optimizer) and "
                "scaler.update() once per synchronized backward, and never scaler.unscale_()."
            )
        self._noted_in = iteration
        self._inv_scale = scale.double().reciprocal().float()  # as unscale_ does: via float64
        self._owned = {id(p) for p in self._optimizer_params()}
        self._found_inf = {}

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _unscale(self, params: list[torch.Tensor]) -> None:
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

    def _refuse_unscale(self, optimizer: torch.optim.Optimizer) -> Any:
        if optimizer is not self._optimizer:
            return self._user_unscale(optimizer)
        raise RuntimeError(
            f"scaler.unscale_(optimizer) on rank {self._rank}: this optimizer's gradients are unscaled bucket "
            "by bucket during each synchronized backward (attach_optimizer(..., overlap=True, scaler=...)) "
            "and its updates have already run when backward returns. Call scaler.step(optimizer) only "
            "after a synchronized backward; to clip, pass max_grad_norm to attach_optimizer."
        )
