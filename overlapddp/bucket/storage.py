"""Where gradients live while they are reduced: one flat buffer per bucket, a view per parameter.

Copy-in scales while copying (DDP's ``mul_out`` with the reciprocal of the world size, computed in
double), so the values entering the collective are bit-identical to DDP's. Copy-out writes the
reduced values into ``param.grad``, keeping the parameter's strides as DDP does.
"""

from __future__ import annotations

from typing import Sequence

import torch

from overlapddp.torch_compat import foreach_copy_, foreach_div_, foreach_mul_


def is_dense_permutation(tensor: torch.Tensor) -> bool:
    """True when the tensor covers exactly ``numel`` elements in some dimension order.

    Such a parameter keeps its own strides inside the bucket (channels_last stays channels_last).
    """
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def strided_view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` at ``offset`` with the shape (and, where possible, strides) of ``like``."""
    if is_dense_permutation(like):
        return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)
    return flat.narrow(0, offset, like.numel()).view(like.shape)


class BucketStorage:
    """The flat buffer of one bucket and the per-parameter views into it.

    Produced by the reducer when a plan takes effect; written by ``copy_in`` during backward,
    read by the bucket's collective, and read by ``copy_out`` after the fence says complete.
    """

    def __init__(self, index: int, params: Sequence[torch.Tensor]) -> None:
        first = params[0]
        for param in params:
            if param.device != first.device or param.dtype != first.dtype:
                raise ValueError(
                    f"All parameters in bucket {index} must share one device and dtype; found "
                    f"{first.dtype} on {first.device} and {param.dtype} on {param.device}."
                )
        self.index = index
        self.params = list(params)
        self.lengths = [p.numel() for p in params]
        self.offsets = []
        total = 0
        for length in self.lengths:
            self.offsets.append(total)
            total += length
        self.buffer = torch.empty(total, dtype=first.dtype, device=first.device)
        self.views = [strided_view(self.buffer, p, off) for p, off in zip(params, self.offsets, strict=True)]

    def aliases(self, slot: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` already is this slot's view (``gradient_as_bucket_view`` after a sync)."""
        view = self.views[slot]
        return (
            grad is not None
            and grad.data_ptr() == view.data_ptr()
            and grad.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        )

    def copy_in(
        self,
        grads: Sequence[torch.Tensor | None],
        multiply_by: float | None,
        divide_by: float | None,
        alias_divide_by: float | None = None,
    ) -> None:
        """Copy every local gradient into the buffer (zeros for ``None``), then scale it.

        One batched copy and one flat multiply give the same bits as DDP's per-parameter
        ``mul_out(view, grad, 1/ws)``: each element is one float multiply by the same scalar.
        ``divide_by`` is DDP's true division of the whole buffer (``batched_grad_copy``).
        Gradients that already are their slot's view (``gradient_as_bucket_view``) are not copied;
        DDP divides those in place by ``alias_divide_by`` instead of multiplying.
        """
        aliased = [self.aliases(slot, grad) for slot, grad in enumerate(grads)]
        copied = [
            (view, grad)
            for view, grad, alias in zip(self.views, grads, aliased, strict=True)
            if grad is not None and not alias
        ]
        with torch.no_grad():
            for view, grad in zip(self.views, grads, strict=True):
                if grad is None:
                    view.zero_()
            if copied:
                foreach_copy_([v for v, _ in copied], [g for _, g in copied])
            if not any(aliased):
                if multiply_by is not None:
                    self.buffer.mul_(multiply_by)
            else:
                if multiply_by is not None and copied:
                    foreach_mul_([v for v, _ in copied], multiply_by)
                if alias_divide_by is not None:
                    foreach_div_([v for v, a in zip(self.views, aliased, strict=True) if a], alias_divide_by)
            if divide_by is not None:
                self.buffer.div_(divide_by)

    def drop_aliased_grads(self) -> None:
        """After an abandoned reduction: a ``param.grad`` that is this bucket's view is set to None, since
        the collective may still write it (its value is undefined) and a later accumulation would race it."""
        for slot, param in enumerate(self.params):
            if self.aliases(slot, param.grad):
                param.grad = None

    def point_grads_at_views(self) -> list[torch.Tensor]:
        """Make each defined ``param.grad`` its bucket view (``gradient_as_bucket_view``); returns the
        gradients it replaced."""
        replaced = []
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is not None and param.grad is not view:
                replaced.append(param.grad)
                param.grad = view
        return replaced

    def copy_out(self, result: torch.Tensor, write: Sequence[bool], as_view: bool) -> None:
        """Write the reduced flat ``result`` into the ``.grad`` of every parameter marked in ``write``.

        With ``as_view`` the bucket views are the gradients: the result is copied into them when a
        hook returned another tensor, and an undefined gradient becomes its view.
        """
        chosen = [i for i, w in enumerate(write) if w]
        if result is self.buffer:
            reduced = [self.views[i] for i in chosen]
        else:
            reduced = [strided_view(result, self.params[i], self.offsets[i]) for i in chosen]
        with torch.no_grad():
            if as_view:
                if result is not self.buffer and chosen:
                    foreach_copy_([self.views[i] for i in chosen], reduced)
                for i in chosen:
                    if self.params[i].grad is None:
                        self.params[i].grad = self.views[i]
                return
            for i in chosen:
                if self.params[i].grad is None:
                    self.params[i].grad = _empty_like_param(self.params[i])
            if chosen:
                foreach_copy_([self.params[i].grad for i in chosen], reduced)


def _empty_like_param(param: torch.Tensor) -> torch.Tensor:
    """A new gradient tensor with the parameter's strides when it is dense (the gradient layout contract)."""
    if is_dense_permutation(param):
        return torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
    return torch.empty(param.shape, dtype=param.dtype, device=param.device)
