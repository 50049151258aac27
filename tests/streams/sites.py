"""Which call sites of the package can the stream mutation matrix change? An AST walk finds them all.

Every call in ``overlapddp/`` (the CUDA kit's own body aside: its callers are the sites) of

- a wait: ``.wait_event``, ``.wait_stream``, ``.wait_future`` (the kit), ``.wait()`` (a future, a
  work, an event), ``.synchronize()`` (an event, a stream, ``torch.cuda``);
- ``.record_stream``;
- an event ``.record``, as two mutants: left out, and recorded earlier (before the last work queued
  on its stream: the statement before each record makes its event or picks its stream, so moving
  the statement itself up one line is a NameError, not a race);
- a host read of device memory: ``.item()``, ``.tolist()``, and ``float``/``int``/``bool`` of one
  argument, whose mutant reads without making the host wait.

A new call site is mutated without anyone listing it. The sim (:class:`~tests.streams.sim.Sim`)
applies a :class:`~tests.streams.sim.Mutant` where the call runs, by its file and lines.
"""

from __future__ import annotations

import ast
import pathlib

from tests.streams.sim import Mutant

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
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
        if relative in SKIPPED:
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
