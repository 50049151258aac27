"""Arming a backward whose forward did not: what a framework does when it decides late to reduce.

OverlapDDP, like DDP, decides in ``forward`` whether the next backward reduces. Lightning's manual
optimization and Accelerate's ``trigger_sync_in_backward`` decide just before the backward instead,
and call DDP's ``reducer.prepare_for_backward`` directly; this is the same step for OverlapDDP.
"""

from __future__ import annotations

from typing import Sequence

import torch

from overlapddp.wrapper import OverlapDDP


def arm_backward_sync(model: OverlapDDP, outputs: Sequence[torch.Tensor], caller: str, rebuild: bool = False) -> None:
    """Make the next backward reduce, as the end of a synchronized forward would have.

    ``outputs`` are what the backward starts from; with ``find_unused_parameters`` they tell which
    parameters take part, as the forward's outputs do. ``rebuild`` first applies a pending bucket
    rebuild, as a forward would: Lightning rebuilds DDP's buckets there, between two backward passes
    of one forward.
    """
    reducer = model._reducer
    if rebuild:
        reducer.prepare_for_forward()
    if reducer.needs_end_of_backward_trigger:
        raise RuntimeError(
            f"{caller}: OverlapDDP with static_graph=True reduces its first iteration when backward "
            "reaches the forward's outputs, so that iteration must come from a synchronized forward; "
            "run the first step with the usual forward, or set static_graph=False."
        )
    model.require_forward_param_sync = True
    reducer.prepare_for_backward(list(outputs))
    if reducer.needs_end_of_backward_trigger:
        raise RuntimeError(
            f"{caller}: with find_unused_parameters=True and a reentrant checkpoint (use_reentrant=True) in "
            "the graph, OverlapDDP reduces when backward reaches the forward's outputs, so the backward must "
            "come from a synchronized forward; use use_reentrant=False, or static_graph=True if the graph "
            "does not change."
        )
