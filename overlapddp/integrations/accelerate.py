"""Hugging Face Accelerate: ``accelerator.prepare(model)`` builds OverlapDDP.

::

    from overlapddp.integrations.accelerate import use_overlapddp
    accelerator = use_overlapddp(Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)]))

Everything else stays Accelerate's: ``prepare`` still places the model, wraps its forward for
mixed precision and prepares optimizers and data loaders; ``DistributedDataParallelKwargs`` (its
comm hook included) configure the wrapper; ``accumulate``/``no_sync`` call the wrapper's
``no_sync()``; ``save_state``/``load_state`` save the bare model, as with DDP. Accelerate tests
``isinstance(model, DistributedDataParallel)`` in ``unwrap_model`` and ``trigger_sync_in_backward``;
OverlapDDP is not a subclass (docs/frameworks.md says why), so those two methods are replaced on
this accelerator, together with ``prepare_model``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn

from overlapddp.wrapper import OverlapDDP


def use_overlapddp(accelerator: Accelerator) -> Accelerator:
    """Make ``accelerator`` wrap models with :class:`OverlapDDP` where it would build DDP; returns it.

    Calling it again on the same accelerator changes nothing.
    """
    if getattr(accelerator, "_overlapddp_enabled", False):
        return accelerator
    accelerator.prepare_model = _prepare_model(accelerator, accelerator.prepare_model)
    accelerator.unwrap_model = _unwrap_model(accelerator.unwrap_model)
    accelerator.trigger_sync_in_backward = _trigger_sync_in_backward(accelerator.trigger_sync_in_backward)
    accelerator._overlapddp_enabled = True
    return accelerator


def _builds_ddp(accelerator: Accelerator, model: nn.Module, evaluation_mode: bool) -> bool:
    """Whether Accelerate's ``prepare_model`` would wrap ``model`` in DistributedDataParallel."""
    if evaluation_mode or getattr(model, "_is_accelerate_prepared", False):
        return False
    if not any(p.requires_grad for p in model.parameters()):
        return False
    config = accelerator.parallelism_config
    tensor_parallel = config is not None and config.tp_enabled
    multi_cpu = accelerator.distributed_type == DistributedType.MULTI_CPU
    return not tensor_parallel and (accelerator.multi_device or multi_cpu)  # tensor parallel: Accelerate's own path


def _device_ids(accelerator: Accelerator) -> tuple[list[int | torch.device] | None, int | None]:
    """The ``device_ids`` and ``output_device`` Accelerate gives DDP."""
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        return None, None
    if os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false").lower() == "true":  # as Accelerate reads it
        return None, None
    index = accelerator.device.index if accelerator.device.type == "hpu" else accelerator.local_process_index
    return [index], index


def _prepare_model(accelerator: Accelerator, prepare_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def prepare_overlapddp(
        model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if not _builds_ddp(accelerator, model, evaluation_mode):
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise NotImplementedError(
                "use_overlapddp: Accelerate's torch.compile setting (dynamo_backend) would compile the model "
                "before OverlapDDP wraps it; compile the model yourself before prepare "
                "(OverlapDDP(torch.compile(model)) is bit-equal to DDP(torch.compile(model))) and leave "
                "dynamo_backend unset."
            )
        # Accelerate's own preparation without its DDP wrap: placement, mixed-precision forward.
        model = prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        del model._is_accelerate_prepared  # the wrapper carries it, as DDP does
        handler = accelerator.ddp_handler
        device_ids, output_device = _device_ids(accelerator)
        kwargs = handler.to_kwargs() if handler is not None else {}
        wrapper = OverlapDDP(model, device_ids=device_ids, output_device=output_device, **kwargs)
        if handler is not None:
            handler.register_comm_hook(wrapper)
        # nn.Module.__setattr__ is typed for tensors and modules; Accelerate reads this flag.
        wrapper._is_accelerate_prepared = True  # type: ignore[assignment]
        return wrapper

    return prepare_overlapddp


def _unwrap_model(unwrap_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def unwrap_overlapddp(
        model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        if isinstance(model, OverlapDDP):
            model = model.module
        return unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    return unwrap_overlapddp


def _trigger_sync_in_backward(trigger: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
    @contextmanager
    def trigger_overlapddp(model: nn.Module) -> Iterator[None]:
        """The next backward reduces, although its forward ran under ``no_sync`` (Accelerate's semantics)."""
        if not isinstance(model, OverlapDDP):
            with trigger(model):
                yield
            return
        if model.find_unused_parameters:
            raise ValueError(
                "Accelerator.trigger_sync_in_backward with find_unused_parameters=True: the forward ran "
                "without synchronization, so the parameters it used are unknown; run the forward outside "
                "no_sync instead."
            )
        previous = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = True
        model.arm_backward([], caller="Accelerator.trigger_sync_in_backward")
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = previous

    return trigger_overlapddp
