"""Charts for ``benchmarks/compare.py --plot DIR``, drawn from its results (matplotlib, optional).

Two PNGs per run, named after the model (and the emulated link, if any):

- ``<name>_step_times.png``: every timed step of each variant (box and points), with the ratio
  of the per-repeat medians in the title;
- ``<name>_timeline.png``: one representative OverlapDDP step on rank 0 (the step whose time is
  nearest the median), a bar per bucket from ready to launched and from launched to completed,
  and vertical lines at the end of backward and the end of the step.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any


def matplotlib_available() -> bool:
    """Whether ``--plot`` can work, checked before any rank starts."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def run_name(config: dict[str, Any]) -> str:
    """File-name stem: the model, then the link if one was emulated."""
    name = str(config["model"])
    if config.get("link_gbps") is not None:
        name += f"_link{config['link_gbps']:g}gbps"
    return name


def _setting(config: dict[str, Any]) -> str:
    link = f", {config['link_gbps']:g} Gbit/s link" if config.get("link_gbps") is not None else ""
    return f"{config['model']}, {config['world_size']} ranks{link}"


def step_time_chart(results: dict[str, Any], config: dict[str, Any], path: Path) -> Path:
    """Box plot and points of every timed step's slowest-rank time, per variant."""
    plt = _pyplot()
    labels = list(results["labels"])
    steps = [[t for block in results["variants"][label]["step_ms"] for t in block] for label in labels]
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=100)
    ax.boxplot(steps, showfliers=False, widths=0.5)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    jitter = random.Random(0)  # fixed, so reruns draw the same picture for the same numbers
    for position, times in enumerate(steps, start=1):
        xs = [position + jitter.uniform(-0.15, 0.15) for _ in times]
        ax.scatter(xs, times, s=10, alpha=0.6, zorder=3)
    ax.set_ylabel("step time, slowest rank (ms)")
    ax.set_title(
        f"{_setting(config)}: {sum(map(len, steps)) // len(steps)} timed steps per variant\n"
        f"{labels[1]}/{labels[0]} ratio of repeat medians: {results['ratio_median']:.3f} "
        f"[{results['ratio_min']:.3f}, {results['ratio_max']:.3f}]; bit-equal: {results['bit_equal']}",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def timeline_chart(results: dict[str, Any], config: dict[str, Any], path: Path) -> Path:
    """Bucket bars of the representative OverlapDDP step on rank 0."""
    plt = _pyplot()
    line = results["timeline"]
    step = line["representative_step"]
    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.45 * len(step["buckets"])), dpi=100)
    waiting = reducing = False
    for b in step["buckets"]:
        y = b["bucket"]
        if b["ready_ms"] is not None and b["launched_ms"] is not None:
            ax.barh(y, b["launched_ms"] - b["ready_ms"], left=b["ready_ms"], height=0.6,
                    color="tab:orange", label=None if waiting else "ready → launched")
            ax.plot([b["ready_ms"]], [y], marker="|", markersize=14, color="tab:orange")
            waiting = True
        if b["launched_ms"] is not None and b["completed_ms"] is not None:
            ax.barh(y, b["completed_ms"] - b["launched_ms"], left=b["launched_ms"], height=0.6,
                    color="tab:blue", label=None if reducing else "launched → completed (future waited)")
            reducing = True
    ax.axvline(step["backward_end_ms"], color="tab:red", label="end of backward")
    ax.axvline(step["local_step_ms"], color="gray", linestyle="--", label="end of step (after optimizer)")
    buckets = [b["bucket"] for b in step["buckets"]]
    ax.set_yticks(buckets, [f"bucket {b}" for b in buckets])
    ax.set_ylim(max(buckets) + 0.6, min(buckets) - 0.6)  # bucket 0, launched first, on top
    ax.set_xlim(0, step["local_step_ms"] * 1.02)
    ax.set_xlabel("ms since the step started (rank 0; forward first, then backward)")
    ax.set_title(
        f"{_setting(config)}: OverlapDDP step {step['index'] + 1} of {line['steps']} "
        f"(nearest the median, {step['step_ms']:.1f} ms)\n"
        f"exposed communication {step['exposed_communication_ms']:.2f} ms "
        f"(median over steps {line['exposed_communication_ms']['median']:.2f} ms); "
        f"last bucket ready: {line['last_ready_bucket']['most_common']}",
        fontsize=9,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], config: dict[str, Any], directory: Path) -> list[Path]:
    """Write the step-time chart and, when OverlapDDP recorded a timeline, the bucket chart."""
    directory.mkdir(parents=True, exist_ok=True)
    name = run_name(config)
    written = [step_time_chart(results, config, directory / f"{name}_step_times.png")]
    if results.get("timeline") is not None:
        written.append(timeline_chart(results, config, directory / f"{name}_timeline.png"))
    return written
