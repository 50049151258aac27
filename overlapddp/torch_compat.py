"""Which parts of torch that are private, or changed between releases, the package relies on.

Everything below is looked up here once, so that a torch release that renames one breaks this file
only, with a fallback or a clear error instead of an AttributeError deep in a backward. Probes ask
the installed torch what it has (never its version string), so that OverlapDDP follows the DDP it
runs next to: see docs/compatibility.md for the range tested.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

# -- autograd ---------------------------------------------------------------------------------------

_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)
_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward has finished (the end-of-backward callback)."""
    if _ENGINE is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no autograd engine callback queue "
            "(torch.autograd.Variable._execution_engine), which OverlapDDP needs to finalize a backward."
        )
    _ENGINE.queue_callback(callback)


def preserving_versions(tensors: Sequence[torch.Tensor]) -> Any:
    """A context in which writes to ``tensors`` leave their autograd version counters as they were.

    DDP's buffer broadcast runs under it, so a forward that saved a buffer for backward (BatchNorm's
    running statistics) may be followed by another forward before that backward (GAN steps)."""
    return torch.autograd.grad_mode._unsafe_preserve_version_counter(tuple(tensors))


def in_backward() -> bool:
    """Whether the calling thread runs inside a backward (False where torch cannot tell)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


# The C type of ``torch.futures.Future`` (collectives return it directly, not the Python subclass).
FUTURE_TYPES: tuple[type, ...] = (getattr(torch._C, "Future", torch.futures.Future),)

# -- process groups ----------------------------------------------------------------------------------


def group_store(process_group: Any) -> Any | None:
    """The key-value store the process group was created with (None where torch does not say)."""
    registry = getattr(getattr(torch.distributed.distributed_c10d, "_world", None), "pg_map", None)
    entry = registry.get(process_group) if isinstance(registry, dict) else None
    return entry[1] if isinstance(entry, tuple) and len(entry) == 2 else None


# The flat all-gather and reduce-scatter: renamed ``*_single`` (the old names warn of their deprecation).
all_gather_flat: Callable[..., Any] = getattr(
    torch.distributed, "all_gather_single", None
) or torch.distributed.all_gather_into_tensor
reduce_scatter_flat: Callable[..., Any] = getattr(
    torch.distributed, "reduce_scatter_single", None
) or torch.distributed.reduce_scatter_tensor

# -- multi-tensor kernels: one launch per list where torch has them, a loop where it does not -------


def _each(method: str) -> Callable[..., None]:
    def apply(tensors: Sequence[torch.Tensor], other: Any) -> None:
        others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
        for tensor, value in zip(tensors, others, strict=True):
            getattr(tensor, method)(value)

    return apply


foreach_copy_: Callable[..., None] = getattr(torch, "_foreach_copy_", None) or _each("copy_")
foreach_mul_: Callable[..., None] = getattr(torch, "_foreach_mul_", None) or _each("mul_")
foreach_div_: Callable[..., None] = getattr(torch, "_foreach_div_", None) or _each("div_")


def _norms(tensors: Sequence[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """``torch._foreach_norm`` one tensor at a time (the Euclidean norm unless told)."""
    return [torch.linalg.vector_norm(tensor, ord) for tensor in tensors]


foreach_norm: Callable[..., list[torch.Tensor]] = getattr(torch, "_foreach_norm", None) or _norms


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU cycles (delay injection in tests)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._sleep to delay a CUDA stream with.")
    sleep(cycles)


# -- DDP's helpers and arguments --------------------------------------------------------------------


def to_kwargs(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device: torch.device) -> tuple[tuple, tuple]:
    """DDP's own input placement (``torch.distributed.utils._to_kwargs``), so results match DDP's."""
    from torch.distributed import utils

    helper = getattr(utils, "_to_kwargs", None)
    if helper is None:
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.distributed.utils._to_kwargs; call tensor.to(device) instead."
        )
    return helper(inputs, kwargs, device, False)


def ddp_accepts(argument: str) -> bool:
    """Whether the installed ``DistributedDataParallel`` takes ``argument`` (they come and go by release)."""
    from torch.nn.parallel import DistributedDataParallel

    return argument in inspect.signature(DistributedDataParallel.__init__).parameters


# -- distributed checkpoints (DCP) ------------------------------------------------------------------


def let_dcp_unwrap(wrapper_type: type) -> None:
    """Make DCP's state-dict helpers drop ``wrapper_type``'s ``module.`` prefix, as they drop DDP's.

    ``torch.distributed.checkpoint.state_dict`` recognizes DDP by one type check (``isinstance(obj,
    DDP)`` on its module-level name ``DDP``, in ``_get_fqns``) and offers no registration; that name
    becomes a tuple holding both types. Where that name is gone, the prefix stays.
    """
    try:
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
    except ImportError:
        return
    recognized = getattr(dcp_state_dict, "DDP", None)
    if recognized is None:
        return
    types = recognized if isinstance(recognized, tuple) else (recognized,)
    if wrapper_type not in types:
        # dcp checks isinstance(model, DDP); a tuple there widens the check (torch types it as the class).
        dcp_state_dict.DDP = (*types, wrapper_type)  # type: ignore[misc, assignment]
