"""The standalone ``pytorch_lightning`` package: ``Trainer(strategy="overlap_ddp")`` trains with OverlapDDP.

The same strategy as ``overlapddp.integrations.lightning``'s, for users who import
``pytorch_lightning`` instead of ``lightning.pytorch`` (the two packages keep separate classes and
registries). Importing this module registers ``"overlap_ddp"`` in ``pytorch_lightning``'s registry::

    import overlapddp.integrations.pytorch_lightning  # noqa: F401  (registers "overlap_ddp")
    trainer = pytorch_lightning.Trainer(strategy="overlap_ddp", devices=2)

or ``Trainer(strategy=OverlapDDPStrategy(bucket_cap_mb=10))`` with DDP's arguments.
"""

from __future__ import annotations

from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.strategies.strategy import _ForwardRedirection

from overlapddp.integrations.trainer_strategy import (
    STRATEGY_NAME,
    ManualOptimizationRedirection,
    OverlapDDPStrategySteps,
)

__all__ = ["STRATEGY_NAME", "OverlapDDPStrategy"]


class _OverlapDDPForwardRedirection(ManualOptimizationRedirection, _ForwardRedirection):
    pass


class OverlapDDPStrategy(OverlapDDPStrategySteps, DDPStrategy):  # type: ignore[misc]
    """``pytorch_lightning``'s ``DDPStrategy`` whose model is an :class:`~overlapddp.OverlapDDP`;
    ``DDPStrategy``'s arguments pass through (:class:`OverlapDDPStrategySteps` says how)."""

    _redirection = _OverlapDDPForwardRedirection
    _register_comm_hook = staticmethod(_register_ddp_comm_hook)


OverlapDDPStrategy.register_strategies(StrategyRegistry)
