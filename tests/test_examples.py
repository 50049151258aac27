"""Smoke tests for examples/: each script trains a few steps under torchrun with two gloo ranks.

Each run starts two fresh interpreters, so each test takes seconds, not milliseconds; the models
and images are kept tiny so that one run stays well under half a minute on two CPU cores.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
RUN_TIMEOUT_S = 180
# resnet18 at 32x32 pixels, four images per micro-batch: the cheapest torchvision model that has BatchNorm buffers.
TINY_VISION = ["--model", "resnet18", "--image-size", "32", "--batch-size", "4"]
STEP_LINE = re.compile(r"^step (\d+): loss (\S+),", re.MULTILINE)


def torchrun(script: str, *args: str) -> str:
    """Run ``examples/script`` on two ranks; returns its stdout, which holds rank 0's step lines."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / script), *args,
    ]
    # Hide GPUs: this is the CPU tier (gloo), and two ranks would need two GPUs.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result.stdout


def losses(stdout: str) -> dict[int, float]:
    """``{step: loss}`` from the ``step N: loss X, T ms`` lines; every loss must be finite."""
    found = {int(step): float(loss) for step, loss in STEP_LINE.findall(stdout)}
    assert all(math.isfinite(loss) for loss in found.values()), stdout
    return found


def test_train_torchvision_two_steps_with_no_sync_accumulation():
    stdout = torchrun("train_torchvision.py", "--steps", "2", "--grad-accum", "2", *TINY_VISION)
    assert "OverlapDDP(resnet18)" in stdout
    assert set(losses(stdout)) == {0, 1}, stdout


def test_train_torchvision_resume_from_ddp_checkpoint_continues_as_uninterrupted_run(tmp_path):
    """Stock DDP trains two steps and saves; OverlapDDP resumes and must print the losses that an
    uninterrupted four-step run prints: same weights, momentum, step and data order."""
    checkpoint = tmp_path / "ckpt.pt"
    common = ["--grad-accum", "2", *TINY_VISION]
    uninterrupted = losses(torchrun("train_torchvision.py", "--steps", "4", *common))

    first = torchrun("train_torchvision.py", "--steps", "2", "--ddp", "--checkpoint", str(checkpoint), *common)
    assert "DistributedDataParallel(resnet18)" in first
    assert f"saved step 2 to {checkpoint}" in first
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["step"] == 2
    assert all(key.startswith("module.") for key in saved["model"]), list(saved["model"])[:3]
    assert saved["optimizer"]["state"], "the SGD momentum buffers were not saved"

    resumed = torchrun("train_torchvision.py", "--steps", "4", "--resume", "--checkpoint", str(checkpoint), *common)
    assert "OverlapDDP(resnet18)" in resumed and "steps 2..3" in resumed
    resumed_losses = losses(resumed)
    assert set(resumed_losses) == {2, 3}, resumed
    # Printed with four decimals; OverlapDDP is bit-equal to DDP, so only rounding can differ.
    first_losses = losses(first)
    assert first_losses == pytest.approx({0: uninterrupted[0], 1: uninterrupted[1]}, abs=1e-3)
    assert resumed_losses == pytest.approx({2: uninterrupted[2], 3: uninterrupted[3]}, abs=1e-3)
    assert torch.load(checkpoint, weights_only=True)["step"] == 4


def test_train_lm_require_backward_grad_sync_accumulation_matches_ddp():
    ours = torchrun("train_lm.py", "--steps", "2", "--grad-accum", "2")
    theirs = torchrun("train_lm.py", "--steps", "2", "--grad-accum", "2", "--ddp")
    assert "OverlapDDP(TinyLM" in ours and "DistributedDataParallel(TinyLM" in theirs
    assert set(losses(ours)) == {0, 1}, ours
    assert losses(ours) == pytest.approx(losses(theirs), abs=1e-3)


def test_train_lm_token_weighted_runs_with_uneven_batches():
    stdout = torchrun("train_lm.py", "--steps", "2", "--grad-accum", "2", "--token-weighted")
    assert set(losses(stdout)) == {0, 1}, stdout


def test_comm_hook_powersgd_compresses_every_bucket_from_step_two():
    """Three steps, since ``start_powerSGD_iter=2`` makes steps 0 and 1 plain all-reduces; resnet18's
    11 buckets at ``bucket_cap_mb=1`` must all be compressed (stock DDP on gloo dies at step 2)."""
    stdout = torchrun("comm_hook_powersgd.py", "--steps", "3")
    assert "OverlapDDP(resnet18) + powerSGD_hook" in stdout, stdout
    assert set(losses(stdout)) == {0, 1, 2}, stdout
    counters = re.search(r"^PowerSGD: iteration (\d+), (\d+) buckets compressed", stdout, re.MULTILINE)
    assert counters is not None, stdout
    iteration, buckets = map(int, counters.groups())
    assert iteration == 3 and buckets > 1, stdout


def test_race_demo_fenced_matches_ddp_and_unfenced_does_not():
    stdout = torchrun("race_demo.py", "--steps", "2")
    fenced = re.findall(r"^step \d+: fenced equal=(\w+) max_abs_diff=(\S+) \|", stdout, re.MULTILINE)
    assert fenced == [("True", "0.000e+00")] * 2, stdout
    assert "fenced: matches DDP" in stdout.splitlines(), stdout
    # The test-only unfenced mode reads gradients before their all-reduce completes.
    assert "unfenced: WRONG weights" in stdout, stdout
    assert re.search(r"^step 1: .*\| unfenced equal=False", stdout, re.MULTILINE), stdout
