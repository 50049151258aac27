"""Sharded optimizer state side by side: stock DDP + the plain optimizers, DDP + torch's
``ZeroRedundancyOptimizer`` and ``OverlapDDP`` with the same optimizers attached with ``shard=True``,
from one interleaved run.

Launch (the script spawns its own gloo ranks on CPU; no torchrun needed):

    python benchmarks/sharded_optimizer.py --models muon_lm,transformer,resnet18 --repeats 11 --steps 5 \\
        --json results/sharded_optimizer.json

Workloads (``--models``):

- ``muon_lm``: a transformer LM of ``MUON_LM_LAYERS`` layers, width ``MUON_LM_WIDTH``, batches of
  ``--batch-size`` sequences of ``MUON_LM_SEQ`` tokens per rank; ``torch.optim.Muon(lr=0.02)`` for
  the 2-D weights of the hidden layers and ``AdamW`` for the embedding, the head, biases and norms
  (Muon's documented split);
- any other name (``transformer``, a torchvision model, ``mlp``: compare.py's builders):
  ``AdamW(lr=1e-3, weight_decay=0.01, foreach=False)`` for every parameter.

Variants, in one process group, each with its own model built from ``--seed`` and its own optimizers:

- ``ddp``: ``DistributedDataParallel`` + the plain optimizers (the reference);
- ``zero``: ``DistributedDataParallel`` + one ``ZeroRedundancyOptimizer(params, optimizer_class=...)``
  per optimizer: parameters assigned to ranks by size, each rank's step after backward, then one
  broadcast per parameter;
- ``ours``: ``OverlapDDP`` + ``attach_optimizer(optimizer, shard=True)`` per optimizer: DDP's
  backward, then each rank updates the parameters it owns (balanced by Newton-Schulz FLOPs for
  Muon, by elements for AdamW), each broadcast launched as soon as its update is done.

ZeRO's ``overlap_with_ddp=True`` form (``hook_with_zero_step`` with a functional AdamW) is tried once
per run; on gloo torch refuses it, and the exact error is reported instead of a timing.

Method: every variant runs ``--warmup`` steps, then each of ``--repeats`` repeats runs ``--steps``
steps of every variant, starting one variant later each repeat. A step is forward, cross-entropy,
backward, ``step()`` of each optimizer, ``zero_grad()``; every variant's parameters are final when
its step ends (ours' ``step()`` returns once every broadcast has arrived). Every step starts after a
barrier; its time is the slowest rank's. Ratios against ``ddp`` are medians over repeats of
per-repeat ratios of block medians, with [min, max]. The optimizer's share of DDP's step is the
median of DDP's ``step()`` calls (the slowest rank's) over DDP's median step. All variants see the
same data and dropout draws per step index, and after every step (warm-up included, outside the
timed span) each variant's parameters and buffers are compared with ``torch.equal`` to DDP's after
the same step, agreed by all ranks.

Optimizer state per rank is counted from the state tensors: DDP's ``optimizer.state``, ZeRO's local
``optimizer.optim.state``, ours ``sharded.local_state_bytes()``; for ``muon_lm`` also Muon's alone
(its momentum). The target for ours with AdamW: at most ``(1/N) * 1.01`` of DDP's on every rank.

Peak memory per rank, on CPU (Linux): after the timed run, each variant in turn is built in fresh
ranks of its own (a process that freed other variants' tensors reuses their pages without growing,
which understated by tens of MiB) and trains ``MEMORY_STEPS`` steps. Reported: the rise of the process's
resident-set high-water mark (``VmHWM``, restarted through ``/proc/self/clear_refs``) over the
resident set just before the variant was built, once ``malloc_trim`` has handed free heap pages
back; first over building it and its first steps (DDP's bucket rebuild after the first step
included), then, restarted, over one later step. That counts everything the variant holds or
briefly allocates, on any thread: model, gradients, buckets, optimizer state, activations, gloo's
buffers and copies. It is page-granular and includes allocator slack, so differences under a MiB
or so are noise. (The allocator events of ``torch.profiler.profile(profile_memory=True)`` miss
frees made on gloo's threads, such as the temporaries of gloo's collectives, so their running total
overstates; they are not used.)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` and ``benchmarks`` importable without installing them;
# spawned ranks re-run this module, so they get the same path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import (  # noqa: E402
    LM_LAYERS,
    LM_VOCAB,
    RankContext,
    TinyLM,
    Variant,
    add_run_arguments,
    aligned,
    all_ranks_true,
    build_model,
    check_run_arguments,
    format_duration,
    launch,
    log,
    median_ms,
    repeat_ratios,
    run_block,
    slowest_rank,
    step_seed,
    step_times,
    train_step,
    write_json,
)
from overlapddp import OverlapDDP  # noqa: E402
from overlapddp.shard.optimizer import ShardedOptimizer  # noqa: E402

REFERENCE = "ddp"
LABELS = ("ddp", "zero", "ours")
ADAMW: dict[str, object] = {"lr": 1e-3, "weight_decay": 0.01, "foreach": False}
MUON: dict[str, object] = {"lr": 0.02, "weight_decay": 0.01}
STATE_SLACK = 1.01  # ours may hold 1% more than DDP's state / N
MEMORY_STEPS = 3  # the first two rebuild the buckets and create the optimizer state
MUON_WORKLOAD = "muon_lm"
MUON_LM_LAYERS, MUON_LM_WIDTH, MUON_LM_HEADS, MUON_LM_SEQ = 4, 256, 4, 64
MUON_STEP_TARGET = 0.90  # ours' step at most this fraction of DDP's with Muon


class MuonLM(TinyLM):
    """compare.py's causal LM at the Muon workload's size (its hidden layers' 2-D weights Muon steps)."""

    def __init__(self) -> None:
        super().__init__(MUON_LM_LAYERS, MUON_LM_WIDTH, MUON_LM_HEADS)


def split_for_muon(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's parameters (the hidden layers' 2-D weights) and AdamW's (everything else)."""
    hidden = [p for name, p in module.named_parameters() if p.ndim == 2 and name.startswith("layers.")]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in module.parameters() if id(p) not in ids]


