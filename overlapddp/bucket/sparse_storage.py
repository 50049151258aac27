"""Where a sparse gradient lives while it is reduced: in itself, as in DDP.

``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` produce sparse COO gradients, which
cannot share a flat buffer. As in DDP (``shared/reference/ddp_semantics.md`` section 1.2), each such
parameter is alone in its bucket (``layout/plan.py`` gives it no size limit), the bucket's buffer is the
gradient tensor itself, divided in place by the world size when no communication hook is registered,
the collective is a sparse all-reduce, and the reduced value is copied back into that same tensor
(``param.grad`` keeps its identity). ``gradient_as_bucket_view`` changes nothing here: the gradient
already is the bucket.

:class:`SparseBucketStorage` has :class:`~overlapddp.bucket.storage.BucketStorage`'s interface, so
the reducer drives both alike.
"""

from __future__ import annotations

from typing import Sequence

import torch


class SparseBucketStorage:
    """The one-parameter bucket of a sparse gradient: its buffer is ``param.grad`` itself.

    Written by ``copy_in`` during backward (which adopts and divides the gradient), read by the
    bucket's collective, and written back by ``copy_out`` after the fence says complete.
    """

    def __init__(self, index: int, params: Sequence[torch.Tensor], name: str) -> None:
        if len(params) != 1:
            raise ValueError(
                f"Bucket {index} expects a sparse gradient and must hold exactly one parameter, got {len(params)}."
            )
        param = params[0]
        self.index = index
        self.name = name
        self.params = [param]
        # A sparse bucket has no flat layout: GradBucket.gradients() is empty for it, as in DDP.
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.views: list[torch.Tensor] = []
        # Until the first gradient arrives, an empty sparse tensor of the parameter's shape (what a
        # joined rank reduces in its place).
        self.buffer = torch.sparse_coo_tensor(
            torch.empty((1, 0), dtype=torch.int64, device=param.device),
            torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
            param.shape,
            check_invariants=True,
        )

    def copy_in(
        self,
        grads: Sequence[torch.Tensor | None],
        multiply_by: float | None,
        divide_by: float | None,
        alias_divide_by: float | None = None,
    ) -> None:
        """Adopt the gradient as the buffer and divide it in place (true division, as DDP's
        ``div_(div_factor)``, whichever divisor the reducer passes; ``multiply_by`` is the dense
        buckets' scale and unused here); with a communication hook (no divisor) it is left as it is."""
        grad = grads[0]
        if grad is None:
            raise RuntimeError(
                f"Expected the sparse gradient of {self.name} (bucket {self.index}) to be defined; a parameter "
                "that expects a sparse gradient must receive one in every synchronized backward (as in DDP)."
            )
        if grad.layout != torch.sparse_coo:
            raise RuntimeError(
                f"Expected {self.name} (bucket {self.index}) to have a sparse gradient, got a {grad.layout} one. "
                "Its module was built with sparse=True; do not change that after wrapping."
            )
        divisor = divide_by if divide_by is not None else alias_divide_by
        self.buffer = grad
        if divisor is not None:
            with torch.no_grad():
                grad.div_(divisor)

    def drop_aliased_grads(self) -> None:
        """After an abandoned reduction: the gradient is the bucket, which the collective may still write
        (gloo replaces its indices and values on a worker thread): it is set to None."""
        if self.params[0].grad is self.buffer:
            self.params[0].grad = None

    def point_grads_at_views(self) -> list[torch.Tensor]:
        """Nothing to do: the gradient is the bucket (``gradient_as_bucket_view`` included)."""
        return []

    def copy_out(self, result: torch.Tensor, write: Sequence[bool], as_view: bool) -> None:
        """Write the reduced sparse ``result`` into the gradient tensor the bucket adopted."""
        if not write[0] or result is self.buffer:
            return
        if not result.is_sparse:
            raise ValueError(
                f"The reduction of sparse bucket {self.index} ({self.name}) returned a {result.layout} tensor; "
                "a communication hook must return a sparse tensor for a sparse bucket."
            )
        with torch.no_grad():
            self.buffer.copy_(result)
