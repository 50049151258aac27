"""The communication hooks the parity tests register, each named in one place.

A :class:`HookSpec` says how to build the hook's state (called once per wrapper, so stock DDP and
OverlapDDP get equal but separate states), which hook to register, and, only where stock DDP cannot
run that very hook on CPU/gloo, what DDP runs instead and why.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, quantization_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager


@dataclass(frozen=True)
class HookSpec:
    """One hook as both wrappers get it."""

    # Builds the hook state; called once per wrapper, in the same order on every rank.
    state: Callable[[], Any]
    # A hook for ``register_comm_hook``, or a type for ``_register_builtin_comm_hook``.
    hook: Callable | dist.BuiltinCommHookType
    # What stock DDP registers instead of ``hook``; None means the same hook.
    reference: Callable | None = None
    # Builds a model averager that is stepped after ``optimizer.step()`` on both wrappers.
    averager: Callable[[], Any] | None = None


def register(wrapper: nn.Module, spec: HookSpec, is_reference: bool) -> Any:
    """Register the spec's hook on ``wrapper`` with a fresh state; returns its averager, if any."""
    if isinstance(spec.hook, dist.BuiltinCommHookType):
        wrapper._register_builtin_comm_hook(spec.hook)
    else:
        hook = spec.reference if is_reference and spec.reference is not None else spec.hook
        wrapper.register_comm_hook(spec.state(), hook)
    return spec.averager() if spec.averager is not None else None


def synchronous(hook: Callable) -> Callable:
    """``hook``, returning only after every collective of its ``.then`` chain has finished.

    PowerSGD and the quantization hooks issue their follow-up collectives from completion callbacks.
    With several buckets in flight, stock DDP on gloo can then issue them in a different order on
    different ranks: on torch 2.14.1, ws=3 and ten buckets, ``powerSGD_hook`` hangs or fails.
    DDP calls hooks in bucket order on the autograd thread, so with this wrapper every rank runs
    bucket b's whole chain before bucket b+1's hook starts: the same collectives, on the same
    buffers, with the same arithmetic as the unwrapped hook. OverlapDDP runs the unwrapped hook and
    must produce the same numbers.
    """

    def synchronous_hook(state, bucket):  # no annotations: DDP compares them as objects, not strings
        future = hook(state, bucket)
        future.wait()
        return future

    synchronous_hook.__qualname__ = f"synchronous({getattr(hook, '__qualname__', hook)})"
    return synchronous_hook


def renamed(hook: Callable, name: str) -> Callable:
    """``hook`` under another ``__name__``, to pass DDP's name-based bf16 check.

    DDP's ``_check_comm_hook`` refuses hooks *named* ``bf16_compress_hook`` or
    ``bf16_compress_wrapper_hook`` unless torch was built with CUDA and NCCL >= 2.10 (it does not
    look at the backend or the device), so on a CPU-only build DDP rejects them even on gloo, which
    reduces bfloat16 fine. The alias runs the identical stock code, so DDP is still the reference.
    """

    def alias(state, bucket):  # no annotations, as in ``synchronous``
        return hook(state, bucket)

    alias.__name__ = alias.__qualname__ = name
    return alias


def with_globals(hook: Callable, **names: Any) -> Callable:
    """The same stock code, with some of its module-level names replaced (for both wrappers alike).

    Callbacks the hook defines while it runs see the replacements too; nothing is patched globally.
    """
    adapted = types.FunctionType(
        hook.__code__, {**hook.__globals__, **names}, hook.__name__, hook.__defaults__, hook.__closure__
    )
    adapted.__qualname__ = hook.__qualname__
    adapted.__annotations__ = dict(hook.__annotations__)
    return adapted