class Optimizers:
    """The workload's optimizers stepped as one (compare.py's step calls ``step`` and ``zero_grad``);
    ``step_seconds`` collects this rank's time in ``step()``."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        self.step_seconds: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        for optimizer in self.optimizers:
            optimizer.step()
        self.step_seconds.append(time.perf_counter() - start)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


@dataclass
class Arm(Variant):
    """A variant; ``sharded`` are ours' sharded optimizers (empty for DDP and ZeRO)."""

    sharded: list[ShardedOptimizer] = field(default_factory=list)
    batch_seed: tuple[int, int, int] = (0, 0, 0)  # (--seed, rank, --batch-size): muon_lm's own batches


def _optimizers(label: str, model: nn.Module, module: nn.Module, workload: str) -> list[Any]:
    """The workload's optimizers for ``label``: plain, ZeRO-wrapped, or plain to be sharded by ours."""
    if workload == MUON_WORKLOAD:
        hidden, rest = split_for_muon(module)
        parts = [(hidden, torch.optim.Muon, MUON), (rest, torch.optim.AdamW, ADAMW)]
    else:
        parts = [(list(model.parameters()), torch.optim.AdamW, ADAMW)]
    if label == "zero":
        return [ZeroRedundancyOptimizer(params, optimizer_class=kind, **options) for params, kind, options in parts]
    return [kind(params, **options) for params, kind, options in parts]


def build_module(ctx: RankContext) -> nn.Module:
    """The workload's model (call under a fixed seed for identical copies)."""
    return MuonLM() if ctx.args.model == MUON_WORKLOAD else build_model(ctx.args.model, ctx.args.lm_layers)


def build_arm(ctx: RankContext, label: str) -> Arm:
    """A fresh model from the seed, wrapped and given its own optimizers as ``label`` says."""
    torch.manual_seed(ctx.args.seed)
    workload = ctx.args.model
    module = build_module(ctx)
    model: nn.Module = OverlapDDP(module) if label == "ours" else DistributedDataParallel(module)
    optimizers = _optimizers(label, model, module, workload)
    sharded = [model.attach_optimizer(o, shard=True) for o in optimizers] if label == "ours" else []
    return Arm(label, module, model, Optimizers(optimizers), sharded=sharded,  # type: ignore[arg-type]
               batch_seed=(ctx.args.seed, ctx.rank, ctx.args.batch_size))


