"""Imports flow one way: planning and storage at the bottom, the reducer above them, the wrapper on top.

Parsed, not imported, so a violation fails here with the two modules named instead of surfacing as
an import cycle somewhere else. Imports under ``if TYPE_CHECKING:`` (for annotations only) must go
down too: a type-only cycle is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "overlapddp"
# overlapddp.integrations sits above every layer: only users import it, and only it imports a framework.
INTEGRATIONS = PACKAGE / "integrations"
SUBPACKAGES = {"bucket", "layout", "optim", "shard", "sanitize"}
FRAMEWORKS = {"lightning", "pytorch_lightning", "accelerate", "transformers", "ray", "torchft"}

# Lowest first; a module may import only from strictly lower layers.
# A module of a subpackage is named with its package: ``layout.plan``; ``layout`` is its ``__init__``.
LAYERS = [
    {"device_streams", "torch_compat", "clock", "backend_support", "options", "frames", "refusals",
     "bucket", "layout", "optim", "shard",  # (the folders' docstrings)
     "sanitize.clocks", "sanitize.collectives", "sanitize.memory"},  # the race detector: apart from the rest
    {"layout.plan", "bucket.storage", "fence", "bucket.comm_hook", "param_usage", "bucket.token_weighting",
     "module_sync", "optim.unscaler", "optim.takeover", "bucket.sparse_storage", "sync_checks", "progress",
     "sanitize.findings", "sanitize.streams", "sanitize.names", "sanitize.force",
     "shard.ownership", "shard.state", "shard.step_record"},
    {"layout.cost_model", "bucket.comm_hook_validation", "timeline", "delayed_reduction", "mixed_precision",
     "sanitize.completion",
     "layout.selection", "bucket.consumer", "bucket.gradient_checks"},
    {"layout.tuner", "bucket.reduction"},
    # Which layout is in force (initial, DDP's rebuild, tuning, final); how one bucket is reduced.
    {"layout.lifecycle", "bucket.pipeline", "sanitize.accesses"},
    {"reducer"},
    {"optim.guard", "optim.overlap", "join", "pickling", "shard.checks"},
    # The adapter between Dynamo's graphs and the wrapper (it knows fx, not module hooks), and the
    # constructor's steps (validate, resolve, synchronize: it reads the nn.Module).
    {"compile_split", "construction"},
    {"shard.optimizer"},  # each rank updates the parameters it owns, then broadcasts them
    {"attachment"},  # which optimizer takes over at attach_optimizer, after the refusal table
    {"wrapper", "shard.checkpoint",  # (the checkpoint functions read the sharded optimizer)
     "sanitize.detector"},  # (it hooks every module's forward, for parameter names)
    {"testing", "__init__", "sharded_checkpoint", "sanitize", "sanitize.__main__"},
]
# Below the wrapper nothing knows nn.Module or module hooks (the reducer is driven by mark_ready).
BELOW_THE_WRAPPER = set().union(*LAYERS[: LAYERS.index({"compile_split", "construction"})])


def _runtime_imports(path: Path, type_only_too: bool = False) -> tuple[set[str], bool]:
    """The package modules ``path`` imports at run time (and, ``type_only_too``, for annotations), and
    whether it imports ``torch.nn``."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    modules, uses_nn = set(), False
    for node in ast.walk(tree):
        if id(node) in type_only and not type_only_too:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "overlapddp":
                modules |= {alias.name for alias in node.names}
            elif node.module.startswith("overlapddp."):
                inner = node.module.split(".", 1)[1]
                if inner in SUBPACKAGES:  # from overlapddp.tuning import tuner: the module tuning.tuner
                    modules |= {f"{inner}.{alias.name}" for alias in node.names}
                else:
                    modules.add(inner)
            uses_nn |= node.module == "torch.nn" or (node.module == "torch" and any(a.name == "nn" for a in node.names))
        elif isinstance(node, ast.Import):
            uses_nn |= any(alias.name == "torch.nn" for alias in node.names)
    return modules, uses_nn


def _core_modules() -> list[Path]:
    """Every module of the package and its subpackages, the integrations left out."""
    return sorted(p for p in PACKAGE.rglob("*.py") if INTEGRATIONS not in p.parents)


