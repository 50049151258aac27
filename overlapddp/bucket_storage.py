"""Where gradients live while they are reduced: one flat buffer per bucket, a view per parameter.

Copy-in scales while copying (DDP's ``mul_out`` with the reciprocal of the world size, computed in
double), so the values entering the collective are bit-identical to DDP's. Copy-out writes the
reduced values into ``param.grad``, keeping the parameter's strides as DDP does.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _is_dense_permutation(tensor: torch.Tensor) -> bool:
    """True when the tensor covers exactly ``numel`` elements in some dimension order.

    Such a parameter keeps its own strides inside the bucket (channels_last stays channels_last).
    """
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def strided_view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` at ``offset`` with the shape (and, where possible, strides) of ``like``."""
    if _is_dense_permutation(like):
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
        self.views = [strided_view(self.buffer, p, off) for p, off in zip(params, self.offsets)]

    def copy_in(
        self, grads: Sequence[torch.Tensor | None], multiply_by: float | None, divide_by: int | None
    ) -> None:
        """Copy every local gradient into the buffer (zeros for ``None``), then scale the whole buffer.

        One batched copy and one flat multiply give the same bits as DDP's per-parameter
        ``mul_out(view, grad, 1/ws)``: each element is one float multiply by the same scalar.
        ``divide_by`` is DDP's true division (``batched_grad_copy``), which rounds differently.
        """
        present = [(view, grad) for view, grad in zip(self.views, grads) if grad is not None]
        with torch.no_grad():
            if len(present) < len(self.views):
                self.buffer.zero_()
            if present:
                torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
            if multiply_by is not None:
                self.buffer.mul_(multiply_by)
            if divide_by is not None:
                self.buffer.div_(divide_by)

    def copy_out(self, result: torch.Tensor) -> None:
        """Write the reduced flat ``result`` into every parameter's ``.grad``."""
        if result is self.buffer:
            reduced_views = self.views
        else:
            reduced_views = [strided_view(result, p, off) for p, off in zip(self.params, self.offsets)]
        with torch.no_grad():
            for param, reduced in zip(self.params, reduced_views):
                if param.grad is None:
                    param.grad = _empty_like_param(param)
            grads = [p.grad for p in self.params]
            torch._foreach_copy_(grads, reduced_views)


def _empty_like_param(param: torch.Tensor) -> torch.Tensor:
    """A new gradient tensor with the parameter's strides when it is dense (the gradient layout contract)."""
    if _is_dense_permutation(param):
        return torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
    return torch.empty(param.shape, dtype=param.dtype, device=param.device)
