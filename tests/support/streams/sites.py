"""Which call sites of the package can the stream mutation matrix change? An AST walk finds them all.

Every call in ``overlapddp/`` (the CUDA kit's own body aside: its callers are the sites) of

- a wait: ``.wait_event``, ``.wait_stream``, ``.wait_future`` (the kit), ``.wait()`` (a future, a
  work, an event), ``.synchronize()`` (an event, a stream, ``torch.cuda``);
- ``.record_stream``;
- an event ``.record``, as three mutants: left out; recorded before the last op queued on its
  stream (at run time); and moved one statement earlier in the source, together with the statements
  just before it that make its event or pick its stream (:func:`moved_records`, applied by swapping
  the function's code with :func:`moved`), where its block has a statement before them;
- a host read of device memory: ``.item()``, ``.tolist()``, and ``float``/``int``/``bool`` of one
  argument, whose mutant reads without making the host wait.

A new call site is mutated without anyone listing it. The sim (:class:`~tests.support.streams.sim.Sim`)
applies a :class:`~tests.support.streams.sim.Mutant` where the call runs, by its file and lines.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import pathlib
from typing import Any, Iterator

from tests.support.streams.coverage import NOT_TRAINING
from tests.support.streams.sim import Mutant

ROOT = pathlib.Path(__file__).resolve().parents[3]
WAITS = {"wait_event", "wait_stream", "wait_future", "wait", "synchronize"}
HOST_READS = {"item", "tolist"}
HOST_CASTS = {"float", "int", "bool"}
SKIPPED = {"overlapddp/device_streams.py"}  # the kit: its calls are made for, and mutated at, its callers


def _kinds(call: ast.Call) -> list[str]:
    func = call.func
    if isinstance(func, ast.Attribute):
        if func.attr in WAITS:
            return ["wait"]
        if func.attr == "record_stream":
            return ["record_stream"]
        if func.attr == "record":
            return ["record", "record earlier"]
        if func.attr in HOST_READS:
            return ["host sync"]
    if isinstance(func, ast.Name) and func.id in HOST_CASTS and len(call.args) == 1 and \
            not isinstance(call.args[0], ast.Constant) and not _reads_inside(call.args[0]):
        return ["host sync"]
    return []


def _reads_inside(node: ast.AST) -> bool:
    """Whether ``node`` holds an ``.item()`` or ``.tolist()`` call (the cast around it is that read)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in HOST_READS
               for n in ast.walk(node))


def call_sites(root: pathlib.Path = ROOT) -> list[Mutant]:
    """Every mutable call of the package, one :class:`Mutant` per call and way of changing it."""
    mutants = []
    for path in sorted((root / "overlapddp").rglob("*.py")):
        relative = str(path.relative_to(root))
        if relative in SKIPPED or relative.startswith(NOT_TRAINING):
            continue
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if isinstance(node, ast.Call):
                for kind in _kinds(node):
                    end = node.end_lineno or node.lineno
                    mutants.append(Mutant(kind, relative, node.lineno, end, ast.unparse(node)[:80]))
    return sorted(mutants, key=lambda m: (m.path, m.first, m.kind))


def is_cast(mutant: Mutant) -> bool:
    """A ``float``/``int``/``bool`` call: a host read only when its argument is a tensor, which only a
    run can tell."""
    return mutant.kind == "host sync" and mutant.text.split("(", 1)[0] in HOST_CASTS


# -- event records moved one statement earlier, in the source --------------------------------------------


def _bound(statement: ast.stmt) -> set[str]:
    """Names (and ``self.x`` attributes) a statement assigns."""
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    return {ast.unparse(t) for t in targets}


def _used(statements: list[ast.stmt]) -> set[str]:
    return {ast.unparse(n) for s in statements for n in ast.walk(s) if isinstance(n, (ast.Name, ast.Attribute))}


def _move(body: list[ast.stmt], index: int) -> list[ast.stmt] | None:
    """``body`` with the statement at ``index`` (an event record), together with the statements just
    before it that make what it uses (its event, its stream), moved above the statement before them;
    None when nothing comes before them in the block."""
    start = index
    while start > 0 and _bound(body[start - 1]) & _used(body[start:index + 1]):
        start -= 1
    if start == 0:
        return None
    return body[:start - 1] + body[start:index + 1] + [body[start - 1]] + body[index + 1:]


def _record_statements(tree: ast.AST) -> list[tuple[ast.AST, str, int, ast.stmt]]:
    """(function, field, index, statement) of every statement that is an event ``.record(...)`` call."""
    found = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            for i, statement in enumerate(block if isinstance(block, list) else []):
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and \
                        "record" in _kinds(statement.value):
                    found.append((node, field, i, statement))
    return found


def moved_records(root: pathlib.Path = ROOT) -> list[Mutant]:
    """One ``record moved`` mutant per event record that has a statement before it to move above."""
    mutants = []
    for path in sorted((root / "overlapddp").rglob("*.py")):
        relative = str(path.relative_to(root))
        if relative in SKIPPED or relative.startswith(NOT_TRAINING):
            continue
        for node, field, i, statement in _record_statements(ast.parse(path.read_text(), relative)):
            if _move(getattr(node, field), i) is not None:
                mutants.append(Mutant("record moved", relative, statement.lineno, statement.end_lineno or
                                      statement.lineno, ast.unparse(statement.value)[:80]))
    return mutants


def _enclosing(tree: ast.Module, line: int) -> list[str]:
    """The qualified name (as a path of names) of the outermost function or class method holding ``line``."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            return [node.name]
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        item.lineno <= line <= (item.end_lineno or 0):
                    return [node.name, item.name]
    raise LookupError(f"line {line} is in no function")


def _code_named(code: Any, names: list[str]) -> Any:
    for const in code.co_consts:
        if hasattr(const, "co_name") and const.co_name == names[0]:
            return const if len(names) == 1 else _code_named(const, names[1:])
    raise LookupError(names)


@contextlib.contextmanager
def moved(mutant: Mutant) -> Iterator[None]:
    """While the block runs, the function holding ``mutant``'s record runs with the record (and the
    statements that make its event) one statement earlier: the function's code is swapped."""
    path = ROOT / mutant.path
    tree = ast.parse(path.read_text(), str(path))
    for node, field, i, statement in _record_statements(tree):
        if statement.lineno == mutant.first:
            setattr(node, field, _move(getattr(node, field), i))
            break
    names = _enclosing(tree, mutant.first)
    module = importlib.import_module(mutant.path.removesuffix(".py").replace("/", "."))
    owner: Any = module
    for name in names[:-1]:
        owner = getattr(owner, name)
    function = owner.__dict__[names[-1]] if isinstance(owner, type) else getattr(owner, names[-1])
    new_code = _code_named(compile(tree, str(path), "exec"), names)
    old_code, function.__code__ = function.__code__, new_code
    try:
        yield
    finally:
        function.__code__ = old_code
