"""Which parameters took part in producing the loss, locally and on any rank.

DDP's ``find_unused_parameters`` contract: a parameter that no rank used keeps its gradient
untouched (``None`` stays ``None``); one that only some ranks used receives the reduced value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.utils.checkpoint import CheckpointFunction

# [Note: which containers are walked] One walk for every place that looks into a forward's inputs or
# outputs: lists, tuples (named ones too), dicts and dataclass instances. Dataclasses are walked as
# DDP's ``_find_tensors`` (its unused-parameter search) and its mixed-precision input cast do (DDP's
# pytree flattening for the static graph's first iteration misses them, and then never reduces it).


def _children(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]] | None:
    """The items the walk descends into, and how to rebuild ``tree`` from new ones (None: a leaf)."""
    if isinstance(tree, (list, tuple)):
        rebuild: Callable[[list[Any]], Any] = (
            (lambda items: type(tree)(*items)) if hasattr(tree, "_fields") else type(tree)
        )
        return list(tree), rebuild
    if isinstance(tree, dict):
        keys = list(tree)
        return list(tree.values()), lambda values: type(tree)(zip(keys, values, strict=True))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = dataclasses.fields(tree)

        def rebuild_dataclass(values: list[Any]) -> Any:
            changed = {f.name: v for f, v in zip(fields, values, strict=True) if f.init}
            return dataclasses.replace(tree, **changed)

        return [getattr(tree, f.name) for f in fields], rebuild_dataclass
    return None


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward's output or inputs (see [Note: which containers are walked])."""
    if isinstance(tree, torch.Tensor):
        yield tree
        return
    unpacked = _children(tree)
    if unpacked is not None:
        for item in unpacked[0]:
            yield from tensors_in(item)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to each of its tensors, keeping its structure; a container none
    of whose tensors changed is returned as is."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    unpacked = _children(tree)
    if unpacked is None:
        return tree
    items, rebuild = unpacked
    mapped = [map_tensors(item, fn) for item in items]
    if all(new is old for new, old in zip(mapped, items, strict=True)):
        return tree
    return rebuild(mapped)


def grad_accumulators(params: Sequence[torch.Tensor]) -> list[Any]:
    """The autograd node that accumulates each parameter's gradient (kept alive by the caller)."""
    with torch.enable_grad():
        return [cast(Any, p.view_as(p).grad_fn).next_functions[0][0] for p in params]


def unreachable(outputs: Sequence[torch.Tensor], accumulators: Sequence[Any]) -> tuple[list[int], bool]:
    """Indices of parameters whose accumulator no output's graph reaches (unused in this forward), and
    whether the graph holds a reentrant checkpoint, whose backward runs a forward and backward of its
    own: the parameters it uses cannot be seen from here, nor how many times each receives a gradient."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    hidden = False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        hidden = hidden or getattr(node, "_forward_cls", None) is CheckpointFunction
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return [i for i, acc in enumerate(accumulators) if acc not in seen], hidden


class UsageMap:
    """Per-parameter "this rank produced a gradient" flags and their sum over ranks.

    Written by the ready hooks, all-reduced once per synchronized backward after the last bucket
    launched, read lazily by finalize only for parameters this rank did not use.
    """

    def __init__(self, count: int, device: torch.device) -> None:
        # Host bytes, so that a hook's write and finalize's read cost no tensor indexing (about 2 us
        # each); ``_local`` is a tensor view of them for the copies.
        self._flags = bytearray(count)
        self._local = torch.frombuffer(self._flags, dtype=torch.uint8) if count else torch.zeros(0, dtype=torch.uint8)
        # The flags as sent to the other ranks, summed in place: after a reduction it holds that
        # iteration's global counts, which is what a joined rank contributes while shadowing (DDP).
        self._sent = torch.zeros(count, dtype=torch.int32, device=device)
        # Future of the all-reduced copy of the flags; produced by ``launch_reduction``, waited on
        # by ``globally_used`` (finalize), dropped by ``reset``.
        self._reduction: Future | None = None
        self._global: list[int] | None = None

    def mark_used(self, index: int) -> None:
        self._flags[index] = 1

    def launch_reduction(self, process_group: dist.ProcessGroup) -> None:
        """Start summing the flags over ranks; the result is awaited only if needed.

        On CUDA the flags go through a fresh pinned copy, so the copy is asynchronous (no host sync
        inside the last autograd hook) and the next backward's ``mark_used`` cannot change them
        while it is queued (the pinned allocator keeps the block until the copy has run)."""
        if self._sent.is_cuda:
            self._sent.copy_(self._local.pin_memory(), non_blocking=True)
        else:
            self._sent.copy_(self._local)
        self._reduction = dist.all_reduce(self._sent, group=process_group, async_op=True).get_future()
        self._global = None

    def shadow_reduction(self, process_group: dist.ProcessGroup) -> None:
        """A joined rank's matching all-reduce: it sends what it last sent, summed, as DDP does."""
        dist.all_reduce(self._sent, group=process_group)

    def globally_used(self, index: int) -> bool:
        """Whether any rank used the parameter (waits for the reduction the first time)."""
        if self._flags[index]:
            return True
        if self._global is None:
            if self._reduction is None:
                raise RuntimeError("The parameter-usage reduction was never launched in this backward.")
            self._global = self._reduction.wait()[0].tolist()
        return bool(self._global[index])

    def settle(self) -> None:
        """Order this backward's reduction before the next write of the flags, without reading
        them: on CUDA the current stream waits for it, and the host blocks only when a parameter
        was locally unused (``globally_used``), as in DDP."""
        if self._reduction is not None and self._global is None:
            self._reduction.wait()

    def reset(self) -> None:
        """Start counting a new iteration (dynamic graphs); a static graph keeps its first map."""
        self._local.zero_()
        self._reduction = None
        self._global = None