def arm_step(arm: Arm, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """compare.py's step; for ``muon_lm`` on its own sequences of ``MUON_LM_SEQ`` tokens."""
    if isinstance(arm.module, MuonLM):
        inputs, targets = muon_batch(arm)
    train_step(arm, inputs, targets)


def muon_batch(arm: Arm) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens for ``muon_lm``, drawn from the same seed for every variant."""
    seed, rank, size = arm.batch_seed
    gen = torch.Generator().manual_seed(step_seed(seed, rank, arm.next_step))
    tokens = torch.randint(LM_VOCAB, (size, MUON_LM_SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def zero_overlap_error(ctx: RankContext) -> str | None:
    """Try ZeRO's ``overlap_with_ddp=True`` form on this process group; the error it raises, if any."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import _FunctionalAdamW

    torch.manual_seed(ctx.args.seed)
    model = DistributedDataParallel(build_module(ctx))
    try:
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=_FunctionalAdamW, overlap_with_ddp=True, lr=1e-3, weight_decay=0.01
        )
        model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
    except Exception as error:  # noqa: BLE001 - the probe reports whatever torch raises
        return f"{type(error).__name__}: {error}"
    return None


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer, by name."""
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


class StepCheck:
    """Compares every variant's parameters and buffers with DDP's after the same step index.

    The first variants to reach a step leave their copies; once all have, they are compared and freed.
    """

    def __init__(self, labels: list[str]) -> None:
        self._labels = labels
        self._pending: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        # Per variant: (step index, mismatched tensor names) on this rank.
        self.mismatches: dict[str, list[tuple[int, list[str]]]] = {label: [] for label in labels}
        self.steps_compared = 0

    def after_step(self, arm: Arm, step: int) -> None:
        copies = self._pending.setdefault(step, {})
        copies[arm.label] = snapshot(arm.module)
        if len(copies) < len(self._labels):
            return
        reference = self._pending.pop(step)[REFERENCE]
        for label, tensors in copies.items():
            names = [n for n, t in tensors.items() if not torch.equal(t, reference[n])]
            if names:
                self.mismatches[label].append((step, names))
        self.steps_compared += 1

    def verdicts(self) -> dict[str, dict[str, object]]:
        """Per variant, agreed by all ranks: bit-equal after every compared step; rank 0's first misses."""
        return {
            label: {"bit_equal_every_step": all_ranks_true(not misses), "rank0_first_mismatches": misses[:3]}
            for label, misses in self.mismatches.items()
        }


def run_steps(ctx: RankContext, arm: Arm, steps: int, check: StepCheck) -> list[float]:
    """``steps`` steps of ``arm``, each after a barrier and checked after it; slowest-rank seconds each."""
    times = []
    for _ in range(steps):
        step = arm.next_step
        times += run_block(ctx, arm, 1, step=arm_step)
        check.after_step(arm, step)
    return times


def state_bytes(arm: Arm, first_only: bool = False) -> int:
    """Bytes of this rank's optimizer state tensors (``first_only``: of the first optimizer, Muon's)."""
    optimizers = arm.optimizer.optimizers[:1] if first_only else arm.optimizer.optimizers  # type: ignore[attr-defined]
    total = 0
    for optimizer in optimizers:
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        total += sum(value.numel() * value.element_size() for entry in local.state.values()
                     for value in entry.values() if isinstance(value, torch.Tensor))
    return total


def per_rank(ctx: RankContext, value: int) -> list[int]:
    """``value`` of every rank, in rank order (all ranks call)."""
    values = torch.zeros(ctx.args.world_size, dtype=torch.int64)
    values[ctx.rank] = value
    dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


