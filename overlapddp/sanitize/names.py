"""What does the user call this memory? A parameter's qualified name, or its ``.grad``.

The modules a program runs are seen as they are called (a global forward pre-hook registered by the
detector hands them to :meth:`Names.saw`); at a finding, the outermost of them are searched for the
parameter or gradient whose bytes the tensor overlaps. Nothing is searched until something is found.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch

from overlapddp.sanitize.memory import span_of


class Names:
    """The modules seen so far, and the names of the parameters and gradients they hold."""

    def __init__(self) -> None:
        self._modules: weakref.WeakSet[Any] = weakref.WeakSet()

    def saw(self, module: Any) -> None:
        self._modules.add(module)

    def _roots(self) -> list[Any]:
        """The seen modules no other seen module contains (their names are the fullest)."""
        modules = list(self._modules)
        inside = {id(child) for m in modules for child in m.modules() if child is not m}
        return [m for m in modules if id(m) not in inside]

    def _named_memory(self) -> Iterator[tuple[str, torch.Tensor]]:
        for root in self._roots():
            for name, param in root.named_parameters(remove_duplicate=False):
                yield name, param
                if param.grad is not None:
                    yield f"{name}.grad", param.grad

    def named(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(``net.0.weight.grad``, that gradient), (``part of net.0.weight.grad``, it), (``a buffer holding
        a.grad, b.grad``, ``tensor``), or None when no parameter or gradient of a seen module shares a byte
        with ``tensor``."""
        span = span_of(tensor)
        if span is None:
            return None
        overlapping: list[tuple[str, torch.Tensor]] = []
        for name, held in self._named_memory():
            other = span_of(held)
            if other is None or not other.overlaps(span) or any(name == n for n, _ in overlapping):
                continue
            if other == span:
                return name, held
            overlapping.append((name, held))
        if len(overlapping) <= 1:
            return (f"part of {overlapping[0][0]}", overlapping[0][1]) if overlapping else None
        listed = ", ".join(n for n, _ in overlapping[:3])
        more = f" and {len(overlapping) - 3} more" if len(overlapping) > 3 else ""
        return f"a buffer holding {listed}{more}", tensor
