"""Which bytes does a tensor cover, and which in-flight collective's memory do they overlap?

A tensor is named by its storage (device and base address) and the byte range its elements span in
it, so any view of a collective's tensor (a parameter's slice of a flat bucket, a ``.grad`` view)
overlaps it, and two views of one buffer that share no byte do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Span:
    """The bytes ``[start, end)`` of the storage ``storage`` (its device and base address)."""

    storage: tuple[torch.device, int]
    start: int
    end: int

    def overlaps(self, other: "Span") -> bool:
        return self.storage == other.storage and self.start < other.end and other.start < self.end


def span_of(tensor: torch.Tensor) -> Span | None:
    """The bytes ``tensor``'s elements span; None for memory this detector cannot follow (sparse,
    meta or empty tensors, and tensor subclasses without a storage)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    try:
        base = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor, FakeTensor) has none
        return None
    if base == 0:
        return None
    size = tensor.element_size()
    extent = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    start = int(tensor.storage_offset()) * size
    return Span((tensor.device, base), start, start + extent * size)


def describe(tensor: torch.Tensor) -> str:
    """``float32[16, 8]``: the dtype and shape, for a tensor the user has no name for."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


class SpanIndex:
    """Each watched span with its owner and role, by the storage it lies in: the overlap test on
    every op's tensors looks at one storage's few spans."""

    def __init__(self) -> None:
        self._by_storage: dict[tuple[torch.device, int], list[tuple[Span, Any, str]]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_storage)

    def may_hold(self, tensor: torch.Tensor) -> bool:
        """Whether any watched span lies in ``tensor``'s storage (the cheap first test of every access)."""
        try:
            return (tensor.device, tensor.untyped_storage().data_ptr()) in self._by_storage
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage
            return False

    def add(self, span: Span, owner: Any, role: str) -> None:
        self._by_storage.setdefault(span.storage, []).append((span, owner, role))

    def overlapping(self, span: Span) -> list[tuple[Any, str]]:
        """(owner, role) of each watched span that shares a byte with ``span``."""
        return [(owner, role) for held, owner, role in self._by_storage.get(span.storage, ()) if held.overlaps(span)]

    def remove(self, owner: Any) -> None:
        """Every span of ``owner`` (compared by identity)."""
        for storage in list(self._by_storage):
            kept = [entry for entry in self._by_storage[storage] if entry[1] is not owner]
            if kept:
                self._by_storage[storage] = kept
            else:
                del self._by_storage[storage]
