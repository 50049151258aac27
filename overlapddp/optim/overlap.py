"""Optimizer overlapped with communication: each bucket's parameters are updated as soon as that
bucket's reduction is complete, while the later buckets are still reducing.

The user's loop is unchanged (backward, ``step()``, ``zero_grad()``): the updates run in the
end-of-backward callback, bucket by bucket, and ``step()`` then only checks they all ran. Only
optimizers whose update of one parameter reads nothing but that parameter's gradient and state can
be split this way; for them, updating bucket by bucket is bit-equal to one ``step()`` after backward.

Clipping and loss scaling decide for all gradients at once (the total norm; whether any gradient is
Inf or NaN), so with either only their per-bucket work (norms, unscaling) overlaps communication,
and the updates run after the last bucket.

What a loop line means is kept or refused, never silently changed: a gradient changed in place after
the updates (``clip_grad_norm_``, ``GradScaler.unscale_``) or a hyperparameter or parameter group
changed after the update used it (an lr set, a group added between backward and ``step()``) raises
at ``step()``; a ``step()`` skipped
after an update that already ran raises at the next ``zero_grad()`` or backward. One read cannot be
seen: parameters read between backward and ``step()`` already hold their new values (the mode's
contract, stated in ``attach_optimizer``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from overlapddp.bucket.consumer import ReducedBucket
from overlapddp.optim.takeover import give_back_step, is_per_parameter, narrowed, take_over_step, why_not_per_parameter
from overlapddp.optim.unscaler import BucketUnscaler
from overlapddp.reducer import Reducer
from overlapddp.torch_compat import foreach_mul_, foreach_norm


class OverlappedOptimizer:
    """Runs ``optimizer``'s update of each bucket right after the bucket is reduced: a consumer of
    reduced buckets (bucket/consumer.py), attached after the copy into ``param.grad``."""

    name = "overlapped update"

    def __init__(
        self,
        reducer: Reducer,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        kind = type(optimizer)
        if not is_per_parameter(kind):
            raise ValueError(
                f"{kind.__name__} cannot be overlapped bucket by bucket: {why_not_per_parameter(kind)}. Use "
                "attach_optimizer(optimizer) without overlap: its step then runs after backward, as with DDP."
            )
        if any(group.get("fused") for group in optimizer.param_groups):
            raise ValueError("A fused optimizer updates all parameters in one kernel; create it with fused=False.")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}.")
        self._reducer = reducer
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self._update = optimizer.step  # the real step, called per bucket (taken over below)
        # Parameters of this backward's buckets taken so far: at the end, the optimizer's others with a
        # gradient (ignored by the wrapper, or in a bucket skip_all_reduce_unused_params skipped) update.
        self._taken: set[int] = set()
        # Loss scaling: each bucket is unscaled as soon as it is reduced; the scaler then learns the
        # outcome as if scaler.unscale_(optimizer) had run (None: no scaler, or a disabled one).
        self._unscaler: BucketUnscaler | None = None
        if scaler is not None and scaler.is_enabled():
            self._unscaler = BucketUnscaler(
                scaler, optimizer, reducer.params, lambda: reducer.synchronized_forwards, reducer.rank
            )
        self._stepped_at = 0  # reducer.reductions the user's step() has acknowledged
        # Per-parameter gradient norms of the buckets reduced so far in this backward (clipping only).
        self._norms: dict[int, torch.Tensor] = {}
        # Version counter of each gradient after the updates: a later in-place change (a user's
        # clip_grad_norm_ or GradScaler.unscale_) could not be honored and is reported at step().
        self._versions: list[tuple[torch.Tensor, int]] = []
        # Each group's parameters and hyperparameters as the last updates used them (None: no update since the
        # last step): step() checks the loop did not change them after backward, zero_grad() and the
        # next backward that step() acknowledged the update.
        self._used: list[dict[str, Any]] | None = None
        self._taking = False  # a bucket of the current backward was taken
        try:
            reducer.attach(self)
        except RuntimeError:
            if self._unscaler is not None:
                self._unscaler.detach()  # give the scaler its unscale_ back
            raise
        take_over_step(optimizer, self._step)
        self._zero_grad = optimizer.zero_grad
        optimizer.zero_grad = self._checked_zero_grad  # type: ignore[method-assign]

    def detach(self) -> None:
        """Give the optimizer its own ``step()`` and ``zero_grad()`` back and stop updating during backward."""
        self._reducer.detach(self)
        give_back_step(self.optimizer, self._update)
        self.optimizer.zero_grad = self._zero_grad  # type: ignore[method-assign]
        if self._unscaler is not None:
            self._unscaler.detach()

    @property
    def _updates_wait_for_all(self) -> bool:
        """Clipping and loss scaling need every bucket before any update may run."""
        return self.max_grad_norm is not None or self._unscaler is not None

    def take(self, bucket: ReducedBucket) -> None:
        """One bucket is reduced and its gradients written: unscale it, measure it, or update it, as
        the options allow."""
        if not self._taking:  # this backward's first bucket
            self._taking = True
            self._check_stepped("the next backward")
        params = bucket.params
        self._taken.update(id(p) for p in params)
        if self._unscaler is not None:
            self._unscaler.unscale(params)
        if self.max_grad_norm is not None:
            self._measure_bucket(params)
        if not self._updates_wait_for_all:
            self._update_bucket(params)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _update_bucket(self, params: list[torch.Tensor]) -> None:
        """Step the optimizer over this bucket's parameters only: each group briefly lists just its
        members of the bucket (the update of one parameter reads only its own gradient and state)."""
        with narrowed(self.optimizer.param_groups, {id(p) for p in params}):
            self._update()

    def _measure_bucket(self, params: list[torch.Tensor]) -> None:
        """Clipping needs the total norm first: compute this bucket's share while others reduce."""
        grads = [p for p in params if p.grad is not None]
        if not grads:
            return
        with torch.no_grad():
            for p, norm in zip(grads, foreach_norm([p.grad for p in grads], self.norm_type), strict=True):
                self._norms[id(p)] = norm

    def abandoned(self) -> None:
        """The iteration was dropped: the norms measured for it go with it."""
        self._norms = {}
        self._taking = False
        self._taken = set()

    def all_taken(self) -> None:
        """After the last bucket: hand the unscale over to the scaler, clip exactly as ``clip_grad_norm_``
        would, then update unless the scaler found an Inf or NaN (as ``scaler.step`` decides); and
        remember every gradient's version to catch later in-place changes."""
        self._taking = False
        found_inf = self._unscaler.hand_over() if self._unscaler is not None else False
        if self.max_grad_norm is not None:
            self._clip()
        if self._updates_wait_for_all and not found_inf:
            self._update()
        elif not self._updates_wait_for_all:
            # The optimizer's parameters no bucket brought (ignored, or skipped as unused) update last.
            outside = [p for p in self._params() if id(p) not in self._taken and p.grad is not None]
            if outside:
                self._update_bucket(outside)
        self._taken = set()  # (whichever branch ran)
        if not found_inf:  # (the scaler skips step() then: nothing is owed)
            self._used = [_settings(group) for group in self.optimizer.param_groups]
        self._versions = [(p.grad, p.grad._version) for p in self._params() if p.grad is not None]

    def _clip(self) -> None:
        """``clip_grad_norm_`` over the optimizer's parameters, with the bucket norms measured so far."""
        with torch.no_grad():
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in self._params():
                if p.grad is not None:
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(p)
            self._measure_bucket([p for members in groups.values() for p in members if id(p) not in self._norms])
            norms = [self._norms[id(p)] for members in groups.values() for p in members]
            self._norms = {}
            if norms:
                first_device = norms[0].device
                total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), self.norm_type)
                coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
                for (device, _), members in groups.items():
                    foreach_mul_([p.grad for p in members], coef.to(device))

    def _step(self, closure: Any = None, **kwargs: Any) -> None:
        """Return once every bucket's update has run (they run during backward's end)."""
        if closure is not None or kwargs:
            given = "a closure" if closure is not None else f"{sorted(kwargs)}"
            raise NotImplementedError(
                f"An overlapped optimizer cannot re-evaluate a closure or take step() arguments (got {given}): "
                "its update already ran during backward."
            )
        try:  # each refusal is said once: the step counts as taken either way
            self._check_versions()
            self._check_scaler(_stepping_scaler())
            if self._reducer.reductions == self._stepped_at:
                raise RuntimeError(
                    f"optimizer.step() on rank {self._reducer.rank}: with overlap=True the update runs during a "
                    "synchronized backward, and none has run since the last step (a no_sync backward, or no "
                    "backward at all)."
                )
            self._check_settings_unchanged()
        finally:
            self._stepped_at = self._reducer.reductions
            self._used = None

    def _check_versions(self) -> None:
        """A gradient changed in place after the updates used it (clip_grad_norm_, an unscale) cannot be honored."""
        changed = [i for i, (grad, version) in enumerate(self._versions) if grad._version != version]
        self._versions = []
        if changed:
            raise RuntimeError(
                f"Gradients were changed in place after the overlapped updates had already run on rank "
                f"{self._reducer.rank} (e.g. clip_grad_norm_ or GradScaler.unscale_); that change cannot be "
                "honored. Pass max_grad_norm to attach_optimizer(..., overlap=True) to clip, or attach "
                "without overlap."
            )

    def _check_scaler(self, scaler: object) -> None:
        """A GradScaler not given to attach_optimizer unscaled gradients the updates had already used
        (its in-place unscale leaves no version behind to catch): it cannot be honored."""
        ours = self._unscaler.scaler if self._unscaler is not None else None
        if scaler is not None and scaler is not ours:
            raise RuntimeError(
                f"GradScaler.step(optimizer) on rank {self._reducer.rank}: with attach_optimizer(overlap=True) the "
                "updates already ran during backward, on the scaled gradients this scaler has just unscaled. Pass "
                "it as attach_optimizer(optimizer, overlap=True, scaler=scaler): each bucket is then unscaled before "
                "its update; keep calling scaler.step(optimizer) and scaler.update()."
            )

    def _check_settings_unchanged(self) -> None:
        """A hyperparameter, a parameter group or a group's parameters changed after backward would be
        ignored: the update already ran with what the optimizer held then."""
        groups, used_groups = self.optimizer.param_groups, self._used
        if used_groups is None:  # the scaler skipped the update: nothing ran to differ from
            return
        rank = self._reducer.rank
        if len(groups) != len(used_groups):
            raise RuntimeError(
                f"optimizer.step() on rank {rank}: the optimizer has {len(groups)} parameter groups, but the update "
                f"that already ran during backward (attach_optimizer(overlap=True)) used {len(used_groups)}; a group "
                f"added or removed after backward would not be stepped as written. {_BEFORE_BACKWARD}"
            )
        for index, (group, used) in enumerate(zip(groups, used_groups, strict=True)):
            if [id(p) for p in group["params"]] != used["params"]:
                raise RuntimeError(
                    f"optimizer.step() on rank {rank}: param_groups[{index}]['params'] holds other parameters than "
                    "when the update already ran during backward (attach_optimizer(overlap=True)); parameters added "
                    f"or removed after backward would not be stepped as written. {_BEFORE_BACKWARD}"
                )
            for key, before in used.items():
                now = group.get(key)
                if key != "params" and not _same(now, before):
                    raise RuntimeError(
                        f"optimizer.step() on rank {rank}: param_groups[{index}][{key!r}] is {now!r}, "
                        f"but the update that already ran during backward (attach_optimizer(overlap=True)) used "
                        f"{before!r}. With overlap=True each bucket is updated as soon as it is reduced: set "
                        "hyperparameters (an lr, an LR scheduler's step()) before backward, or attach without "
                        "overlap=True to have step() use them."
                    )

    def _check_stepped(self, where: str) -> None:
        """An update that ran during backward must be acknowledged by step(): a skipped step cannot be honored."""
        if self._used is not None:
            self._used = None  # said once: the loop may go on
            raise RuntimeError(
                f"{where} on rank {self._reducer.rank}: the last backward already updated the parameters "
                "(attach_optimizer(overlap=True) updates during backward), but optimizer.step() was not called "
                "after it, so that update cannot be skipped. Call step() after every synchronized backward, "
                "accumulate with no_sync() instead of skipping, or attach without overlap=True to skip steps (a "
                "GradScaler skips step() on a non-finite gradient: give it as attach_optimizer(..., scaler=scaler))."
            )

    def _checked_zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        self._check_stepped("optimizer.zero_grad()")
        return self._zero_grad(*args, **kwargs)


