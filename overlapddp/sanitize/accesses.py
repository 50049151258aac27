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


def short_op(func: Any) -> str:
    """``aten.add_`` for ``aten.add_.Tensor``: the op as a user recognises it."""
    name = str(func)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


class Accesses(TorchDispatchMode):
    """Reports each op's reads and writes of in-flight memory to ``collectives``."""

    def __init__(self, collectives: Collectives) -> None:
        super().__init__()
        self.collectives = collectives

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        collectives = self.collectives
        if collectives and func.namespace != "c10d":  # a launch is the launcher's to check (completion.py)
            for i, argument in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                tensors = tensors_in(value)
                if not tensors:
                    continue
                info = argument.alias_info
                write = info is not None and info.is_write
                if info is not None and not write:
                    continue  # a view of it: no access yet
                for tensor in tensors:
                    collectives.access(tensor, write, short_op(func))
        out = func(*args, **kwargs)
        collectives.model.after_op(func, args, out)
        return out

