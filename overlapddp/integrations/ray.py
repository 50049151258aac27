"""Ray Train: ``prepare_model`` wraps the model in OverlapDDP where Ray's wraps it in DDP.

::

    from overlapddp.integrations.ray import prepare_model   # instead of ray.train.torch.prepare_model

    def train_func(config):
        model = prepare_model(net, parallel_strategy_kwargs={"bucket_cap_mb": 10})
        ...

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2)).fit()

Ray's own ``prepare_model`` still moves the model to the worker's device (and, in Ray Train V1,
wraps its forward for AMP); only the wrap differs. Everything else in the training function,
``ray.train.report`` with checkpoints and Ray's failure handling included, stays Ray's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from ray.train import get_context
from ray.train.torch import get_device
from ray.train.torch import prepare_model as ray_prepare_model
from torch import nn

from overlapddp.wrapper import OverlapDDP

_WRAPPER_ARGUMENTS = frozenset(inspect.signature(OverlapDDP.__init__).parameters) - {"self", "module"}


def prepare_model(
    model: nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Ray's ``prepare_model``, with :class:`OverlapDDP` for ``parallel_strategy="ddp"``; same arguments.

    ``parallel_strategy_kwargs`` are DDP's keyword arguments, and OverlapDDP's own
    (``bucket_plan="tuned"``). With one worker, or ``parallel_strategy=None``, the model is not
    wrapped, as with Ray's. ``"fsdp"`` is refused: OverlapDDP replaces DDP, not FSDP.
    """
    if parallel_strategy not in ("ddp", None):
        raise ValueError(
            f"overlapddp.integrations.ray.prepare_model: parallel_strategy={parallel_strategy!r} is not supported; "
            "OverlapDDP replaces DistributedDataParallel, so use parallel_strategy='ddp' (or None for no wrap), "
            "or ray.train.torch.prepare_model for FSDP."
        )
    kwargs = _wrapper_kwargs(parallel_strategy_kwargs)
    model = ray_prepare_model(model, move_to_device=move_to_device, parallel_strategy=None)
    if parallel_strategy is None or get_context().get_world_size() == 1:
        return model
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if isinstance(device, list):
        device = device[0]
    if torch.cuda.is_available() and device.type != "cpu":
        kwargs = {"device_ids": [device], "output_device": device, **kwargs}  # as Ray gives DDP
    return OverlapDDP(model, **kwargs)


def _wrapper_kwargs(parallel_strategy_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if parallel_strategy_kwargs is None:
        return {}
    if not isinstance(parallel_strategy_kwargs, dict):
        raise TypeError(
            "overlapddp.integrations.ray.prepare_model: parallel_strategy_kwargs must be a dict of DDP's keyword "
            f"arguments, got {type(parallel_strategy_kwargs).__name__}."
        )
    unknown = sorted(set(parallel_strategy_kwargs) - _WRAPPER_ARGUMENTS)
    if unknown:
        raise TypeError(
            f"overlapddp.integrations.ray.prepare_model: parallel_strategy_kwargs has {', '.join(map(repr, unknown))}, "
            "which is not an argument of DistributedDataParallel or OverlapDDP; it takes "
            f"{', '.join(sorted(_WRAPPER_ARGUMENTS))}."
        )
    return dict(parallel_strategy_kwargs)
