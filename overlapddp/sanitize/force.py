"""How does a race show in the numbers even where the detector cannot see the read? ``--force``.

Each collective runs into private copies of its outputs (and of any input that shares their
memory), and the user's outputs hold NaN (integers: their largest value) from the launch until this
rank observes completion; then the real result is copied in. A read the detector cannot see (C++,
``data_ptr``, numpy) before completion reads NaN, which spreads into the loss; a clean program reads
only after completion and gets the same bits as without ``--force``. Autograd's version counters
are left as they were (the collective's own writes do not bump them either).

The work's future is chained to one whose value is the user's tensors, as without ``--force`` (a
PowerSGD hook keeps the value of its all-reduce's future as its state and updates it in place later):
its ``wait()``, ``value()`` or a ``then`` callback on it is an observation, which delivers the result.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from overlapddp.sanitize.memory import span_of
from overlapddp.torch_compat import preserving_versions


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).max)


class Forced:
    """The user's outputs of one collective and the private buffers the collective really writes."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._pairs = pairs  # (the user's tensor, its private copy), until the result is delivered
        self._originals = list(pairs)
        self._lock = threading.Lock()

    @classmethod
    def redirect(cls, args: tuple[Any, ...], outputs: list[torch.Tensor],
                 inputs: list[torch.Tensor]) -> tuple[tuple[Any, ...], "Forced"]:
        """``args`` with each output, and each input sharing an output's memory, replaced by a copy
        taken now; and the record that delivers the result later."""
        out_spans = [s for s in map(span_of, outputs) if s is not None]
        shared = [t for t in inputs if (s := span_of(t)) is not None and any(s.overlaps(o) for o in out_spans)]
        with _disable_current_modes(), torch.no_grad():
            private = {id(t): t.clone() for t in outputs + shared}
        replaced = tuple(_replace(arg, private) for arg in args)
        return replaced, cls([(t, private[id(t)]) for t in outputs])

    def poison(self) -> None:
        """The user's outputs hold NaN until the result is delivered (called right after the launch)."""
        users = [user for user, _ in self._pairs]
        with _disable_current_modes(), torch.no_grad(), preserving_versions(users):
            for user in users:
                _poison(user)

    def user_value(self, future: Any) -> Any:
        """``future``'s value (the collective's tensors) with each private copy replaced by the user's tensor."""
        mine = {id(private): user for user, private in self._originals}
        return _replace(future.value(), mine)

    def deliver(self) -> None:
        """Copy the real result into the user's outputs, once, where the rank observes completion."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        if not pairs:
            return
        with _disable_current_modes(), torch.no_grad(), preserving_versions([u for u, _ in pairs]):
            for user, private in pairs:
                user.copy_(private)


def _replace(value: Any, private: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return private.get(id(value), value)
    if isinstance(value, list):
        return [_replace(v, private) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace(v, private) for v in value)
    return value