def rss_kib(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def trim_and_restart_peak() -> None:
    """Free heap pages back to the kernel (so new tensors fault pages in) and restart ``VmHWM``."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS


def measure_memory(ctx: RankContext) -> dict[str, list[int]]:
    """Resident bytes a fresh variant (``--model``, ``memory_variant``) adds to this rank, above the
    resident set just before it was built: the peak over building it and its first ``MEMORY_STEPS - 1`` steps (DDP's bucket rebuild
    and the state's creation included), then the peak of one later step (all ranks call)."""
    trim_and_restart_peak()
    dist.barrier()
    baseline = rss_kib("VmRSS")
    arm = build_arm(ctx, ctx.args.memory_variant)
    run_block(ctx, arm, MEMORY_STEPS - 1, step=arm_step)
    first = rss_kib("VmHWM")
    trim_and_restart_peak()
    run_block(ctx, arm, 1, step=arm_step)
    later = rss_kib("VmHWM")
    del arm
    return {"first_steps_peak_bytes": per_rank(ctx, (first - baseline) * 1024),
            "later_step_peak_bytes": per_rank(ctx, (later - baseline) * 1024)}


def summarize_model(ctx: RankContext, arms: list[Arm], check: StepCheck, first: list[str]) -> dict[str, object]:
    """Step times, ratios, state bytes and bit-equality of one model's variants (all ranks call)."""
    world = ctx.args.world_size
    reference = arms[0]
    muon = ctx.args.model == MUON_WORKLOAD
    state = {arm.label: per_rank(ctx, state_bytes(arm)) for arm in arms}
    momentum = {arm.label: per_rank(ctx, state_bytes(arm, first_only=True)) for arm in arms} if muon else {}
    verdicts = check.verdicts()
    rows: dict[str, dict[str, object]] = {}
    for arm in arms:
        rows[arm.label] = {
            **step_times(arm),
            "vs_ddp": repeat_ratios(reference, arm),
            "state_bytes_per_rank": state[arm.label],
            # Over DDP's state divided by the world size, on the rank where it is largest.
            "state_vs_ddp_over_n": max(mine / (ddp / world) for mine, ddp in zip(state[arm.label], state[REFERENCE],
                                                                                  strict=True)),
            **verdicts[arm.label],
        }
        if muon:
            rows[arm.label]["muon_state_bytes_per_rank"] = momentum[arm.label]
            rows[arm.label]["muon_state_vs_ddp_over_n"] = max(
                mine / (ddp / world) for mine, ddp in zip(momentum[arm.label], momentum[REFERENCE], strict=True))
    # DDP's optimizer share: the slowest rank's step() calls over DDP's steps, medians over the timed blocks.
    calls = reference.optimizer.step_seconds[-ctx.args.repeats * ctx.args.steps:]  # type: ignore[attr-defined]
    share = statistics.median(slowest_rank(calls)) / statistics.median([t for b in reference.block_times for t in b])
    return {"variants": rows, "first_in_repeat": first, "steps_compared": check.steps_compared,
            "steps_per_variant": reference.next_step, "ddp_optimizer_share_of_step": share}


def targets(workload: str, result: dict[str, Any]) -> dict[str, bool]:
    """The verdicts the run is held to: bit-equal, the state's share, and the step time against DDP
    (with Muon: at most MUON_STEP_TARGET of DDP's, and below ZeRO's)."""
    rows = result["variants"]
    ours = rows["ours"]
    met = {"ours_bit_equal_every_step": ours["bit_equal_every_step"]}
    if workload == MUON_WORKLOAD:
        met["ours_step_at_most_0.90_of_ddp"] = ours["vs_ddp"]["median"] <= MUON_STEP_TARGET
        met["ours_faster_than_zero"] = ours["median_step_ms"] < rows["zero"]["median_step_ms"]
    else:
        met["ours_state_at_most_ddp_over_n_plus_1pct"] = ours["state_vs_ddp_over_n"] <= STATE_SLACK
        met["ours_no_slower_than_ddp"] = ours["vs_ddp"]["median"] <= 1.0
    return met


def benchmark_model(ctx: RankContext, title: str) -> dict[str, object]:
    """Warm up, run the rotating interleaved repeats, count the state, then measure memory (all ranks call)."""
    args = ctx.args
    arms = [build_arm(ctx, label) for label in LABELS]
    check = StepCheck(list(LABELS))
    if ctx.rank == 0:
        log(f"{title}: {len(arms)} variants, {args.warmup} warm-up steps each")
    for arm in arms:
        run_steps(ctx, arm, args.warmup, check)
    first = []
    timed_start = time.perf_counter()
    for repeat in range(args.repeats):
        shift = repeat % len(arms)
        order = arms[shift:] + arms[:shift]
        for arm in order:
            arm.block_times.append(run_steps(ctx, arm, args.steps, check))
        first.append(order[0].label)
        if ctx.rank == 0:
            elapsed = time.perf_counter() - timed_start
            left = elapsed / (repeat + 1) * (args.repeats - repeat - 1)
            eta = f"about {format_duration(left)} left" if left else f"done in {format_duration(elapsed)}"
            medians = ", ".join(f"{arm.label} {median_ms(arm.block_times[-1]):.1f}" for arm in arms)
            log(f"{title} repeat {repeat + 1}/{args.repeats} ({order[0].label} first), ms: {medians}; {eta}")
    result = summarize_model(ctx, arms, check, first)
    result["targets"] = targets(args.model, result)
    return result


def benchmark(ctx: RankContext) -> dict[str, object]:
    """The ZeRO overlap probe, then each model in turn with fresh variants; results valid on rank 0."""
    args = ctx.args
    first = RankContext(argparse.Namespace(**{**vars(args), "model": args.models[0]}), ctx.rank, ctx.device)
    results: dict[str, object] = {"zero_overlap_with_ddp_error": zero_overlap_error(first), "models": {}}
    for index, name in enumerate(args.models):
        model_args = argparse.Namespace(**{**vars(args), "model": name})
        title = f"{name} ({index + 1}/{len(args.models)})"
        results["models"][name] = benchmark_model(RankContext(model_args, ctx.rank, ctx.device), title)
    return results


def mib(values: list[int]) -> str:
    """Bytes per rank as ``a / b`` MiB."""
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def format_model(name: str, result: dict[str, Any], args: argparse.Namespace) -> str:
    """One model's fixed-width table and its target verdicts."""
    muon = name == MUON_WORKLOAD
    rows = [(
        "variant", "median step ms", "vs ddp median [min, max]", "opt state MiB per rank", "state / (ddp/N)",
        *(("Muon state MiB per rank", "Muon state / (ddp/N)") if muon else ()),
        "peak RSS MiB: first steps", "a later step", "bit-equal to ddp every step",
    )]
    for label, row in result["variants"].items():
        ratio = row["vs_ddp"]
        rows.append((
            label, f"{row['median_step_ms']:.2f}",
            f"{ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}]",
            mib(row["state_bytes_per_rank"]), f"{row['state_vs_ddp_over_n']:.4f}",
            *((mib(row["muon_state_bytes_per_rank"]), f"{row['muon_state_vs_ddp_over_n']:.4f}") if muon else ()),
            mib(row["memory"]["first_steps_peak_bytes"]), mib(row["memory"]["later_step_peak_bytes"]),
            str(row["bit_equal_every_step"]),
        ))
    verdicts = ", ".join(f"{key}: {'yes' if met else 'no'}" for key, met in result["targets"].items())
    return "\n".join([
        f"{name}: {args.world_size} ranks, {args.repeats} repeats x {args.steps} steps per variant after "
        f"{args.warmup} warm-up steps; {result['steps_compared']} steps compared; DDP's optimizer.step() is "
        f"{result['ddp_optimizer_share_of_step']:.2f} of its step",
        *aligned(rows),
        f"targets: {verdicts}",
    ])


def git_commit() -> dict[str, object]:
    """The checkout's commit, and whether tracked files differ from it."""
    repo = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def hand_off(args: argparse.Namespace, results: dict[str, object]) -> None:
    """Rank 0's results, written where the launching process reads them."""
    Path(args.handoff).write_text(json.dumps(results))


def launched(args: argparse.Namespace, run: Callable[[RankContext], dict[str, object]], **options: object) -> Any:
    """Spawn ranks that run ``run`` with ``options`` added to ``args``; rank 0's results."""
    with tempfile.TemporaryDirectory() as folder:
        handoff = Path(folder) / "results.json"
        launch(argparse.Namespace(**{**vars(args), **options, "handoff": str(handoff)}), run, hand_off)
        return json.loads(handoff.read_text())


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Print one table per model and the ZeRO overlap verdict; write everything, with the commit, as JSON."""
    error = results["zero_overlap_with_ddp_error"]
    zero_line = f"zero overlap_with_ddp=True: {'did not run: ' + error if error else 'constructed; not timed here'}"
    tables = [format_model(name, r, args) for name, r in results["models"].items()]
    print("\n\n".join([*tables, zero_line, f"commit {results['commit']}{' (dirty)' if results['dirty'] else ''}"]),
          flush=True)
    if args.json:
        write_json(args, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults keep both models to a few minutes on a small CPU box."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="muon_lm,transformer,resnet18",
                        help="comma-separated: 'muon_lm' (Muon + AdamW), or with AdamW torchvision model names, "
                        "'mlp' or 'transformer'")
    parser.add_argument("--lm-layers", type=int, default=LM_LAYERS, help="transformer layers of --models transformer")
    add_run_arguments(parser, steps=5, warmup=3)
    args = parser.parse_args(argv)
    check_run_arguments(parser, args)
    args.models = [name for name in args.models.split(",") if name]
    if not args.models:
        parser.error("--models must name at least one model")
    if args.lm_layers < 1:
        parser.error("--lm-layers must be at least 1")
    if args.device != "cpu":
        parser.error("--device cpu only: peak memory is the process's resident set")
    return args


def main(argv: list[str] | None = None) -> None:
    """The interleaved run in one process group, then each variant's memory in fresh ranks of its own
    (a process that freed other variants' tensors reuses their pages and would understate)."""
    args = parse_args(argv)
    results = {**git_commit(), **launched(args, benchmark)}
    for name in args.models:
        for label in LABELS:
            log(f"{name}: memory of {label}, in fresh ranks")
            memory = launched(args, measure_memory, model=name, memory_variant=label)
            results["models"][name]["variants"][label]["memory"] = memory
    report(args, results)


if __name__ == "__main__":
    main()
