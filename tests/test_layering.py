"""Imports flow one way: planning and storage at the bottom, the reducer above them, the wrapper on top.

Parsed, not imported, so a violation fails here with the two modules named instead of surfacing as
an import cycle somewhere else. Imports under ``if TYPE_CHECKING:`` are for annotations only and
do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "overlapddp"
# overlapddp.integrations sits above every layer: only users import it, and only it imports a framework.
INTEGRATIONS = PACKAGE / "integrations"
FRAMEWORKS = {"lightning", "pytorch_lightning", "accelerate", "transformers", "ray"}

# Lowest first; a module may import only from strictly lower layers.
LAYERS = [
    {"device_streams", "torch_compat", "backend_support"},
    {"bucket_plan", "bucket_storage", "fence", "comm_hook", "param_usage", "token_weighting", "module_sync",
     "bucket_unscaler", "sparse_reduction", "clock"},
    {"tuned_plan", "comm_hook_validation", "timeline", "delayed_reduction", "mixed_precision", "plan_selection"},
    {"plan_tuner"},
    {"reducer"},
    {"optimizer_guard", "optimizer_overlap", "join", "pickling"},
    {"compile_split"},  # the adapter between Dynamo's graphs and the wrapper (it knows fx, not module hooks)
    {"wrapper"},
    {"testing", "__init__"},
]
# Below the wrapper nothing knows nn.Module or module hooks (the reducer is driven by mark_ready).
BELOW_THE_WRAPPER = set().union(*LAYERS[:6])


def _runtime_imports(path: Path) -> tuple[set[str], bool]:
    """The package modules ``path`` imports at run time, and whether it imports ``torch.nn``."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    modules, uses_nn = set(), False
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "overlapddp":
                modules |= {alias.name for alias in node.names}
            elif node.module.startswith("overlapddp."):
                modules.add(node.module.split(".", 1)[1])
            uses_nn |= node.module == "torch.nn" or (node.module == "torch" and any(a.name == "nn" for a in node.names))
        elif isinstance(node, ast.Import):
            uses_nn |= any(alias.name == "torch.nn" for alias in node.names)
    return modules, uses_nn


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_every_module_has_a_layer():
    assert {p.stem for p in PACKAGE.glob("*.py")} == set().union(*LAYERS)


def test_imports_only_go_down_and_nothing_below_the_wrapper_knows_nn_module():
    upward, nn_users = [], []
    for path in sorted(PACKAGE.glob("*.py")):
        imported, uses_nn = _runtime_imports(path)
        upward += [f"{path.stem} -> {m}" for m in sorted(imported) if _layer(m) >= _layer(path.stem)]
        if uses_nn and path.stem in BELOW_THE_WRAPPER:
            nn_users.append(path.stem)
    assert upward == [], "imports that do not go down a layer"
    assert nn_users == [], "modules below the wrapper importing torch.nn"


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
    core = sorted(PACKAGE.glob("*.py"))
    into_integrations = [
        f"{p.stem} -> {m}" for p in core for m in sorted(_runtime_imports(p)[0]) if m.startswith("integrations")
    ]
    framework_users = [f"{p.stem}: {sorted(_external_roots(p) & FRAMEWORKS)}" for p in core
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
