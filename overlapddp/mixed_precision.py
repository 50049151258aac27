"""Mixed precision as DDP's ``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``.

The same casts as DDP (``nn/parallel/distributed.py`` and ``ddp_comm_hooks/mixed_precision_hooks.py``):

- buffers are cast to ``buffer_dtype`` once, at construction (all of them, as DDP does);
- each forward swaps every parameter's ``.data`` for a ``param_dtype`` copy of its full-precision
  value, casts an accumulated ``.grad`` to ``param_dtype`` and casts floating inputs to ``param_dtype``,
  so forward and backward run in ``param_dtype`` and gradients arrive in ``param_dtype``;
- each bucket is cast to the reduce dtype (``reduce_dtype``, else ``param_dtype``), SUM-all-reduced, then
  divided by the world size in that dtype; its parameters get their full-precision ``.data`` back and
  their gradients are cast up before the reduced values are copied in, so the optimizer updates
  full-precision parameters with full-precision gradients.

Unlike DDP it needs no CUDA stream (DDP's fails on CPU), waits for nothing inside the hook (DDP's
waits for each bucket's all-reduce there), and returns parameters to full precision after a forward
without gradients. The reducer's buckets keep the parameters' full dtype: a ``param_dtype`` gradient
copied into them is exact, so the cast to the reduce dtype gives DDP's bits.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from overlapddp.fence import Fence
from overlapddp.torch_compat import in_backward, queue_callback


class MixedPrecision:
    """DDP's three dtypes, read from a ``_MixedPrecision`` (or any object with those attributes)."""

    def __init__(self, config: Any) -> None:
        missing = [name for name in ("param_dtype", "reduce_dtype", "buffer_dtype") if not hasattr(config, name)]
        if missing:
            raise TypeError(
                "mixed_precision must be torch.nn.parallel.distributed._MixedPrecision(param_dtype, reduce_dtype, "
                f"buffer_dtype); got {config!r}, without {', '.join(missing)}."
            )
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(config, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"mixed_precision.{name} must be a floating torch.dtype or None, got {value!r}.")
        self.param_dtype: torch.dtype | None = config.param_dtype
        self.buffer_dtype: torch.dtype | None = config.buffer_dtype
        # DDP reduces in param_dtype when reduce_dtype is None (and in the bucket's dtype without either).
        self.reduce_dtype: torch.dtype | None = config.reduce_dtype or config.param_dtype

    def cast_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Once, at construction: every buffer to ``buffer_dtype`` (in place of its data, as DDP)."""
        for buffer in buffers:
            buffer.data = buffer.to(dtype=self.buffer_dtype)

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """A floating input in ``param_dtype``; anything else unchanged."""
        if self.param_dtype is None or not tensor.is_floating_point() or tensor.dtype == self.param_dtype:
            return tensor
        return tensor.to(self.param_dtype)


class ParameterCasts:
    """Which parameters hold their ``param_dtype`` copy now, and their full-precision values.

    ``to_low`` runs at the start of each forward; ``to_full`` runs per bucket from the reduction hook
    (its gradients are in the bucket by then) and for all the rest at the end of a synchronized
    backward or after a forward without gradients.

    Each swap drops tensors that streams may still read (on CUDA: the hook's cast on the communication
    stream, backward's kernels): ``fence()`` keeps them for the current stream, which the reduction
    hook and the end-of-backward callback run on after backward's streams.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], param_dtype: torch.dtype | None, fence: Callable[[], Fence] = Fence
    ) -> None:
        self.params = list(params)
        self._param_dtype = param_dtype
        self._full: dict[int, torch.Tensor] = {}  # id(param) -> its full-precision data while swapped
        self._fence = fence

    def to_low(self) -> None:
        """Every parameter computes in ``param_dtype`` from its full-precision value; an accumulated
        gradient (``no_sync``, or not zeroed) is cast down too, as DDP does."""
        dropped = []
        with torch.no_grad():
            for param in self.params:
                if id(param) in self._full:  # still swapped: its low-precision copy is replaced
                    dropped.append(param.data)
                full = self._full.setdefault(id(param), param.data)
                dtype = full.dtype if self._param_dtype is None else self._param_dtype
                if param.grad is not None:
                    dropped.append(param.grad.data)
                    param.grad.data = param.grad.to(dtype)
                param.data = full.to(dtype, copy=True)
        self._fence().keep_for_current_stream(dropped)

    def to_full(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """``params`` (default: all still swapped) get their full-precision data back; their gradients
        are cast up to it."""
        dropped = []
        with torch.no_grad():
            for param in self.params if params is None else params:
                full = self._full.pop(id(param), None)
                if full is None:
                    continue
                dropped.append(param.data)
                param.data = full
                if param.grad is not None:
                    dropped.append(param.grad.data)
                    param.grad.data = param.grad.to(full.dtype)
        self._fence().keep_for_current_stream(dropped)


class ReduceInPrecision:
    """The comm hook state: the reduce dtype, the group and the casts to undo per bucket."""

    def __init__(self, config: MixedPrecision, casts: ParameterCasts, process_group: dist.ProcessGroup) -> None:
        self.reduce_dtype = config.reduce_dtype
        self.casts = casts
        self.process_group = process_group
        self._end_queued = False  # the end-of-backward restore is queued for the current backward

    def restore_at_end_of_backward(self) -> None:
        """Queue, once per backward, the return of every parameter still in ``param_dtype`` (frozen
        ones, which backward may need until its end) to full precision."""
        if self._end_queued or not in_backward():
            return
        self._end_queued = True
        queue_callback(self._restore_all)

    def _restore_all(self) -> None:
        self._end_queued = False
        self.casts.to_full()


def reduce_in_precision_hook(state: ReduceInPrecision, bucket: Any) -> Future[torch.Tensor]:
    """Cast the bucket to the reduce dtype, SUM-all-reduce it, divide by the world size in that dtype
    (DDP's ``_reducer_allreduce_and_upcast_hook``); the bucket's parameters return to full precision."""
    buffer = bucket.buffer() if state.reduce_dtype is None else bucket.buffer().to(state.reduce_dtype)
    state.casts.to_full(bucket.parameters())
    state.restore_at_end_of_backward()
    world_size = state.process_group.size()
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0].div_(world_size))


# A marker attribute on the function, read by comm_hook.is_unchained (mypy does not model function attributes).
reduce_in_precision_hook.issues_one_collective = True  # type: ignore[attr-defined]
