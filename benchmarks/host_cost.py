"""Host cost per parameter tensor of two OverlapDDP builds and stock DDP, in one interleaved run.

Launch (spawns its own ranks):

    git worktree add /tmp/overlapddp-before <commit>      # the build to compare against
    python benchmarks/host_cost.py --before /tmp/overlapddp-before --models mlp,transformer --repeats 12

``--before`` is a checkout of another commit: its ``overlapddp/`` package is copied to a scratch
folder as ``overlapddp_before`` (its imports renamed), so both builds train side by side in one
process. Every repeat runs one block of ``--steps`` steps of each variant (stock DDP, the other
build, this checkout's), in a rotating order; a step's time is the slowest rank's. Per repeat, each
build's cost over DDP divided by the model's parameter tensors is its host cost per tensor (in
microseconds); the report gives the median over repeats with [min, max], the builds' ratio to DDP,
and whether all three variants' parameters and buffers ended bit-equal. ``mlp`` is compare.py's 400-tensor MLP.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402 - the shared harness, next to this file

ALIAS = "overlapddp_before"


def aliased_copy(checkout: Path, scratch: Path) -> Path:
    """``checkout``'s ``overlapddp`` package as ``scratch/overlapddp_before``, its imports renamed."""
    target = scratch / ALIAS
    shutil.copytree(checkout / "overlapddp", target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\boverlapddp(?=[.\s])", ALIAS, text))
    return scratch


def variants(ctx: compare.RankContext) -> list[compare.Variant]:
    sys.path.insert(0, ctx.args.alias_root)
    before = __import__(ALIAS).OverlapDDP
    from overlapddp import OverlapDDP

    return [compare.make_variant(ctx, label, wrapper)
            for label, wrapper in (("ddp", DistributedDataParallel), ("before", before), ("after", OverlapDDP))]


def benchmark(ctx: compare.RankContext) -> dict[str, object]:
    args = ctx.args
    results: dict[str, object] = {}
    for model in args.models.split(","):
        ctx.args.model = model
        trio = variants(ctx)
        for variant in trio:
            compare.run_block(ctx, variant, args.warmup)
        for repeat in range(args.repeats):
            shift = repeat % len(trio)
            for variant in trio[shift:] + trio[:shift]:
                compare.run_timed_block(ctx, variant)
        tensors = sum(1 for p in trio[0].module.parameters() if p.requires_grad)
        ddp_blocks = [statistics.median(b) for b in trio[0].block_times]
        summary: dict[str, object] = {"tensors": tensors}
        for variant in trio[1:]:
            blocks = [statistics.median(b) for b in variant.block_times]
            per_tensor = [(ours - ddp) / tensors * 1e6 for ours, ddp in zip(blocks, ddp_blocks, strict=True)]
            ratio = [ours / ddp for ours, ddp in zip(blocks, ddp_blocks, strict=True)]
            summary[variant.label] = {
                "us_per_tensor": (statistics.median(per_tensor), min(per_tensor), max(per_tensor)),
                "ratio_to_ddp": (statistics.median(ratio), min(ratio), max(ratio)),
                "median_step_ms": statistics.median(blocks) * 1e3,
            }
        summary["ddp_median_step_ms"] = statistics.median(ddp_blocks) * 1e3
        summary["bit_equal"] = compare.all_ranks_true(
            not compare.mismatched_tensors(trio[0].module, trio[1].module)
            and not compare.mismatched_tensors(trio[0].module, trio[2].module)
        )
        results[model] = summary
        dist.barrier()
    return results


def report(args: argparse.Namespace, results: dict[str, object]) -> None:
    for model, summary in results.items():
        assert isinstance(summary, dict)
        print(f"{model}: {summary['tensors']} parameter tensors, DDP {summary['ddp_median_step_ms']:.2f} ms/step, "
              f"bit_equal={summary['bit_equal']}")
        for label in ("before", "after"):
            row = summary[label]
            us, ratio = row["us_per_tensor"], row["ratio_to_ddp"]
            print(f"  {label:6s} {row['median_step_ms']:.2f} ms/step; host cost over DDP per tensor "
                  f"{us[0]:+.2f} us [{us[1]:+.2f}, {us[2]:+.2f}]; ratio to DDP {ratio[0]:.3f} "
                  f"[{ratio[1]:.3f}, {ratio[2]:.3f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="a checkout of the build to compare against")
    parser.add_argument("--models", default="mlp,transformer")
    compare.add_run_arguments(parser, steps=10, warmup=3)
    args = parser.parse_args()
    compare.check_run_arguments(parser, args)
    # What compare.make_variant reads, fixed here: DDP's caps, no link, no compile, no optimizer overlap.
    args.model, args.bucket_cap_mb, args.link_gbps, args.compile, args.optimizer_overlap = "", None, None, "none", False
    with tempfile.TemporaryDirectory(prefix="overlapddp-host-cost-") as scratch:
        args.alias_root = str(aliased_copy(args.before, Path(scratch)))
        compare.launch(args, benchmark, report)


if __name__ == "__main__":
    main()
