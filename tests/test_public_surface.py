"""What users import: the public paths keep working, and the built wheel ships every module.

The public surface (overlapddp's docstring lists it): ``overlapddp.OverlapDDP``, ``overlapddp.testing``,
``overlapddp.timeline``, ``overlapddp.fence`` (the fences ``testing`` wraps), the checkpoint functions
at ``overlapddp.sharded_checkpoint``, ``overlapddp.sanitize`` and ``overlapddp.integrations.*``.
Everything else (``bucket/``, ``layout/``, ``shard/``, ``optim/`` and the hall's other modules) is
private and may move.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PUBLIC = {
    "overlapddp": ["OverlapDDP"],
    "overlapddp.testing": ["delay_communication", "delay_parameter_gathers", "unfenced", "SynchronousReference", "STAGES"],
    "overlapddp.timeline": ["bucket_spans"],
    "overlapddp.fence": ["Fence", "FenceLog"],
    "overlapddp.sharded_checkpoint": ["save_sharded", "load_sharded"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_path_imports_with_its_names(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert missing == [], f"{module} lost {missing}"


def test_the_package_docstring_names_the_public_surface() -> None:
    doc = importlib.import_module("overlapddp").__doc__ or ""
    for module in [*PUBLIC, "overlapddp.sanitize", "overlapddp.integrations"]:
        assert f"``{module}``" in doc, module


def test_the_wheel_ships_every_module(tmp_path: Path) -> None:
    """Built as pip builds it (no network: the installed setuptools), from a copy of what the build reads
    (setuptools writes build/ beside the sources)."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "overlapddp", source / "overlapddp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("overlapddp-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    sources = {str(p.relative_to(REPO)) for p in (REPO / "overlapddp").rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(sources - shipped) == []
