"""Uneven inputs: ranks that ran out of data shadow the others' collectives, in DDP's order.

Used through ``torch.distributed.algorithms.Join`` (``model.join()`` returns one). Per iteration a
rank still training issues, in order: the join notification (all-reduce of 1), a pending bucket
rebuild (broadcast), the buffer broadcast from the highest rank still training (all-reduce MAX,
broadcast), the "will this backward sync" flag (all-reduce), then its buckets in index order and,
with ``find_unused_parameters``, the usage map. A joined rank issues the same sequence with zeros.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook


class JoinedModel(Protocol):
    """What the join hook uses of the wrapper: this interface and nothing else of it."""

    process_group: dist.ProcessGroup
    device: torch.device
    forward_sync_buffers: bool
    require_forward_param_sync: bool
    _divide_by_initial_world_size: bool

    def will_sync_module_buffers(self) -> bool: ...

    def _broadcast_buffers(self, source: int) -> None: ...

    def _broadcast_state(self, source: int, with_buffers: bool) -> None: ...

    def _shadow_forward(self) -> None: ...

    def _shadow_backward(self) -> None: ...


def common_rank(model: JoinedModel, candidate: bool) -> int:
    """The highest rank for which ``candidate`` holds (every rank must call this together)."""
    rank = dist.get_rank(model.process_group)
    chosen = torch.tensor([rank if candidate else -1], device=model.device)
    dist.all_reduce(chosen, op=dist.ReduceOp.MAX, group=model.process_group)
    if chosen.item() < 0:
        raise RuntimeError("No rank qualified as the source of the model state; every rank passed False.")
    return int(chosen.item())


def announce_backward_sync(model: JoinedModel, will_sync: bool) -> bool:
    """All-reduce whether any rank still training will reduce gradients in its next backward."""
    flag = torch.tensor([1.0 if will_sync else 0.0], device=model.device)
    dist.all_reduce(flag, group=model.process_group)
    return bool(flag.item() != 0)


class OverlapJoinHook(JoinHook):
    """What a joined rank does each iteration, and how the final model is agreed on."""

    def __init__(self, model: JoinedModel, divide_by_initial_world_size: bool) -> None:
        self.model = model
        model._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks that still have data."""
        model = self.model
        model._shadow_forward()
        if model.will_sync_module_buffers():
            model._broadcast_buffers(common_rank(model, False))
        should_sync = announce_backward_sync(model, False)
        model.require_forward_param_sync = should_sync
        if should_sync:
            model._shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and buffers) of the last rank to join."""
        model = self.model
        source = common_rank(model, is_last_joiner)
        model._broadcast_state(source, with_buffers=model.forward_sync_buffers)
