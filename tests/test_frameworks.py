"""The framework snippets in docs/frameworks.md: run as written, on two gloo ranks, bit-equal to the
framework's own DDP.

Each snippet is extracted from the document (a ```python block whose first line names the file), so
the document cannot drift from what is tested. Each test runs the snippet twice under torchrun, with
OverlapDDP and with the framework's DDP (``--ddp``), two optimizer steps of two accumulated
micro-batches each, and compares the printed losses and the SHA-256 of the final parameters. The
frameworks are not test dependencies: without them the tests skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "frameworks.md"
RUN_TIMEOUT_S = 120
BATCH_LINE = re.compile(r"^batch (\d+): loss (\S+) \((\w+)\)$", re.MULTILINE)
DIGEST_LINE = re.compile(r"parameters sha256 ([0-9a-f]{16})$", re.MULTILINE)


def snippet(name: str) -> str:
    """The ```python block of docs/frameworks.md whose first line is ``# name``."""
    blocks = re.findall(r"^```python\n# (\S+)\n(.*?)^```$", DOC.read_text(), re.MULTILINE | re.DOTALL)
    found = [code for file, code in blocks if file == name]
    assert len(found) == 1, f"expected one block for {name} in {DOC}, found {len(found)}"
    return found[0]


def torchrun(script: Path, *args: str) -> str:
    """Run ``script`` on two CPU ranks; returns stdout (rank 0's lines)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args,
    ]
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result.stdout


def run_both(tmp_path: Path, name: str) -> tuple[str, str]:
    script = tmp_path / name
    script.write_text(snippet(name))
    return torchrun(script), torchrun(script, "--ddp")


def check_bit_equal(ours: str, theirs: str) -> None:
    """Two optimizer steps of two micro-batches: four batch lines, the wrapper named in each, same bits."""
    our_batches, their_batches = BATCH_LINE.findall(ours), BATCH_LINE.findall(theirs)
    assert [(b, w) for b, _, w in our_batches] == [(str(i), "OverlapDDP") for i in range(4)], ours
    assert [(b, w) for b, _, w in their_batches] == [(str(i), "DistributedDataParallel") for i in range(4)], theirs
    assert [loss for _, loss, _ in our_batches] == [loss for _, loss, _ in their_batches]
    (our_digest,), (their_digest,) = DIGEST_LINE.findall(ours), DIGEST_LINE.findall(theirs)
    assert our_digest == their_digest, (ours, theirs)


def test_lightning_overlapddp_strategy_is_bit_equal_to_ddp_strategy(tmp_path):
    pytest.importorskip("lightning")
    ours, theirs = run_both(tmp_path, "lightning_overlapddp.py")
    assert "OverlapDDPStrategy: parameters sha256" in ours and "DDPStrategy: parameters sha256" in theirs
    check_bit_equal(ours, theirs)


def test_accelerate_with_overlapddp_is_bit_equal_to_prepared_ddp(tmp_path):
    pytest.importorskip("accelerate")
    check_bit_equal(*run_both(tmp_path, "accelerate_overlapddp.py"))
