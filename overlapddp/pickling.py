"""What a copied or pickled ``OverlapDDP`` carries, and how a wrapper's reducer is built: one way.

DDP pickles its ``__dict__`` without the process group, the reducer and the logger; the copy binds
to the default process group and builds a new reducer, as at construction: the initial bucket
layout, the ready-order rebuild after its own first iteration, a static graph learned again, no
communication hook. OverlapDDP does the same (a copy of the two trains bit-equal), and carries the
reducer's recipe: :meth:`ReducerRecipe.build` is the one function that builds and wires a reducer,
for the constructor and for every copy (its fence, its desync records, the delayed all-reduce).
What is not carried, and why, is listed in docs/compatibility.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import fence_for
from overlapddp.frames import PACKAGE, STDLIB, TORCH, stacklevel_outside
from overlapddp.layout.plan import BucketCaps
from overlapddp.options import ReducerOptions
from overlapddp.progress import ProgressRecord
from overlapddp.reducer import Reducer
from overlapddp.sync_checks import SyncFlagCheck

# The frames of a copy or a load that are not the user's: this package, the standard library (copy,
# pickle's helpers) and torch (torch.load); a framework that copies the model may be among them
# (see frames.STDLIB), and the warning then points at the script that called it.
_MACHINERY = (PACKAGE, STDLIB, TORCH)

# Live objects: bound to this process's group and autograd graph, rebuilt by the copy.
# Live parts, built again by the copy (a copy has no optimizer attached, as a DDP copy has no reducer hooks).
_NOT_PICKLED = (
    "process_group", "_reducer", "_hook_handles", "_graph_splitter", "_mixed_precision", "_sharded_optimizers",
)


@dataclass(frozen=True)
class ReducerRecipe:
    """A reducer's constructor arguments, less the live ones (parameters by name, no group or fence)."""

    names: tuple[str, ...]
    caps: BucketCaps
    sparse_gradient: tuple[bool, ...]
    options: ReducerOptions
    checks_nonfinite: bool = False
    dropped_hooks: tuple[str, ...] = ()  # communication hooks the original had; named in a warning
    delayed_names: tuple[str, ...] = ()  # delay_all_reduce_named_params, by name
    hook_parameter: str | None = None  # param_to_hook_all_reduce, by name (set with delayed_names)

    def build(
        self,
        parameters: dict[str, torch.Tensor],
        process_group: dist.ProcessGroup,
        sync_flags: SyncFlagCheck,
    ) -> Reducer:
        """A new reducer, as constructed, for the parameters of these names, wired to its fence, its
        desync records (which rank is behind) and the wrapper's sync flag: the one way the wrapper and
        its copies build one."""
        wanted = (*self.names, *self.delayed_names, *([self.hook_parameter] if self.hook_parameter else []))
        missing = [n for n in wanted if n not in parameters]
        if missing:
            raise RuntimeError(f"The copied module lacks the parameters {missing} that its OverlapDDP reduced.")
        params = [parameters[n] for n in self.names]
        device = params[0].device
        progress = ProgressRecord(process_group, len(params), device)
        delayed = None
        if self.delayed_names:
            delayed = DelayedReduction([parameters[n] for n in self.delayed_names], self.delayed_names, process_group)
        return Reducer(
            params, self.names, process_group, fence_for(device, before_wait=progress.wait_for), self.caps,
            self.sparse_gradient, self.options, delayed=delayed, check_nonfinite=self.checks_nonfinite,
            sync_flags=sync_flags, progress=progress,
        )


def pickled_state(attributes: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's ``__dict__`` as pickled: no live objects, the reducer's recipe in their place."""
    group = attributes["process_group"]
    if not dist.is_initialized() or group != dist.group.WORLD:
        raise RuntimeError(
            "OverlapDDP, like DDP, can be copied or pickled only when it reduces over the default process "
            "group (constructed without process_group or device_mesh); save model.module or "
            "model.state_dict() instead."
        )
    reducer: Reducer = attributes["_reducer"]
    state = {k: v for k, v in attributes.items() if k not in _NOT_PICKLED}
    # Mixed precision's reduction is the wrapper's own, rebuilt with it: only a user's hook is dropped.
    registered = reducer.reduction.comm_hook
    hooks = [] if registered is None or attributes.get("_mixed_precision") else [registered[1]]
    recipe: ReducerRecipe = attributes["_recipe"]
    state["_recipe"] = dataclasses.replace(
        recipe, options=reducer.options, checks_nonfinite=reducer.stages.check_nonfinite,
        dropped_hooks=tuple(getattr(hook, "__qualname__", repr(hook)) for hook in hooks),
    )
    return state


def recipe_of(state: dict[str, Any]) -> ReducerRecipe:
    """The recipe that :func:`pickled_state` left in ``state``."""
    if "_recipe" not in state:
        raise RuntimeError("This pickled OverlapDDP has no reducer recipe; it was not pickled by OverlapDDP.")
    return cast(ReducerRecipe, state["_recipe"])


def bind_to_default_group(recipe: ReducerRecipe) -> dist.ProcessGroup:
    """The group a copy binds to, as DDP's: the default one (warns about hooks left behind)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "An OverlapDDP is being unpickled or copied, but there is no default process group to bind it to: "
            "call dist.init_process_group(...) first (as with DDP), or load model.module / a state_dict."
        )
    if recipe.dropped_hooks:
        warnings.warn(
            f"The copy of this OverlapDDP reduces with the default all-reduce, as a copy of DDP does: the "
            f"communication hook ({', '.join(recipe.dropped_hooks)}) is not carried; register it on the copy.",
            UserWarning,
            stacklevel=stacklevel_outside(_MACHINERY),
        )
    return cast(dist.ProcessGroup, dist.group.WORLD)  # initialized, so never None
