"""OverlapDDP's tuned bucket plan against every fixed bucket size, stock DDP's and its own, with and
without optimizer overlap, and against a lower bound, over one emulated slow link, from one
interleaved run.

Launch (the script spawns its own ranks; no torchrun needed):

    python benchmarks/beyond_ddp.py --models resnet18,mobilenet_v3_small,transformer --link-gbps 1

Variants, all in one process group, each with its own model built from ``--seed``, its own
SGD(lr=0.01, momentum=0.9) and its own emulated link of ``--link-gbps`` Gbit/s per rank
(``benchmarks/link.py``'s hook, registered on stock DDP and OverlapDDP alike):

- ``ddp-25`` (stock DDP with its default ``bucket_cap_mb``: a 1 MiB first bucket, then 25 MiB; the
  reference), ``ddp-1``, ``ddp-5`` (stock DDP with that ``bucket_cap_mb``);
- ``ours-25``, ``ours-1``, ``ours-5``: OverlapDDP with the same caps; ``ours-tuned``: with
  ``bucket_plan="tuned"``;
- ``ours-25+opt``, ..., ``ours-tuned+opt``: the same with ``attach_optimizer(optimizer, overlap=True)``,
  which updates each bucket's parameters as soon as that bucket is reduced;
- ``local``: the bare module, without wrapper or communication, timed per phase for the bound.

``--models transformer`` is compare.py's TinyLM with ``--lm-layers`` layers; ``mlp`` is its
400-tensor MLP.

Method: every variant first runs ``--warmup`` untimed steps: the tuned plan measures, models and
selects its layout during its first iterations (at most ``2 + TUNING_ITERATIONS`` steps), and the
run stops with an error if a tuned variant has not settled by then, so the timed steps never include
the tuning. Then each of ``--repeats`` repeats runs a block of ``--steps`` steps of every variant,
starting one variant later each repeat so that none is always first. A step's time is its slowest
rank's. Ratios against ``ddp-25``, against the fastest ``ddp-X`` (lowest median step) and against
the fastest fixed layout of the same kind (``ddp-X`` and ``ours-X`` without optimizer overlap,
``ours-X+opt`` with it) are medians over repeats of per-repeat ratios of block medians, with
[min, max]. Every variant sees the same data and dropout draws per step index and runs the same
number of steps, so every wrapped variant's parameters and buffers must end bit-equal to ``ddp-25``'s
(``torch.equal``, agreed by all ranks).

The bound: T_forward + max(T_backward, T_communication) + T_optimizer, the step time if backward
and communication overlapped perfectly and nothing else cost anything. T_forward (including the
loss), T_backward and T_optimizer (step and zero_grad) are the ``local`` variant's per-phase medians
(slowest rank per step and phase); T_communication is the link time of one step's gradients,
``ring_allreduce_seconds(gradient bytes, world size, gbps)``. The bound charges the whole optimizer
after communication, so optimizer overlap, which runs early buckets' updates while later buckets are
on the link, can legitimately come in under it (a ratio below 1).

Caveat: on a small CPU machine (2 cores, say) the ranks share the cores, one thread each, with
gloo's and the link's threads; the real all-reduce's CPU work therefore slows the other rank's
compute, which the ``local`` phases do not include. Treat CPU figures as the harness working, not
as the speed-up on a real cluster.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` and ``benchmarks`` importable without installing them;
# spawned ranks re-run this module, so they get the same path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import (  # noqa: E402
    LM_LAYERS,
    RankContext,
    Variant,
    add_run_arguments,
    aligned,
    all_ranks_true,
    build_model,
    check_run_arguments,
    format_duration,
    forward_loss,
    launch,
    link_summary,
    log,
    median_ms,
    mismatched_tensors,
    repeat_ratios,
    run_block,
    slowest_rank,
    step_times,
    train_step,
    wrap_variant,
    write_json,
)
from overlapddp import OverlapDDP  # noqa: E402
from overlapddp.layout.tuner import TUNING_ITERATIONS  # noqa: E402

REFERENCE = "ddp-25"
LOCAL = "local"
TUNED = ("ours-tuned", "ours-tuned+opt")
LM_LAYERS_DEFAULT = 6  # the "6-layer transformer LM"; compare.py keeps its LM_LAYERS
WARMUP_DEFAULT = 2 + TUNING_ITERATIONS  # enough for the tuned plan to settle on any model
CAPS_MB = (25, 1, 5)  # 25: DDP's default arguments (a 1 MiB first bucket, then 25 MiB)


def _caps(cap: int) -> dict[str, object]:
    return {} if cap == 25 else {"bucket_cap_mb": cap}


# label: (wrapper or None for the bare module, its keyword arguments, optimizer overlap)
RECIPES: dict[str, tuple[type[nn.Module] | None, dict[str, object], bool]] = {
    **{f"ddp-{cap}": (DistributedDataParallel, _caps(cap), False) for cap in CAPS_MB},
    **{f"ours-{cap}": (OverlapDDP, _caps(cap), False) for cap in CAPS_MB},
    "ours-tuned": (OverlapDDP, {"bucket_plan": "tuned"}, False),
    **{f"ours-{cap}+opt": (OverlapDDP, _caps(cap), True) for cap in CAPS_MB},
    "ours-tuned+opt": (OverlapDDP, {"bucket_plan": "tuned"}, True),
    LOCAL: (None, {}, False),
}
DDP_LABELS = tuple(label for label, recipe in RECIPES.items() if recipe[0] is DistributedDataParallel)


def fixed_pool(label: str) -> tuple[str, ...]:
    """The fixed layouts ``label`` is compared with: the same optimizer overlap (stock DDP has none)."""
    if RECIPES[label][2]:
        return tuple(f"ours-{cap}+opt" for cap in CAPS_MB)
    return DDP_LABELS + tuple(f"ours-{cap}" for cap in CAPS_MB)


@dataclass
class PhaseTimes:
    """This rank's (forward, backward, optimizer) seconds of every timed step of the bare module."""

    device: torch.device
    steps: list[tuple[float, float, float]] = field(default_factory=list)

    def step(self, variant: Variant, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """``train_step`` with a clock between phases (synchronized first on CUDA)."""
        start = time.perf_counter()
        loss = forward_loss(variant.model, inputs, targets)
        forward_end = self._now()
        loss.backward()
        backward_end = self._now()
        variant.optimizer.step()
        variant.optimizer.zero_grad()
        end = self._now()
        self.steps.append((forward_end - start, backward_end - forward_end, end - backward_end))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def medians_ms(self) -> tuple[float, float, float]:
        """Each phase's median over the timed steps, of the slowest rank per step (all ranks call)."""
        slowest = slowest_rank([seconds for step in self.steps for seconds in step])
        forward, backward, optimizer = (median_ms(slowest[phase::3]) for phase in range(3))
        return forward, backward, optimizer


def make_variant(ctx: RankContext, label: str) -> Variant:
    """A fresh model from the seed, wrapped as ``label``'s recipe says, on its own link."""
    torch.manual_seed(ctx.args.seed)
    module = build_model(ctx.args.model, ctx.args.lm_layers).to(ctx.device)
    wrapper, kwargs, optimizer_overlap = RECIPES[label]
    return wrap_variant(ctx, label, module, wrapper, kwargs, ctx.args.link_gbps, optimizer_overlap)


def bound_summary(ctx: RankContext, phases: PhaseTimes, module: nn.Module) -> dict[str, float]:
    """T_f, T_b, T_c, T_opt and the bound T_f + max(T_b, T_c) + T_opt, in ms (all ranks call)."""
    forward, backward, optimizer = phases.medians_ms()
    link = link_summary(ctx.args, module)
    communication = link["link_ms_per_step"]
    return {
        "forward_ms": forward,
        "backward_ms": backward,
        "communication_ms": communication,
        "optimizer_ms": optimizer,
        "bound_ms": forward + max(backward, communication) + optimizer,
        "gradient_bytes_per_step": link["gradient_bytes_per_step"],
        "gbps": link["gbps"],
    }


def selected_bucket_mib(variant: Variant) -> list[float]:
    """The tuned variant's final buckets, in MiB, in launch order."""
    params = [p for p in variant.model.parameters() if p.requires_grad]
    return [sum(params[i].numel() * params[i].element_size() for i in members) / 2**20
            for members in variant.model.bucket_indices()]


def fixed_ratio(best: Variant | None, variant: Variant) -> dict[str, object]:
    """``variant`` against the fastest fixed layout of its kind (none for the bare module, or when
    no such layout ran)."""
    if best is None:
        return {"best_fixed": None, "vs_best_fixed": None}
    return {"best_fixed": best.label, "vs_best_fixed": repeat_ratios(best, variant)}


def target_verdicts(rows: dict[str, dict[str, object]]) -> dict[str, bool]:
    """The issue's targets on median ratios: no tuned variant slower than the best fixed cap (stock
    DDP's; any of its own kind's). A variant that did not run gives no verdict."""
    verdicts = {}
    for label in TUNED:
        if label in rows and rows[label]["vs_best_fixed"] is not None:
            verdicts[f"{label}_no_slower_than_best_ddp"] = rows[label]["vs_best_ddp"]["median"] <= 1
            verdicts[f"{label}_no_slower_than_best_fixed"] = rows[label]["vs_best_fixed"]["median"] <= 1
    return verdicts


def summarize_model(
    ctx: RankContext, variants: list[Variant], phases: PhaseTimes, first: list[str]
) -> dict[str, object]:
    """Step times, ratios, bound and bit-equality of one model's variants (all ranks call)."""
    by_label = {v.label: v for v in variants}
    reference = by_label[REFERENCE]
    times = {v.label: step_times(v) for v in variants}
    def fastest(labels: tuple[str, ...]) -> Variant | None:
        return min((v for v in variants if v.label in labels), key=lambda v: times[v.label]["median_step_ms"],
                   default=None)

    best = fastest(DDP_LABELS)
    bound = bound_summary(ctx, phases, by_label[LOCAL].module)
    rows: dict[str, dict[str, object]] = {}
    for v in variants:
        # The bare module trains on its own rank's data only, so it has nothing to be equal to.
        mismatches = [] if v.label == LOCAL else mismatched_tensors(reference.module, v.module)
        rows[v.label] = {
            **times[v.label],
            "vs_ddp_default": repeat_ratios(reference, v),
            "vs_best_ddp": repeat_ratios(best, v),
            **fixed_ratio(None if v.label == LOCAL else fastest(fixed_pool(v.label)), v),
            "vs_bound": times[v.label]["median_step_ms"] / bound["bound_ms"],
            "bit_equal": None if v.label == LOCAL else all_ranks_true(not mismatches),
            "rank0_mismatched_tensors": mismatches,
        }
        if v.label in TUNED:  # the selected layout, as bucket sizes in MiB in launch order
            rows[v.label]["selected_bucket_mib"] = selected_bucket_mib(v)
    return {
        "variants": rows,
        "best_ddp": best.label,
        "bound": bound,
        "targets": target_verdicts(rows),
        "first_in_repeat": first,
        "steps_per_variant": reference.next_step,
    }


def benchmark_model(ctx: RankContext, labels: list[str], title: str) -> dict[str, object]:
    """Warm every variant up, run the rotating interleaved repeats and summarize (all ranks call)."""
    args = ctx.args
    variants = [make_variant(ctx, label) for label in labels]
    phases = PhaseTimes(ctx.device)
    if ctx.rank == 0:
        log(f"{title}: {len(variants)} variants, {args.warmup} warm-up steps each")
    for variant in variants:
        run_block(ctx, variant, args.warmup)
        if variant.label in TUNED and variant.model.bucket_state()["tuned_buckets"] is None:
            raise RuntimeError(
                f"{variant.label} has not settled its bucket layout after {args.warmup} warm-up steps, so the timed "
                f"steps would include its tuning; pass --warmup {WARMUP_DEFAULT} or more."
            )
    first = []
    timed_start = time.perf_counter()
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        order = variants[shift:] + variants[:shift]
        for variant in order:
            step = phases.step if variant.label == LOCAL else train_step
            variant.block_times.append(run_block(ctx, variant, args.steps, step=step))
        first.append(order[0].label)
        if ctx.rank == 0:
            elapsed = time.perf_counter() - timed_start
            left = elapsed / (repeat + 1) * (args.repeats - repeat - 1)
            eta = f"about {format_duration(left)} left" if left else f"done in {format_duration(elapsed)}"
            medians = ", ".join(f"{v.label} {median_ms(v.block_times[-1]):.1f}" for v in variants)
            log(f"{title} repeat {repeat + 1}/{args.repeats} ({order[0].label} first), ms: {medians}; {eta}")
    return summarize_model(ctx, variants, phases, first)


def benchmark(ctx: RankContext) -> dict[str, object]:
    """Each model in turn, with fresh variants, in this one process group; results valid on rank 0."""
    args = ctx.args
    labels = args.variants
    models = {}
    for index, name in enumerate(args.models):
        model_args = argparse.Namespace(**{**vars(args), "model": name})
        title = f"{name} ({index + 1}/{len(args.models)})"
        models[name] = benchmark_model(RankContext(model_args, ctx.rank, ctx.device), labels, title)
    return {"variants": labels, "models": models}


def format_ratio(ratio: dict[str, object]) -> str:
    """``median [min, max]``."""
    return f"{ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}]"


def format_model(name: str, result: dict[str, object], args: argparse.Namespace) -> str:
    """One model's fixed-width table, its bound line and its target verdicts."""
    best = result["best_ddp"]
    header = (
        "variant", "median step ms", f"vs {REFERENCE} median [min, max]",
        f"vs best DDP ({best}) median [min, max]", "vs best fixed of its kind", "vs bound", "bit_equal",
    )
    rows = [header]
    for label, row in result["variants"].items():
        bit_equal = "n/a" if row["bit_equal"] is None else str(row["bit_equal"])
        fixed = "n/a" if row["vs_best_fixed"] is None else f"{format_ratio(row['vs_best_fixed'])} ({row['best_fixed']})"
        rows.append((
            label, f"{row['median_step_ms']:.2f}", format_ratio(row["vs_ddp_default"]),
            format_ratio(row["vs_best_ddp"]), fixed, f"{row['vs_bound']:.3f}", bit_equal,
        ))
    b = result["bound"]
    lines = [
        f"{name}: {args.world_size} ranks, {b['gbps']:g} Gbit/s link, {args.repeats} repeats x "
        f"{args.steps} steps per variant after {args.warmup} warm-up steps",
        *aligned(rows),
        f"T_f {b['forward_ms']:.2f} ms, T_b {b['backward_ms']:.2f} ms, T_c {b['communication_ms']:.2f} ms "
        f"({b['gradient_bytes_per_step'] / 2**20:.1f} MiB of gradients), T_opt {b['optimizer_ms']:.2f} ms; "
        f"bound T_f + max(T_b, T_c) + T_opt = {b['bound_ms']:.2f} ms",
    ]
    for label in TUNED:
        if label in result["variants"]:
            sizes = result["variants"][label]["selected_bucket_mib"]
            lines.append(f"{label} selected {len(sizes)} buckets: " + ", ".join(f"{mib:.2f}" for mib in sizes) + " MiB")
    if result["targets"]:
        verdicts = ", ".join(f"{key}: {'yes' if met else 'no'}" for key, met in result["targets"].items())
        lines.append(f"targets (median ratios): {verdicts}")
    return "\n".join(lines)


def report(args: argparse.Namespace, results: dict[str, object]) -> None:
    """Print one table per model and optionally write everything, with the configuration, as JSON."""
    print("\n\n".join(format_model(name, r, args) for name, r in results["models"].items()), flush=True)
    if args.json:
        write_json(args, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults keep one model's run to minutes on a small CPU box."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default="resnet18,mobilenet_v3_small,transformer",
        help="comma-separated: torchvision model names, 'mlp' or 'transformer'",
    )
    parser.add_argument(
        "--variants", default=",".join(RECIPES), help=f"comma-separated subset of {', '.join(RECIPES)}"
    )
    parser.add_argument(
        "--lm-layers", type=int, default=LM_LAYERS_DEFAULT,
        help=f"transformer layers of --models transformer (compare.py uses {LM_LAYERS})",
    )
    parser.add_argument(
        "--link-gbps", type=float, default=1.0, metavar="X", help="emulated link, Gbit/s per rank"
    )
    add_run_arguments(parser, steps=5, warmup=WARMUP_DEFAULT)
    args = parser.parse_args(argv)
    check_run_arguments(parser, args)
    args.models = [name for name in args.models.split(",") if name]
    requested = {name for name in args.variants.split(",") if name}
    unknown = requested - RECIPES.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(RECIPES)}")
    if not {REFERENCE, LOCAL} <= requested:
        parser.error(f"--variants must include {REFERENCE} (the reference) and {LOCAL} (the bound)")
    args.variants = [label for label in RECIPES if label in requested]
    if not args.models:
        parser.error("--models must name at least one model")
    if args.lm_layers < 1:
        parser.error("--lm-layers must be at least 1")
    if not args.link_gbps > 0:
        parser.error("--link-gbps must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parse the options and spawn the ranks."""
    launch(parse_args(argv), benchmark, report)


if __name__ == "__main__":
    main()
