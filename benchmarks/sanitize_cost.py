"""What the race detector costs on a real training step: step time bare, under ``detect()`` and
under ``detect(force=True)``, in one interleaved run, for stock DDP and OverlapDDP.

Launch (spawns its own ranks):

    python benchmarks/sanitize_cost.py --model transformer --world-size 2 --steps 10 --repeats 8

Every repeat runs one block of ``--steps`` steps of each mode (bare, detect, force), in a rotating
order, for each wrapper; the detector is entered around its block only (its patches are process
wide). A step's time is the slowest rank's. Per repeat, each mode's block median over the bare
block's is its ratio; the report gives the median ratio over repeats with [min, max]. All three
modes of a wrapper train identical copies on identical data, so their parameters must end
bit-equal (checked with ``torch.equal``): the detector never changes a clean program's numbers.

What makes it cost: every aten op runs through the detector's dispatch mode (a Python call, and the
overlap test of its tensors against the collectives in flight), so the cost scales with ops per
step; the report counts them (one extra step with a counting mode) and gives the cost per op. It
also times one small op alone, bare and under the detector, with nothing and with a collective in
flight (then each tensor's byte span is computed and looked up), to show the per-op price itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402 - the shared harness, next to this file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlapddp import OverlapDDP  # noqa: E402
from overlapddp.sanitize import detect  # noqa: E402

MODES = ("bare", "detect", "force")
WRAPPERS = {"ddp": DistributedDataParallel, "overlapddp": OverlapDDP}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops a step dispatches (each one the detector's mode sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _block(ctx: compare.RankContext, variant: compare.Variant, mode: str) -> list[float]:
    if mode == "bare":
        return compare.run_block(ctx, variant, ctx.args.steps)
    with detect(force=mode == "force", echo=False) as findings:
        times = compare.run_block(ctx, variant, ctx.args.steps)
    if findings:
        raise RuntimeError(f"rank {ctx.rank}: the detector found races in a clean loop: {findings}")
    return times


def _ops_per_step(ctx: compare.RankContext, wrapper: type) -> int:
    """Aten ops of one training step of a throwaway copy (after one step to settle the buckets)."""
    probe = compare.make_variant(ctx, "probe", wrapper)
    for counted in (False, True):
        inputs, targets = compare.make_batch(ctx.args, ctx.rank, probe.next_step, ctx.device)
        counter = _OpCounter()
        if counted:
            with counter:
                compare.train_step(probe, inputs, targets)
            return counter.ops
        compare.train_step(probe, inputs, targets)
    return 0


OP_MODES = ("bare", "idle", "in flight")
OPS = 2000


def _ops_seconds(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(OPS):
        tensor.add_(1.0)
    return time.perf_counter() - start


def _op_block(mode: str, tensor: torch.Tensor, held: torch.Tensor) -> float:
    """One block of ``OPS`` small in-place adds: bare, under the detector with nothing in flight, or
    with an all-reduce in flight on other memory (every op's tensors are then compared with it)."""
    if mode == "bare":
        return _ops_seconds(tensor)
    with detect(echo=False):
        work = dist.all_reduce(held, async_op=True) if mode == "in flight" else None
        seconds = _ops_seconds(tensor)
        if work is not None:
            work.wait()
    return seconds


def per_op_cost(ctx: compare.RankContext) -> dict[str, object]:
    """Microseconds per op in each of ``OP_MODES``, interleaved, median over repeats [min, max]."""
    tensor, held = torch.zeros(64), torch.zeros(1024)
    times: dict[str, list[float]] = {mode: [] for mode in OP_MODES}
    for repeat in range(ctx.args.repeats + 1):
        for mode in OP_MODES[repeat % 3:] + OP_MODES[:repeat % 3]:
            seconds = _op_block(mode, tensor, held)
            if repeat:  # the first round warms up
                times[mode].append(seconds * 1e6 / OPS)
    extra = {mode: [t - b for t, b in zip(times[mode], times["bare"], strict=True)] for mode in OP_MODES[1:]}
    return {"bare_us": statistics.median(times["bare"]),
            **{f"extra_us_{mode}": [statistics.median(e), min(e), max(e)] for mode, e in extra.items()}}


def benchmark(ctx: compare.RankContext) -> dict[str, object]:
    args = ctx.args
    results: dict[str, object] = {"per_op": per_op_cost(ctx)}
    for name in args.wrappers.split(","):
        variants = {mode: compare.make_variant(ctx, mode, WRAPPERS[name]) for mode in MODES}
        for mode, variant in variants.items():
            _block_warmup(ctx, variant, mode)
        for repeat in range(args.repeats):
            order = MODES[repeat % 3:] + MODES[:repeat % 3]
            for mode in order:
                variants[mode].block_times.append(_block(ctx, variants[mode], mode))
        bare = variants["bare"]
        equal = all(compare.all_ranks_true(not compare.mismatched_tensors(bare.module, variants[m].module))
                    for m in MODES[1:])
        ops = _ops_per_step(ctx, WRAPPERS[name])
        results[name] = {
            "median_step_ms": {m: compare.median_ms([t for b in v.block_times for t in b]) for m, v in variants.items()},
            "ratio": {m: compare.repeat_ratios(bare, variants[m]) for m in MODES[1:]},
            "bit_equal": equal, "ops_per_step": ops,
        }
    return results


def _block_warmup(ctx: compare.RankContext, variant: compare.Variant, mode: str) -> None:
    if ctx.args.warmup:
        saved = ctx.args.steps
        ctx.args.steps = ctx.args.warmup
        try:
            _block(ctx, variant, mode)
        finally:
            ctx.args.steps = saved


def report(args: argparse.Namespace, results: dict[str, object]) -> None:
    per_op = results.pop("per_op")
    rows = [("wrapper", "mode", "median step ms", "ratio to bare [min, max]", "extra us per op")]
    for name, result in results.items():
        medians, ratios, ops = result["median_step_ms"], result["ratio"], result["ops_per_step"]  # type: ignore[index]
        rows.append((name, "bare", f"{medians['bare']:.1f}", "1", ""))
        for mode in MODES[1:]:
            r = ratios[mode]
            extra_us = (medians[mode] - medians["bare"]) * 1e3 / ops
            rows.append((name, mode, f"{medians[mode]:.1f}", f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]",
                         f"{extra_us:.1f}"))
    print("\n".join(compare.aligned(rows)), flush=True)
    for name, result in results.items():
        print(f"{name}: {result['ops_per_step']} aten ops per step; parameters bit-equal in all three modes: "  # type: ignore[index]
              f"{result['bit_equal']}", flush=True)  # type: ignore[index]
    idle, busy = per_op["extra_us_idle"], per_op["extra_us_in flight"]  # type: ignore[index]
    print(f"one in-place add of 64 floats: {per_op['bare_us']:.2f} us bare; the detector adds "  # type: ignore[index]
          f"{idle[0]:.2f} us [{idle[1]:.2f}, {idle[2]:.2f}] with nothing in flight, "
          f"{busy[0]:.2f} us [{busy[1]:.2f}, {busy[2]:.2f}] with a collective in flight", flush=True)
    if args.json:
        compare.write_json(args, {**results, "per_op": per_op})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer", help="compare.py's workloads: transformer, mlp, resnet18...")
    parser.add_argument("--wrappers", default="ddp,overlapddp", help="comma-separated: ddp, overlapddp")
    compare.add_run_arguments(parser, steps=10, warmup=2)
    args = parser.parse_args(argv)
    compare.check_run_arguments(parser, args)
    unknown = set(args.wrappers.split(",")) - set(WRAPPERS)
    if unknown:
        parser.error(f"--wrappers: unknown {sorted(unknown)}; choose from {sorted(WRAPPERS)}")
    # compare.make_variant's options, fixed here: DDP's defaults, no link, no compile.
    args.bucket_cap_mb, args.link_gbps, args.compile, args.optimizer_overlap = None, None, "none", False
    return args


def main(argv: list[str] | None = None) -> None:
    compare.launch(parse_args(argv), benchmark, report)


if __name__ == "__main__":
    main()
