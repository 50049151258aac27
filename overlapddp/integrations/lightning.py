"""PyTorch Lightning: ``Trainer(strategy="overlap_ddp")`` and ``Fabric(strategy="overlap_ddp")`` train with OverlapDDP.

Importing this module registers ``"overlap_ddp"`` in both of the ``lightning`` package's strategy
registries, the Trainer's and Fabric's::

    import overlapddp.integrations.lightning  # noqa: F401  (registers "overlap_ddp")
    trainer = lightning.pytorch.Trainer(strategy="overlap_ddp", devices=2)
    fabric = lightning.fabric.Fabric(strategy="overlap_ddp", devices=2)

or pass an instance to give DDP's arguments, as with ``DDPStrategy``:
``Trainer(strategy=OverlapDDPStrategy(bucket_cap_mb=10, find_unused_parameters=True))``,
``Fabric(strategy=OverlapDDPFabricStrategy(bucket_cap_mb=10))``. The standalone
``pytorch_lightning`` package has its own registry: ``overlapddp.integrations.pytorch_lightning``.
"""

from __future__ import annotations

from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from overlapddp.integrations.fabric import OverlapDDPFabricStrategy
from overlapddp.integrations.trainer_strategy import (
    STRATEGY_NAME,
    ManualOptimizationRedirection,
    OverlapDDPStrategySteps,
)

__all__ = ["STRATEGY_NAME", "OverlapDDPFabricStrategy", "OverlapDDPStrategy"]


class _OverlapDDPForwardRedirection(ManualOptimizationRedirection, _ForwardRedirection):
    pass


class OverlapDDPStrategy(OverlapDDPStrategySteps, DDPStrategy):
    """``lightning.pytorch``'s ``DDPStrategy`` whose model is an :class:`~overlapddp.OverlapDDP`;
    ``DDPStrategy``'s arguments pass through (:class:`OverlapDDPStrategySteps` says how)."""

    _redirection = _OverlapDDPForwardRedirection
    _register_comm_hook = staticmethod(_register_ddp_comm_hook)


OverlapDDPStrategy.register_strategies(StrategyRegistry)
