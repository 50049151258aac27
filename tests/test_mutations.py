"""The mutation list in tools/mutations.py stays applicable: each snippet occurs exactly once.

Fast and spawn-free, so CI notices when a refactor makes the list stale; the mutation run itself
(``python3 tools/mutations.py``) is too slow for CI.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "mutations.py"


def _mutations():
    spec = importlib.util.spec_from_file_location("overlapddp_mutations", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_every_mutation_snippet_occurs_exactly_once_in_the_package():
    assert _mutations().snippet_problems() == []


def test_mutations_have_unique_names_real_changes_and_tests_that_exist():
    tool = _mutations()
    names = [m.name for m in tool.MUTATIONS]
    assert len(names) == len(set(names))
    for m in tool.MUTATIONS:
        assert m.original != m.replacement and m.tests, m.name
        for node in m.tests:
            assert (tool.REPO / node.split("::")[0]).is_file(), f"{m.name}: {node}"


def test_a_stale_snippet_is_reported(tmp_path):
    tool = _mutations()
    shutil.copytree(tool.REPO / tool.PACKAGE, tmp_path / tool.PACKAGE)
    first = tool.MUTATIONS[0]
    stale = tmp_path / first.path
    stale.write_text(stale.read_text().replace(first.original, ""))
    assert tool.snippet_problems(tmp_path) == [
        f"{first.name}: its snippet occurs 0 times in {first.path}, expected once"
    ]


def test_every_injected_fault_replaces_an_attribute_that_exists():
    """A fault whose target moved would raise inside the rank and fail every parity check it feeds."""
    from tests.support import faults

    for name, make in faults.FAULTS.items():
        owner, attribute, _ = make()
        assert hasattr(owner, attribute), f"fault {name!r}: {owner!r} has no attribute {attribute!r}"
