"""PyTorch Lightning: ``Trainer(strategy="overlap_ddp")`` trains with OverlapDDP.

Importing this module registers ``OverlapDDPStrategy`` in Lightning's strategy registry::

    import overlapddp.integrations.lightning  # noqa: F401  (registers "overlap_ddp")
    trainer = lightning.pytorch.Trainer(strategy="overlap_ddp", devices=2)

or pass an instance to give DDP's arguments, as with ``DDPStrategy``:
``Trainer(strategy=OverlapDDPStrategy(bucket_cap_mb=10, find_unused_parameters=True))``.

``DDPStrategy`` tests ``isinstance(model, DistributedDataParallel)`` before each DDP-specific step;
OverlapDDP is not a subclass (docs/frameworks.md says why), so each of those steps is overridden
here: building the wrapper, registering comm hooks, manual optimization's late arming of the
reduction, and unwrapping at teardown.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch import LightningModule
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import nn

from overlapddp.integrations.backward_sync import arm_backward_sync
from overlapddp.wrapper import OverlapDDP

STRATEGY_NAME = "overlap_ddp"


class OverlapDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose model is an :class:`OverlapDDP`; ``DDPStrategy``'s arguments pass through.

    DDP's own arguments (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...) and
    OverlapDDP's extras (``bucket_plan="tuned"``) go to the wrapper as keyword arguments;
    ``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper`` register a comm hook on any device
    (``DDPStrategy`` registers them on CUDA only; OverlapDDP runs them on gloo too).
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = _OverlapDDPForwardRedirection()

    # DDPStrategy types its wrapper as DistributedDataParallel; OverlapDDP is its drop-in, not a subclass.
    def _setup_model(self, model: nn.Module) -> OverlapDDP:  # type: ignore[override]
        if isinstance(model, LightningModule) and not model.automatic_optimization:
            _check_manual_optimization(self._ddp_kwargs)
        ids = self.determine_ddp_device_ids()
        device_ids: list[int | torch.device] | None = None if ids is None else list(ids)
        # As DDPStrategy does: build the wrapper on a side stream on CUDA.
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return OverlapDDP(model, device_ids=device_ids, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            _register_ddp_comm_hook(
                model=self.model,  # type: ignore[arg-type]  # an OverlapDDP: it registers hooks as DDP does
                ddp_comm_state=self._ddp_comm_state,
                ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization: the forward did not arm the reduction; arm it from the loss, as DDP's does."""
        model, module = self.model, self.lightning_module
        if not isinstance(model, OverlapDDP) or module is None or module.automatic_optimization:
            return
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            arm_backward_sync(model, [closure_loss], caller=f"{type(self).__name__}.pre_backward", rebuild=True)
        else:
            model.require_forward_param_sync = False

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """DDPStrategy's only step here is DDP's static-graph flush, which OverlapDDP does itself."""

    def teardown(self) -> None:
        # DDPStrategy unwraps only a DistributedDataParallel; a later trainer.test() or fit() needs
        # the bare LightningModule.
        if isinstance(self.model, OverlapDDP):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            STRATEGY_NAME, cls, description="DDP with OverlapDDP as the wrapper", start_method="popen", override=True
        )


class _OverlapDDPForwardRedirection(_ForwardRedirection):
    """Manual optimization calls backward inside the wrapper's forward: keep that forward from arming
    the reduction (``pre_backward`` arms it per backward instead), as Lightning does for DDP."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        if isinstance(wrapper_module, OverlapDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        if isinstance(wrapper_module, OverlapDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


def _check_manual_optimization(ddp_kwargs: dict[str, Any]) -> None:
    if ddp_kwargs.get("static_graph"):
        raise ValueError(
            "OverlapDDPStrategy(static_graph=True) with manual optimization: the static graph's first "
            "iteration is reduced when backward reaches the forward's outputs, and manual optimization "
            "runs backward inside the forward. Use static_graph=False, or automatic optimization."
        )


OverlapDDPStrategy.register_strategies(StrategyRegistry)
