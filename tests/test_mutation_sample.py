"""A fixed sample of cosmic-ray's mutants (tools/mutation_sample.py) is killed by the tests.

The whole run (``python3 tools/mutation_run.py``, docs/testing.md) takes hours; this sample keeps
CI honest about it in a few minutes: each sampled mutant is written into a scratch copy of the
repository and its tests run there, in a subprocess, and must fail. The working tree is never
touched. Needs the ``test`` extra (cosmic-ray makes the mutants).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray", reason="cosmic-ray comes with the test extra: pip install -e '.[test]'")

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(TOOLS))  # mutation_run and mutation_sample import their neighbours
run = _load("mutation_run")
SAMPLE = _load("mutation_sample").SAMPLE


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutation-sample") / "repo"
    shutil.copytree(run.REPO, root, ignore=run.COPY_IGNORE)
    return root


def test_the_sample_names_mapped_modules_and_existing_tests():
    assert SAMPLE and len(set(SAMPLE)) == len(SAMPLE)
    for sampled in SAMPLE:
        assert sampled.module in run.MODULE_TESTS, sampled
        for node in sampled.tests:
            assert (run.REPO / node.split("::")[0]).is_file(), f"{sampled}: {node}"


def test_a_changed_line_makes_its_sampled_mutant_stale(scratch):
    sampled = SAMPLE[0]
    path = scratch / sampled.module
    original = path.read_text()
    try:
        stale = run.Sampled(sampled.module, sampled.operator, "no such line => none", sampled.tests)
        with pytest.raises(LookupError, match="no .* mutant changes"):
            run.mutate_sampled(scratch, stale)
    finally:
        path.write_text(original)


@pytest.mark.parametrize("sampled", SAMPLE, ids=lambda s: f"{Path(s.module).stem}-{s.change[:40]}")
def test_the_sampled_mutant_is_killed(scratch, sampled):
    path = scratch / sampled.module
    original = path.read_text()
    try:
        run.mutate_sampled(scratch, sampled)
        done = subprocess.run(
            [sys.executable, *run.PYTEST.split(), *sampled.tests],
            cwd=scratch,
            env=dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        path.write_text(original)
    assert done.returncode != 5, f"{sampled.tests} collected no test:\n{done.stdout[-2000:]}"
    assert done.returncode != 0, f"mutant survived: {sampled.module}: {sampled.change}\n{done.stdout[-2000:]}"
