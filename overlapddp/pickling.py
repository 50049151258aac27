"""What a copied or pickled ``OverlapDDP`` carries, and how the copy gets a reducer: as DDP does.

DDP pickles its ``__dict__`` without the process group, the reducer and the logger; the copy binds
to the default process group and builds a new reducer, as at construction: the initial bucket
layout, the ready-order rebuild after its own first iteration, a static graph learned again, no
communication hook. OverlapDDP does the same (a copy of the two trains bit-equal), and carries the
reducer's construction arguments so that it can. What is not carried, and why, is listed in
docs/compatibility.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from overlapddp.bucket_plan import BucketCaps
from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import fence_for
from overlapddp.reducer import Reducer, ReducerOptions

# Live objects: bound to this process's group and autograd graph, rebuilt by the copy.
_NOT_PICKLED = ("process_group", "_reducer", "_hook_handles", "_graph_splitter")
# Set up at construction with live collectives of their own; a copy would need them rebuilt too.
_NOT_COPYABLE = {"_delayed": "delay_all_reduce_named_params", "_mixed_precision": "mixed_precision"}
_RECIPE = "_overlapddp_reducer_recipe"


@dataclass(frozen=True)
class ReducerRecipe:
    """A reducer's constructor arguments, less the live ones (parameters by name, no group or fence)."""

    names: tuple[str, ...]
    caps: BucketCaps
    sparse_gradient: tuple[bool, ...]
    options: ReducerOptions
    checks_nonfinite: bool = False
    dropped_hooks: tuple[str, ...] = ()  # communication hooks the original had; named in a warning

    def build(
        self,
        parameters: dict[str, torch.Tensor],
        process_group: dist.ProcessGroup,
        delayed: DelayedReduction | None = None,
    ) -> Reducer:
        """A new reducer, as constructed, for the parameters of these names: the one way the wrapper
        and its copies build one."""
        missing = [n for n in self.names if n not in parameters]
        if missing:
            raise RuntimeError(f"The copied module lacks the parameters {missing} that its OverlapDDP reduced.")
        params = [parameters[n] for n in self.names]
        fence = fence_for(dict(zip(self.names, (p.device for p in params), strict=True)))
        return Reducer(
            params, self.names, process_group, fence, self.caps, self.sparse_gradient, self.options,
            delayed=delayed, check_nonfinite=self.checks_nonfinite,
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
    refused = [argument for name, argument in _NOT_COPYABLE.items() if attributes.get(name) is not None]
    if refused:
        raise RuntimeError(
            f"An OverlapDDP constructed with {' and '.join(refused)} cannot be copied or pickled yet; copy or "
            "save model.module (or model.state_dict()) and wrap the copy in a new OverlapDDP."
        )
    reducer: Reducer = attributes["_reducer"]
    state = {k: v for k, v in attributes.items() if k not in _NOT_PICKLED}
    hooks = [] if reducer.comm_hook is None else [reducer.comm_hook[1]]
    state[_RECIPE] = ReducerRecipe(
        tuple(reducer.names), reducer.caps, tuple(reducer.sparse_gradient), reducer.options, reducer.checks_nonfinite,
        tuple(getattr(hook, "__qualname__", repr(hook)) for hook in hooks),
    )
    return state


def take_recipe(state: dict[str, Any]) -> ReducerRecipe:
    """Remove and return the recipe that :func:`pickled_state` put in ``state``."""
    if _RECIPE not in state:
        raise RuntimeError("This pickled OverlapDDP has no reducer recipe; it was not pickled by OverlapDDP.")
    return state.pop(_RECIPE)


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
            stacklevel=4,
        )
    return cast(dist.ProcessGroup, dist.group.WORLD)  # initialized, so never None
