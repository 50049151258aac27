"""The Lightning Trainer's DDP strategy with OverlapDDP: the steps both Lightning packages share.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` ship the same ``DDPStrategy`` under two
package names, so a strategy class must derive from the one the user's Trainer comes from. The
steps that differ from DDP's live here, once, as mixins that import no Lightning package;
``overlapddp.integrations.lightning`` and ``overlapddp.integrations.pytorch_lightning`` put each
in front of its package's ``DDPStrategy`` and ``_ForwardRedirection``.

``DDPStrategy`` tests ``isinstance(model, DistributedDataParallel)`` before each DDP-specific step;
OverlapDDP is not a subclass (docs/frameworks.md says why), so each of those steps is overridden:
building the wrapper, registering comm hooks, manual optimization's late arming of the reduction,
and unwrapping at teardown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from overlapddp.device_streams import side_stream
from overlapddp.wrapper import OverlapDDP

if TYPE_CHECKING:  # for the type checker only: at run time each package's module supplies the base
    from lightning.pytorch.strategies import DDPStrategy as _StrategyBase
else:
    _StrategyBase = object

STRATEGY_NAME = "overlap_ddp"


class OverlapDDPStrategySteps(_StrategyBase):
    """Put in front of a Lightning ``DDPStrategy``: its model is an :class:`OverlapDDP`.

    DDP's own arguments (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...) and
    OverlapDDP's extras (``bucket_plan="tuned"``) go to the wrapper as keyword arguments;
    ``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper`` register a comm hook on any device
    (``DDPStrategy`` registers them on CUDA only; OverlapDDP runs them on gloo too).

    A concrete class sets ``_redirection`` (its package's ``_ForwardRedirection`` with
    :class:`ManualOptimizationRedirection` in front) and ``_register_comm_hook`` (its package's
    ``_register_ddp_comm_hook``, as a staticmethod).
    """

    strategy_name = STRATEGY_NAME
    _redirection: Callable[[], Any]
    _register_comm_hook: Callable[..., None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = self._redirection()

    # DDPStrategy types its wrapper as DistributedDataParallel; OverlapDDP is its drop-in, not a subclass.
    def _setup_model(self, model: nn.Module) -> OverlapDDP:  # type: ignore[override]
        if not getattr(model, "automatic_optimization", True):
            _check_manual_optimization(self._ddp_kwargs)
        ids = self.determine_ddp_device_ids()
        device_ids: list[int | torch.device] | None = None if ids is None else list(ids)
        # As DDPStrategy does: build the wrapper on a side stream on CUDA (ordered with the current one).
        with side_stream(device_ids is not None):
            return OverlapDDP(model, device_ids=device_ids, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            self._register_comm_hook(
                model=self.model,  # an OverlapDDP: it registers hooks as DDP does
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
            model.arm_backward([closure_loss], caller=f"{type(self).__name__}.pre_backward", rebuild=True)
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
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME, cls, description="DDP with OverlapDDP as the wrapper", start_method="popen", override=True
        )


class ManualOptimizationRedirection:
    """Put in front of a Lightning ``_ForwardRedirection``. Manual optimization calls backward inside the
    wrapper's forward: keep that forward from arming the reduction (``pre_backward`` arms it per
    backward instead), as Lightning does for DDP."""

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        if isinstance(wrapper_module, OverlapDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        if isinstance(wrapper_module, OverlapDDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


def _check_manual_optimization(ddp_kwargs: dict[str, Any]) -> None:
    if ddp_kwargs.get("static_graph"):
        raise ValueError(
            "OverlapDDPStrategy(static_graph=True) with manual optimization: the static graph's first "
            "iteration is reduced when backward reaches the forward's outputs, and manual optimization "
            "runs backward inside the forward. Use static_graph=False, or automatic optimization."
        )
