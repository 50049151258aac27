"""Which lines of the package are its CUDA path, and which of them did the stream scenarios run?

The CUDA path, found in the source (an AST walk, so a new CUDA line is in the gate without anyone
adding it): every statement of ``device_streams.py`` and of ``fence.CudaFence``; and in every module,
every statement that names CUDA (``is_cuda``, ``torch.cuda``, the string ``"cuda"``, ``CudaKit``, a
``_kit``), with every statement of an ``if`` whose test names it. :class:`LineTracer` records the
lines that ran, with ``sys.settrace`` on those files only.
"""

from __future__ import annotations

import ast
import pathlib
import sys
import threading
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]
WHOLE_FILES = {"overlapddp/device_streams.py"}
WHOLE_CLASSES = {("overlapddp/fence.py", "CudaFence")}
# The race detector is not a training path: its CUDA stream model runs only on a GPU (tests/gpu) and
# its use of this CPU model is tests/sanitize's.
NOT_TRAINING = ("overlapddp/sanitize/",)


def _names_cuda(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and (n.attr in ("is_cuda", "cuda", "_kit") or
                                             (isinstance(n.value, ast.Name) and n.value.id == "torch"
                                              and n.attr == "cuda")):
            return True
        if isinstance(n, ast.Name) and n.id == "CudaKit":
            return True
        if isinstance(n, ast.Constant) and n.value == "cuda":
            return True
    return False


def _statements(nodes: list[ast.stmt]) -> set[int]:
    """First lines of every statement in ``nodes``, nested ones included (the lines a tracer sees)."""
    lines = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.stmt) and not isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not \
                    (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)):  # a docstring
                lines.add(n.lineno)
    return lines


def _simple(tree: ast.AST) -> list[ast.stmt]:
    """Statements without a body of their own (the smallest that name something)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not hasattr(n, "body")]


def cuda_lines(root: pathlib.Path = ROOT) -> dict[str, set[int]]:
    """path -> the lines of its CUDA path."""
    found: dict[str, set[int]] = {}
    for path in sorted((root / "overlapddp").rglob("*.py")):
        relative = str(path.relative_to(root))
        if relative.startswith(NOT_TRAINING):
            continue
        tree = ast.parse(path.read_text(), relative)
        lines: set[int] = set()
        if relative in WHOLE_FILES:
            for node in ast.walk(tree):  # every function's statements (the module's run at import)
                if isinstance(node, ast.FunctionDef):
                    lines |= _statements(node.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (relative, node.name) in WHOLE_CLASSES:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        lines |= _statements(item.body)
            if isinstance(node, ast.If) and _names_cuda(node.test):
                lines |= {node.lineno} | _statements(node.body) | _statements(node.orelse)
        for statement in _simple(tree):
            if _names_cuda(statement) and not isinstance(statement, (ast.Import, ast.ImportFrom)):
                lines.add(statement.lineno)
        lines -= _definitions(tree)
        if lines:
            found[relative] = lines
    return found


def _definitions(tree: ast.AST) -> set[int]:
    """Lines that run at import, not in a scenario: annotated attributes and module-level assignments."""
    return {n.lineno for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and n.value is None} | \
        {n.lineno for n in getattr(tree, "body", []) if isinstance(n, (ast.Assign, ast.AnnAssign))}


class LineTracer:
    """Records (path, line) of every line run in the package's files while started."""

    def __init__(self, root: pathlib.Path = ROOT) -> None:
        self.prefix = str(root / "overlapddp") + "/"
        self.root = str(root) + "/"
        self.ran: set[tuple[str, int]] = set()
        self._previous: Any = None

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.startswith(self.prefix):
            return self._local
        return None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.ran.add((frame.f_code.co_filename.removeprefix(self.root), frame.f_lineno))
        return self._local

    def __enter__(self) -> "LineTracer":
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        threading.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._previous)
        threading.settrace(self._previous)  # type: ignore[arg-type]
