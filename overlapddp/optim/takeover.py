"""How do overlap and shard take over the user's optimizer? One way, for both.

Both run the user's own optimizer over some of its parameters at a time (a bucket's, or the ones
this rank owns), which gives DDP's numbers exactly when the update of a parameter reads nothing but
that parameter, its gradient and its own state: the optimizers in ``PER_PARAMETER`` do, and a user's
class may declare that its own does (``per_parameter_update = True`` in its class body). A fused
optimizer is fine for shard (whole parameters) but refused by overlap's callers where they say so.

The user keeps calling ``optimizer.step()`` (directly, through ``GradScaler.step`` or a framework);
the step taken over is bound *to the optimizer*: an LR scheduler created afterwards re-binds
``step``'s underlying function to the optimizer object, so a method bound to anything else would
receive the optimizer as its ``self``.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

# The torch optimizers whose update of one parameter reads only that parameter's gradient and state.
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Muon, torch.optim.Adafactor,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
)
# The class attribute by which a user's optimizer declares a per-parameter update.
DECLARATION = "per_parameter_update"


def is_per_parameter(kind: type[torch.optim.Optimizer]) -> bool:
    """Whether ``kind`` is a known per-parameter optimizer, or declares itself one in its own body
    (a subclass that did not may read more in its ``step`` than its parent)."""
    return kind in PER_PARAMETER or vars(kind).get(DECLARATION, False) is True


def why_not_per_parameter(kind: type[torch.optim.Optimizer]) -> str:
    """Why ``kind`` cannot be stepped a few parameters at a time (for a refusal naming it)."""
    if issubclass(kind, torch.optim.LBFGS):
        return "its line search reads every parameter and re-evaluates the loss"
    parents = [t.__name__ for t in kind.__mro__ if t in PER_PARAMETER]
    if parents:
        return (f"it subclasses {', '.join(parents)} and its step may read more; if its update of a parameter reads "
                f"only that parameter, its gradient and its state, set {DECLARATION} = True in its class body")
    return ("it needs an update of each parameter that reads only that parameter, its gradient and its state "
            f"({', '.join(t.__name__ for t in PER_PARAMETER)}, or a class that sets {DECLARATION} = True in its body)")


def take_over_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``optimizer.step(closure=None, **kwargs)`` call ``step(closure, **kwargs)``; returns the
    step it replaced."""
    original = optimizer.step
    optimizer.step = types.MethodType(  # type: ignore[method-assign]
        lambda _optimizer, closure=None, **kwargs: step(closure, **kwargs), optimizer
    )
    return original


def give_back_step(optimizer: torch.optim.Optimizer, original: Callable[..., Any]) -> None:
    """Restore the step :func:`take_over_step` replaced."""
    optimizer.step = original  # type: ignore[method-assign]


@contextmanager
def narrowed(groups: list[dict[str, Any]], keep: set[int]) -> Iterator[None]:
    """Each group lists only its parameters whose ``id`` is in ``keep`` while the block runs (the
    user's own step then updates just those, with the group's hyperparameters as they are now)."""
    everything = [group["params"] for group in groups]
    try:
        for group, params in zip(groups, everything, strict=True):
            group["params"] = [p for p in params if id(p) in keep]
        yield
    finally:
        for group, params in zip(groups, everything, strict=True):
            group["params"] = params