def _stepping_scaler() -> object:
    """The enabled GradScaler whose ``step()`` is calling ``optimizer.step()`` now, if any (found by
    its frame: the scaler passes nothing to the step that says it unscaled)."""
    frame = inspect.currentframe()
    while frame is not None:  # once per step: the whole stack (wrappers of step may stand between)
        if frame.f_code is _SCALER_STEP:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


# GradScaler.step -> _maybe_opt_step (only when enabled) -> [wrappers of step] -> the taken-over step.
_SCALER_STEP = torch.amp.grad_scaler.GradScaler._maybe_opt_step.__code__


# What a refusal of a change made after backward tells the user to do instead.
_BEFORE_BACKWARD = (
    "With overlap=True each bucket is updated as soon as it is reduced: change the optimizer's parameter groups "
    "before backward (add_param_group between steps is taken at the next backward), or attach without "
    "overlap=True to have step() use them."
)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group as it is now: its parameters by identity, its hyperparameters by value
    (tensors copied: schedulers write in place)."""
    settings = {key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in group.items() if key != "params"}
    settings["params"] = [id(p) for p in group["params"]]
    return settings


def _same(now: object, before: object) -> bool:
    if isinstance(now, torch.Tensor) and isinstance(before, torch.Tensor):
        return torch.equal(now, before)
    return bool(now == before)