def _name(path: Path) -> str:
    """``layout/plan.py`` -> ``layout.plan``; ``layout/__init__.py`` -> ``layout``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if len(parts) > 1 and parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_every_module_has_a_layer():
    assert {_name(p) for p in _core_modules()} == set().union(*LAYERS)


def test_imports_only_go_down_and_nothing_below_the_wrapper_knows_nn_module():
    upward, nn_users = [], []
    for path in _core_modules():
        imported, uses_nn = _runtime_imports(path)
        name = _name(path)
        upward += [f"{name} -> {m}" for m in sorted(imported) if _layer(m) >= _layer(name)]
        if uses_nn and name in BELOW_THE_WRAPPER:
            nn_users.append(name)
    assert upward == [], "imports that do not go down a layer"
    assert nn_users == [], "modules below the wrapper importing torch.nn"


def test_type_only_imports_go_down_too():
    upward = []
    for path in _core_modules():
        name = _name(path)
        upward += [f"{name} -> {m}" for m in sorted(_runtime_imports(path, type_only_too=True)[0])
                   if _layer(m) >= _layer(name)]
    assert upward == [], "type-only imports that do not go down a layer (a cycle for readers and mypy)"


def test_the_type_only_check_sees_a_type_only_cycle(tmp_path):
    fake = tmp_path / "join.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from overlapddp.wrapper import OverlapDDP\n")
    assert _runtime_imports(fake)[0] == set()
    assert _runtime_imports(fake, type_only_too=True)[0] == {"wrapper"}


def _reaches_into_reducer(path: Path) -> list[int]:
    """Lines where ``path`` reads another object's ``_reducer`` (its own ``self._reducer`` is allowed)."""
    return [
        node.lineno for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "_reducer"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]


def test_join_integrations_and_testing_use_the_wrappers_named_interface():
    # The wrapper's named methods (arm_backward, fence, replace_fence, the join hook's protocol in
    # join.py) are the interface; nothing outside the wrapper reaches into its reducer.
    outside = [p for p in PACKAGE.rglob("*.py") if p.name != "wrapper.py"]
    poking = {str(p.relative_to(PACKAGE)): lines for p in outside if (lines := _reaches_into_reducer(p))}
    assert poking == {}


def test_the_check_sees_a_poke_into_the_reducer(tmp_path):
    fake = tmp_path / "testing.py"
    fake.write_text("def f(model):\n    return model._reducer.fence\n")
    assert _reaches_into_reducer(fake) == [2]


def test_the_check_sees_an_upward_import(tmp_path):
    # The test above must be able to fail: a reducer that imported the wrapper would be reported.
    fake = tmp_path / "reducer.py"
    fake.write_text("from overlapddp.wrapper import OverlapDDP\nfrom torch import nn\n")
    imported, uses_nn = _runtime_imports(fake)
    assert imported == {"wrapper"} and uses_nn and _layer("wrapper") >= _layer("reducer")


def _external_roots(path: Path) -> set[str]:
    """The top-level names of the packages outside overlapddp that ``path`` imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
    return roots - {"overlapddp"}


def test_integrations_are_a_top_layer_and_the_only_modules_importing_a_framework():
    core = _core_modules()
    into_integrations = [
        f"{_name(p)} -> {m}" for p in core for m in sorted(_runtime_imports(p)[0]) if m.startswith("integrations")
    ]
    framework_users = [f"{_name(p)}: {sorted(_external_roots(p) & FRAMEWORKS)}" for p in core
                       if _external_roots(p) & FRAMEWORKS]
    assert into_integrations == [], "the package imports its integrations"
    assert framework_users == [], "modules below the integrations import a framework"
    for path in sorted(INTEGRATIONS.glob("*.py")):
        imported = {m for m in _runtime_imports(path)[0] if not m.startswith("integrations")}
        assert imported <= set().union(*LAYERS), f"integrations/{path.name} imports unknown modules {imported}"


def test_the_check_sees_a_framework_import(tmp_path):
    fake = tmp_path / "reducer.py"
    fake.write_text("import lightning.pytorch as pl\nfrom overlapddp.integrations import lightning\n")
    assert _external_roots(fake) & FRAMEWORKS == {"lightning"}
    assert _runtime_imports(fake)[0] == {"integrations"}


def test_the_module_map_in_the_docs_names_every_module():
    text = (PACKAGE.parent / "docs" / "how_it_works.md").read_text()
    documented = set(re.findall(r"`([a-z_/]+)\.py`", text))
    modules = {name.replace(".", "/") for name in set().union(*LAYERS)} - {"__init__"} - SUBPACKAGES
    assert sorted(modules - documented) == [], "modules missing from the map in docs/how_it_works.md"
