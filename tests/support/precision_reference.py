"""DDP's ``mixed_precision`` casts, written out by hand: the reference where stock DDP cannot run it
(it needs CUDA). Buffers go to ``buffer_dtype`` once; per forward, parameters (and the gradients
they have accumulated) go to ``param_dtype`` copies and floating inputs to ``param_dtype``; per
bucket, in the layout the candidate used, the ``param_dtype`` gradients are flattened, cast to the
reduce dtype, SUM-all-reduced and divided by the world size in it; then the parameters are full
precision again and hold the reduced gradients in their own dtype."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision


class HandWrittenCasts:
    """One replica of ``net`` trained with DDP's mixed-precision casts, spelled out."""

    def __init__(self, net: nn.Module, config: _MixedPrecision) -> None:
        self.net = net
        self.config = config
        self.reduce_dtype = config.reduce_dtype or config.param_dtype
        for buffer in self.net.buffers():
            buffer.data = buffer.to(config.buffer_dtype)

    def forward_backward(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sync_buffers: bool) -> None:
        """Differentiate ``loss_fn(net(*inputs), target)``. ``sync_buffers``: DDP broadcasts buffers
        unless the previous forward ran under no_sync."""
        for buffer in self.net.buffers() if sync_buffers else ():
            dist.broadcast(buffer, 0)
        for p in self.net.parameters():
            if not hasattr(p, "full"):
                p.full = p.data
            if p.grad is not None:
                p.grad.data = p.grad.to(self.config.param_dtype)
            p.data = p.full.to(self.config.param_dtype)
        cast = tuple(x.to(self.config.param_dtype) if x.is_floating_point() else x for x in inputs)
        loss_fn(self.net(*cast), target).backward()

    def reduce(self, layout: list[list[int]]) -> None:
        """All-reduce the gradients bucket by bucket in ``layout`` (indices into the parameters
        that require grad), then restore full-precision parameters holding the reduced gradients."""
        trainable = [p for p in self.net.parameters() if p.requires_grad]
        reduced = {}
        for bucket in layout:
            params = [trainable[i] for i in bucket]
            flat = torch.cat([p.grad.reshape(-1) for p in params]).to(self.reduce_dtype)
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            offset = 0
            for p in params:
                reduced[p] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        for p in self.net.parameters():
            p.data = p.full
            del p.full
            if p in reduced:
                p.grad = reduced[p].to(p.dtype)
