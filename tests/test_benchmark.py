"""Smoke tests for benchmarks/compare.py, beyond_ddp.py and sharded_optimizer.py: tiny runs (over the
emulated link for the first two), and compare.py's charts.

Each run spawns two fresh gloo ranks, so a test takes seconds; the MLP with one or two timed steps
per repeat keeps one run well under half a minute on two CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.link import LinkState, ring_allreduce_seconds
from overlapddp.layout import tuner

REPO = Path(__file__).resolve().parent.parent
COMPARE = REPO / "benchmarks" / "compare.py"
BEYOND_DDP = REPO / "benchmarks" / "beyond_ddp.py"
SHARDED_OPTIMIZER = REPO / "benchmarks" / "sharded_optimizer.py"
RUN_TIMEOUT_S = 120
TINY_RUN = ["--model", "mlp", "--steps", "2", "--warmup", "1", "--repeats", "2", "--link-gbps", "1"]


def run_script(script: Path, *args: str, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a benchmark script on CPU ranks with ``args``; returns the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )


def compare(*args: str) -> subprocess.CompletedProcess[str]:
    """Run compare.py on two CPU ranks with ``args``; returns the finished process."""
    return run_script(COMPARE, *args)


def check_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{Path(result.args[1]).name} exited with {result.returncode}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr}"
    )


def test_link_queues_buckets_on_one_serialized_link():
    # 2 ranks: a ring all-reduce sends the bucket once; 1.25e8 bytes at 1 Gbit/s take 1 s.
    assert ring_allreduce_seconds(125_000_000, 2, 1.0) == pytest.approx(1.0)
    link = LinkState(gbps=1.0)
    assert link.occupy(125_000_000, 2, now=10.0) == pytest.approx(11.0)  # idle link: starts at launch
    assert link.occupy(125_000_000, 2, now=10.5) == pytest.approx(12.0)  # waits for the first bucket
    assert link.occupy(125_000_000, 4, now=20.0) == pytest.approx(21.5)  # free again; 4 ranks send 1.5x
    with pytest.raises(ValueError, match="gbps"):
        LinkState(gbps=0.0)


def test_compare_over_emulated_link_is_bit_equal_and_reports_the_timeline(tmp_path):
    path = tmp_path / "result.json"
    result = compare(*TINY_RUN, "--json", str(path))
    check_ok(result)
    payload = json.loads(path.read_text())
    assert payload["bit_equal"] is True
    assert payload["link"]["gbps"] == 1.0 and payload["link"]["link_ms_per_step"] > 0
    timeline = payload["timeline"]
    assert timeline["steps"] == 4  # 2 repeats of 2 timed steps
    assert timeline["exposed_communication_ms"]["median"] >= 0
    assert len(timeline["last_ready_bucket"]["per_step"]) == 4
    assert timeline["representative_step"]["buckets"]
    assert "exposed communication median" in result.stdout
    assert "left" in result.stderr or "done in" in result.stderr  # progress with time remaining


def test_compare_writes_charts(tmp_path):
    pytest.importorskip("matplotlib")
    result = compare(*TINY_RUN, "--plot", str(tmp_path))
    check_ok(result)
    charts = sorted(p.name for p in tmp_path.glob("*.png"))
    assert charts == ["mlp_link1gbps_step_times.png", "mlp_link1gbps_timeline.png"]
    for chart in charts:
        assert (tmp_path / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_optimizer_overlap_over_the_link_stays_bit_equal(tmp_path):
    path = tmp_path / "result.json"
    check_ok(compare(*TINY_RUN, "--optimizer-overlap", "--json", str(path)))
    assert json.loads(path.read_text())["bit_equal"] is True


def test_beyond_ddp_reports_every_variant_bit_equal_against_ddp_and_the_bound(tmp_path):
    path = tmp_path / "beyond.json"
    # The default warm-up lets the tuned variants settle (the run stops if they have not): 12
    # variants x 21 steps, about 40 s on an idle 2-core machine.
    result = run_script(BEYOND_DDP, "--models", "mlp", "--steps", "1", "--repeats", "2", "--json", str(path),
                        timeout_s=4 * RUN_TIMEOUT_S)
    check_ok(result)
    payload = json.loads(path.read_text())
    expected = ["ddp-25", "ddp-1", "ddp-5", "ours-25", "ours-1", "ours-5", "ours-tuned",
                "ours-25+opt", "ours-1+opt", "ours-5+opt", "ours-tuned+opt", "local"]
    mlp = payload["models"]["mlp"]
    rows = mlp["variants"]
    assert list(rows) == expected
    # Warm-up plus repeats x steps, the same for all.
    assert mlp["steps_per_variant"] == 2 + tuner.TUNING_ITERATIONS + 2 * 1
    for label, row in rows.items():
        # Same data, same step count, bucket_cap_mb does not change the sum at world size 2.
        if label != "local":
            assert row["bit_equal"] is True, (label, row["rank0_mismatched_tensors"])
        ratios = [row["vs_bound"]]
        ratios += [row[key][stat] for key in ("vs_ddp_default", "vs_best_ddp") for stat in ("median", "min", "max")]
        assert all(math.isfinite(r) and r > 0 for r in ratios), (label, ratios)
    assert rows["local"]["bit_equal"] is None
    for label, pool in (("ours-tuned", ("ddp-", "ours-1", "ours-5", "ours-25")), ("ours-tuned+opt", ("ours-",))):
        fixed = [other for other in rows if other.startswith(pool) and "tuned" not in other
                 and other.endswith("+opt") == label.endswith("+opt")]
        assert rows[label]["best_fixed"] == min(fixed, key=lambda other: rows[other]["median_step_ms"])
        assert f"{label}_no_slower_than_best_fixed" in mlp["targets"]
    ddp = [label for label in rows if label.startswith("ddp-")]
    assert mlp["best_ddp"] == min(ddp, key=lambda label: rows[label]["median_step_ms"])
    assert rows[mlp["best_ddp"]]["vs_best_ddp"]["median"] == 1
    bound = mlp["bound"]
    assert bound["bound_ms"] > 0 and bound["bound_ms"] >= bound["forward_ms"] + bound["optimizer_ms"]
    assert bound["bound_ms"] == pytest.approx(
        bound["forward_ms"] + max(bound["backward_ms"], bound["communication_ms"]) + bound["optimizer_ms"]
    )
    link_ms = ring_allreduce_seconds(bound["gradient_bytes_per_step"], 2, 1.0) * 1e3
    assert bound["communication_ms"] == pytest.approx(link_ms)
    assert "vs best DDP" in result.stdout and "bound T_f + max(T_b, T_c) + T_opt" in result.stdout
    assert "left" in result.stderr or "done in" in result.stderr


def test_sharded_optimizer_benchmark_is_bit_equal_every_step_with_half_the_state(tmp_path):
    path = tmp_path / "sharded.json"
    # One warm-up step and two repeats of one, with Muon and with AdamW.
    result = run_script(SHARDED_OPTIMIZER, "--models", "muon_lm,transformer", "--steps", "1", "--repeats", "2",
                        "--warmup", "1", "--batch-size", "2", "--json", str(path))
    check_ok(result)
    payload = json.loads(path.read_text())
    assert len(payload["commit"]) == 40
    assert payload["zero_overlap_with_ddp_error"].startswith("RuntimeError: Gloo backend")
    for name, targets in (("muon_lm", {"ours_step_at_most_0.90_of_ddp", "ours_faster_than_zero"}),
                          ("transformer", {"ours_state_at_most_ddp_over_n_plus_1pct", "ours_no_slower_than_ddp"})):
        model = payload["models"][name]
        assert model["steps_compared"] == 3 and model["first_in_repeat"] == ["ddp", "zero"]
        assert 0 < model["ddp_optimizer_share_of_step"] < 1
        rows = model["variants"]
        assert list(rows) == ["ddp", "zero", "ours"]
        for label, row in rows.items():
            assert row["bit_equal_every_step"] is True, (label, row["rank0_first_mismatches"])
            assert all(b > 0 for b in row["memory"]["later_step_peak_bytes"]), label
        assert model["targets"].keys() == {"ours_bit_equal_every_step", *targets}
        assert model["targets"]["ours_bit_equal_every_step"] is True
        assert rows["ddp"]["state_vs_ddp_over_n"] == 2  # DDP holds everything: N times its share
        assert rows["zero"]["state_bytes_per_rank"] != rows["ddp"]["state_bytes_per_rank"]
    assert payload["models"]["transformer"]["targets"]["ours_state_at_most_ddp_over_n_plus_1pct"] is True
    muon = payload["models"]["muon_lm"]["variants"]
    assert sum(muon["ours"]["muon_state_bytes_per_rank"]) == muon["ddp"]["muon_state_bytes_per_rank"][0]
    assert "did not run: RuntimeError" in result.stdout and "Muon state / (ddp/N)" in result.stdout


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    # A None entry in sys.modules makes the import system report matplotlib as absent.
    script = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = ['compare.py', '--plot', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(COMPARE)!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode != 0
    assert "pip install matplotlib" in result.stderr
    assert not list(tmp_path.iterdir())