class _StackedAllGather:
    """``torch.distributed`` whose ``all_gather`` future holds ``[stacked outputs]``, as on NCCL.

    The quantization hooks index ``fut.wait()[0]`` as one ``(world_size, ...)`` tensor, which is
    what NCCL's all-gather future holds; gloo's holds the list of outputs, so the stock hooks fail
    on gloo in stock DDP and OverlapDDP alike (``test_stock_quantization_hooks_fail_alike_on_gloo``).
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_gather(outputs: list, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        work = dist.all_gather(outputs, tensor, group=group, async_op=async_op)
        return types.SimpleNamespace(get_future=lambda: work.get_future().then(lambda f: [torch.stack(f.value())]))


def _orthogonalize_one(matrix: torch.Tensor, epsilon: float = 0) -> None:
    """``_orthogonalize`` for one 2-D matrix: ``batched_powerSGD_hook`` in torch 2.14 passes 2-D
    matrices to the batched ``_orthogonalize``, whose shape assertion then fails in stock DDP and
    OverlapDDP alike (``test_stock_batched_powersgd_fails_alike``); this keeps its arithmetic."""
    power_sgd._orthogonalize(matrix.unsqueeze(0), epsilon)


def _none() -> None:
    return None


def _world() -> dist.ProcessGroup:
    return dist.group.WORLD


def _power_sgd_state() -> power_sgd.PowerSGDState:
    return power_sgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, warm_start=True, random_seed=0
    )


def _pairs() -> dist.ProcessGroup:
    """The subgroup of this rank among (0, 1), (2, 3), ... (a lone last rank at odd world sizes).

    ``PostLocalSGDState(subgroup=None)`` would create intra-node subgroups with
    ``dist.new_subgroups()``, which needs an accelerator to size them and raises on CPU in stock
    DDP and OverlapDDP alike; an explicit subgroup keeps the local phase meaningful on gloo.
    Creating it is collective: every rank builds the states in the same order.
    """
    world = dist.get_world_size()
    subgroup, _ = dist.new_subgroups_by_enumeration([list(range(r, min(r + 2, world))) for r in range(0, world, 2)])
    return subgroup


def _post_local_sgd_state() -> post_local_sgd.PostLocalSGDState:
    return post_local_sgd.PostLocalSGDState(process_group=None, subgroup=_pairs(), start_localSGD_iter=2)


def _averager() -> PeriodicModelAverager:
    return PeriodicModelAverager(period=2, warmup_steps=2)


_allreduce = default_hooks.allreduce_hook
_bf16_hook = default_hooks.bf16_compress_hook
_bf16_wrapped_allreduce = default_hooks.bf16_compress_wrapper(_allreduce)
_pertensor = with_globals(quantization_hooks.quantization_pertensor_hook, dist=_StackedAllGather())
_perchannel = with_globals(quantization_hooks.quantization_perchannel_hook, dist=_StackedAllGather())
_powersgd = power_sgd.powerSGD_hook
_batched_powersgd = with_globals(power_sgd.batched_powerSGD_hook, _orthogonalize=_orthogonalize_one)

HOOKS: dict[str, HookSpec] = {
    "allreduce": HookSpec(_none, _allreduce),
    "allreduce(group)": HookSpec(_world, _allreduce),
    "fp16_compress": HookSpec(_none, default_hooks.fp16_compress_hook),
    "fp16_wrapper(allreduce)": HookSpec(_none, default_hooks.fp16_compress_wrapper(_allreduce)),
    "bf16_compress": HookSpec(_none, _bf16_hook, reference=renamed(_bf16_hook, "bf16_hook_alias")),
    "bf16_wrapper(allreduce)": HookSpec(
        _none, _bf16_wrapped_allreduce, reference=renamed(_bf16_wrapped_allreduce, "bf16_wrapper_alias")
    ),
    "noop": HookSpec(_none, debugging_hooks.noop_hook),
    "builtin_ALLREDUCE": HookSpec(_none, dist.BuiltinCommHookType.ALLREDUCE),
    "builtin_FP16_COMPRESS": HookSpec(_none, dist.BuiltinCommHookType.FP16_COMPRESS),
    "post_localSGD": HookSpec(_post_local_sgd_state, post_local_sgd.post_localSGD_hook, averager=_averager),
    # Hooks that issue collectives from completion callbacks: the plain entries are for one-bucket
    # models, where stock DDP runs the same hook as OverlapDDP; the "/sync" entries give DDP
    # ``synchronous(hook)`` for many buckets (see ``synchronous``), while OverlapDDP still runs the
    # plain hook.
    "quantization_pertensor": HookSpec(_none, _pertensor),
    "quantization_pertensor/sync": HookSpec(_none, _pertensor, reference=synchronous(_pertensor)),
    "quantization_perchannel": HookSpec(_none, _perchannel),
    "quantization_perchannel/sync": HookSpec(_none, _perchannel, reference=synchronous(_perchannel)),
    "powerSGD": HookSpec(_power_sgd_state, _powersgd),
    "powerSGD/sync": HookSpec(_power_sgd_state, _powersgd, reference=synchronous(_powersgd)),
    "batched_powerSGD": HookSpec(_power_sgd_state, _batched_powersgd),
    "batched_powerSGD/sync": HookSpec(_power_sgd_state, _batched_powersgd, reference=synchronous(_batched_powersgd)),
}


def divide_by_total_hook(state, bucket):
    """``count_tokens``' reference on stock DDP, which hands a hook the unscaled bucket: scale it as
    OverlapDDP scales a token-weighted bucket (times ``1/state["total"]`` while copying in; with
    ``state["batched"]`` (batched_grad_copy), one true division by the total), then sum. Not
    annotated: under ``from __future__ import annotations`` DDP's check sees strings and refuses."""
    buffer = bucket.buffer()
    if state["batched"]:
        buffer.div_(state["total"])
    else:
        buffer.mul_(1.0 / state["total"])
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

