"""Which op reads or writes which tensor? Every op, from its schema, while the detector runs.

A dispatch mode sees each aten op with its tensor arguments: an argument the schema marks written
(``Tensor(a!)``) is a write, one it marks only aliased (a view) is no access, and any other tensor
argument is a read. Each is checked against the collectives in flight; with none in flight an op
costs one Python call and one test. The collectives' own ops (``c10d.allreduce_``, which the
process group's methods and DDP's C++ reducer dispatch) are not accesses: a launch on memory still
in flight is the launcher's finding (``never-completed``).
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from overlapddp.sanitize.collectives import tensors_in
from overlapddp.sanitize.completion import Collectives


def _accessed_arguments(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, written) of each argument ``func`` reads or writes; views and the
    collectives' own ops (``c10d``: a launch is the launcher's to check) have none."""
    if func.namespace == "c10d":
        return ()
    found = []
    for i, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        written = info is not None and info.is_write
        if info is None or written:  # an alias that is not written is a view: no access yet
            found.append((i, argument.name, written))
    return tuple(found)


class Accesses(TorchDispatchMode):
    """Reports each op's reads and writes of in-flight memory to ``collectives``.

    Each op's accessed arguments are read from its schema once (``_arguments``, by op); the stream
    model's after-op hook is called only where it does something (CUDA: host syncs).
    """

    def __init__(self, collectives: Collectives, watch_host_syncs: bool) -> None:
        super().__init__()
        self.collectives = collectives
        self._arguments: dict[Any, tuple[tuple[int, str, bool], ...]] = {}
        self._after_op = collectives.model.after_op if watch_host_syncs else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        collectives = self.collectives
        if collectives:
            accessed = self._arguments.get(func)
            if accessed is None:
                accessed = self._arguments[func] = _accessed_arguments(func)
            for i, name, written in accessed:
                value = args[i] if i < len(args) else kwargs.get(name)
                for tensor in tensors_in(value):
                    collectives.access(tensor, written, func)
        out = func(*args, **kwargs)
        if self._after_op is not None:
            self._after_op(func, args, out)
        return out
