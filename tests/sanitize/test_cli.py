"""``torchrun -m overlapddp.sanitize SCRIPT``: real scripts, unchanged, on two gloo ranks.

A racy hand-written loop exits non-zero with each rank's report naming the gradient and both lines;
the project's race demo is found in its unfenced (test-only) copy; a nanoGPT-shaped loop (DDP and
OverlapDDP) and the examples run clean, exit 0, with empty reports. In-process: the exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlapddp.sanitize.__main__ import FOUND, main

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 240


def sanitize(tmp_path: Path, script: Path, *args: str, force: bool = False) -> tuple[int, list[list[dict]], str]:
    """Run ``script`` on two ranks under the detector: the exit status, each rank's report, stderr."""
    reports = tmp_path / "reports"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "overlapddp.sanitize", "--report-dir", str(reports), *(["--force"] if force else []),
               str(script.relative_to(REPO)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    found = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(2)]
    return result.returncode, found, result.stderr


def test_a_racy_manual_loop_is_found_on_both_ranks_with_its_lines(tmp_path):
    status, reports, stderr = sanitize(tmp_path, SCRIPTS / "racy_manual.py")
    assert status != 0
    for rank, findings in enumerate(reports):
        assert {f["kind"] for f in findings} == {"read-before-complete"}
        first = findings[0]
        assert first == {"kind": "read-before-complete", "tensor": "0.weight.grad (float32[64, 32])",
                         "collective": "all_reduce over 2 ranks",
                         "launched_at": "tests/sanitize/scripts/racy_manual.py:21",
                         "accessed_at": "tests/sanitize/scripts/racy_manual.py:22", "access": "aten.add_", "rank": rank}
        assert len(findings) == 4  # one per gradient: the same race in later steps is not repeated
    assert "overlapddp.sanitize: rank 1: read-before-complete: 0.weight.grad (float32[64, 32]) read by" in stderr


def test_the_race_demos_unfenced_copy_is_found(tmp_path):
    status, reports, _ = sanitize(tmp_path, REPO / "examples" / "race_demo.py", "--steps", "2")
    assert status != 0
    for findings in reports:
        assert findings and {f["kind"] for f in findings} == {"read-before-complete"}
        assert {f["access"] for f in findings} == {"aten._foreach_copy_"}  # the copy into .grad, unfenced


@pytest.mark.parametrize("script, args", [
    (SCRIPTS / "nanogpt_loop.py", ()),
    (SCRIPTS / "nanogpt_loop.py", ("--overlap",)),
    (REPO / "examples" / "train_lm.py", ("--steps", "2")),
    (REPO / "examples" / "comm_hook_powersgd.py", ("--steps", "3")),
], ids=["nanogpt-ddp", "nanogpt-overlapddp", "train_lm", "comm_hook_powersgd"])
def test_real_scripts_run_clean(tmp_path, script, args):
    status, reports, stderr = sanitize(tmp_path, script, *args)
    assert (status, reports) == (0, [[], []]), stderr


def test_the_exit_status_is_the_scripts_failure_else_whether_anything_was_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    monkeypatch.setattr(sys, "path", sys.path[:])
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(5)\n")
    assert main([str(quiet), "--an-argument"]) == 0
    assert sys.argv == [str(quiet), "--an-argument"]  # the script sees its own arguments
    assert main([str(failing)]) == 5
    with pytest.raises(SystemExit, match="no such script"):
        main([str(tmp_path / "missing.py")])
    assert FOUND != 0
