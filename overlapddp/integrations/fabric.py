"""Lightning Fabric: ``Fabric(strategy="overlap_ddp")`` sets models up with OverlapDDP.

``import overlapddp.integrations.lightning`` imports this module, which registers the name in
Fabric's strategy registry; ``OverlapDDPFabricStrategy(**ddp_kwargs)`` is the instance form.

Fabric's ``DDPStrategy`` tests ``isinstance(module, DistributedDataParallel)`` in three places, each
overridden here: ``no_backward_sync`` (which raises ``TypeError`` for any other wrapper) and the
module state dicts behind ``fabric.save``/``fabric.load`` (which would keep the ``module.`` prefix).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from overlapddp.device_streams import side_stream
from overlapddp.integrations.trainer_strategy import STRATEGY_NAME
from overlapddp.wrapper import OverlapDDP


class OverlapDDPFabricStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` whose modules are :class:`OverlapDDP`; its arguments pass through.

    Keyword arguments beyond Fabric's own (``bucket_cap_mb``, ``find_unused_parameters``,
    ``static_graph``, OverlapDDP's ``bucket_plan``, ...) go to the wrapper, as Fabric's DDP strategy
    passes them to DDP.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _OverlapDDPBackwardSyncControl()

    # Fabric types its wrapper as DistributedDataParallel; OverlapDDP is its drop-in, not a subclass.
    def setup_module(self, module: nn.Module) -> OverlapDDP:  # type: ignore[override]
        ids = self._determine_ddp_device_ids()
        device_ids: list[int | torch.device] | None = None if ids is None else list(ids)
        # As DDPStrategy does: build the wrapper on a side stream on CUDA (ordered with the current one).
        with side_stream(device_ids is not None):
            return OverlapDDP(module, device_ids=device_ids, **self._ddp_kwargs)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return super().get_module_state_dict(_unwrapped(module))

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrapped(module), state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            STRATEGY_NAME, cls, description="DDP with OverlapDDP as the wrapper", start_method="popen", override=True
        )


class _OverlapDDPBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """``fabric.no_backward_sync(model)``: the wrapper's ``no_sync()``, as Fabric does for DDP."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, OverlapDDP):
            raise TypeError(
                "OverlapDDPFabricStrategy.no_backward_sync needs the module that fabric.setup wrapped in "
                f"OverlapDDP; got {type(module).__name__}. Pass the model fabric.setup returned."
            )
        return module.no_sync()


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, OverlapDDP) else module


OverlapDDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)
