"""How does a bucket-wise optimizer take over the user's ``step()``? One way, for overlap and shard.

The user keeps calling ``optimizer.step()`` (directly, through ``GradScaler.step`` or a framework);
the step the optimizer runs instead is bound *to the optimizer*: an LR scheduler created afterwards
re-binds ``step``'s underlying function to the optimizer object, so a method bound to anything else
would receive the optimizer as its ``self``.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch


def take_over_step(optimizer: torch.optim.Optimizer, step: Callable[[Any], Any]) -> Callable[..., Any]:
    """Make ``optimizer.step(closure=None)`` call ``step(closure)``; returns the step it replaced."""
    original = optimizer.step
    optimizer.step = types.MethodType(  # type: ignore[method-assign]
        lambda _optimizer, closure=None: step(closure), optimizer
    )
    return original


def give_back_step(optimizer: torch.optim.Optimizer, original: Callable[..., Any]) -> None:
    """Restore the step :func:`take_over_step` replaced."""
    optimizer.step = original  # type: ignore[method-assign]
