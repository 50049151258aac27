"""Step-time and bit-equality comparison of OverlapDDP against stock DDP.

Launch (the script spawns its own ranks; no torchrun needed):

    python benchmarks/compare.py --model resnet18 --world-size 2 --steps 20 --repeats 5

Other workloads: ``--model mlp`` (200 Linear layers of width 64, i.e. 400
parameter tensors, which stresses per-tensor hook and bucketing overhead),
``--model transformer`` (small causal LM), or any torchvision classification
model name. ``--candidate ddp`` puts stock DDP on both sides: an A/A run that
shows the harness's own noise and works before ``overlapddp`` is importable.

Method: every rank builds two identical models from ``--seed``, one wrapped in
DDP and one in the candidate, each with its own SGD optimizer. After
``--warmup`` untimed steps for both, each repeat times ``--steps`` steps of one
variant and then of the other, alternating which goes first so that slow
drift (thermal, page cache, allocator growth) does not favour either side.
A step's time is the slowest rank's time for it. Both variants see exactly the
same data and dropout draws, so their parameters and buffers must end up
bit-identical; that is checked with ``torch.equal`` and agreed on by all ranks.

During the timed steps OverlapDDP records its fence log; ``overlapddp.timeline``
turns it into the exposed communication per step (last bucket completion minus
end of backward) and the last bucket to become ready, reported for rank 0.

``--find-unused-parameters both`` passes ``find_unused_parameters=True`` to both variants;
``--find-unused-parameters candidate --reference overlapddp`` times OverlapDDP with the flag
against OverlapDDP without it (the flag's own cost).

``--compile inner`` times ``Wrapper(torch.compile(model))`` and ``--compile outer``
``torch.compile(Wrapper(model))``, both wrappers in the same form, with ``--backend``
(each variant compiles with its own backend object, so they never share compiled frames).

``--link-gbps X`` registers ``benchmarks/link.py``'s hook on both variants (each
with its own emulated link of X Gbit/s per rank); without it no hook is
registered. ``--plot DIR`` (needs matplotlib) writes a step-time chart and one
representative OverlapDDP step's bucket timeline as PNGs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` and ``benchmarks`` importable without
# installing them; spawned ranks re-run this module, so they get the same path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import plots  # noqa: E402
from benchmarks.link import LinkState, link_allreduce_hook, ring_allreduce_seconds  # noqa: E402

if TYPE_CHECKING:
    from overlapddp.fence import FenceLog

NUM_CLASSES = 10
MLP_DEPTH = 200
MLP_WIDTH = 64
LM_VOCAB = 1000
LM_SEQ = 32
LM_D_MODEL = 128
LM_HEADS = 4
LM_LAYERS = 2
STORE_TIMEOUT = datetime.timedelta(minutes=5)
# Auxiliary heads are not used by the loss; DDP rejects unused parameters
# unless find_unused_parameters=True, which would change what is measured.
TORCHVISION_KWARGS: dict[str, dict[str, bool]] = {
    "googlenet": {"aux_logits": False},
    "inception_v3": {"aux_logits": False},
}


class TinyLM(nn.Module):
    """Causal transformer LM: one large embedding and head around many mid-sized tensors."""

    def __init__(self, layers: int = LM_LAYERS, d_model: int = LM_D_MODEL, heads: int = LM_HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, d_model)
        # Separate layer instances (not TransformerEncoder's deep copies) so
        # that the layers start from different weights, as in a real model.
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, LM_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Built per call rather than registered as a buffer, because DDP would
        # otherwise broadcast it every step.
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden, src_mask=mask, is_causal=True)
        return self.head(hidden)


def build_model(name: str, lm_layers: int = LM_LAYERS) -> nn.Module:
    """Build the named workload's model (call under a fixed seed for identical copies)."""
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(MLP_DEPTH - 1):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        layers.append(nn.Linear(MLP_WIDTH, NUM_CLASSES))
        return nn.Sequential(*layers)
    if name == "transformer":
        return TinyLM(lm_layers)
    return torchvision.models.get_model(
        name, weights=None, num_classes=NUM_CLASSES, **TORCHVISION_KWARGS.get(name, {})
    )


def step_seed(seed: int, rank: int, step: int) -> int:
    """One seed per (seed, rank, step), so both variants see the same data on a rank."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % 2**63


def make_batch(
    args: argparse.Namespace, rank: int, step: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets for one step, independent of which variant asks."""
    gen = torch.Generator().manual_seed(step_seed(args.seed, rank, step))
    size = args.batch_size
    if args.model == "mlp":
        inputs = torch.randn(size, MLP_WIDTH, generator=gen)
        targets = torch.randint(NUM_CLASSES, (size,), generator=gen)
    elif args.model == "transformer":
        tokens = torch.randint(LM_VOCAB, (size, LM_SEQ + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs = torch.randn(size, 3, args.image_size, args.image_size, generator=gen)
        targets = torch.randint(NUM_CLASSES, (size,), generator=gen)
    return inputs.to(device), targets.to(device)


def candidate_class(name: str) -> type[nn.Module]:
    """The wrapper under test; ``ddp`` gives an A/A run of the harness."""
    if name == "ddp":
        return DistributedDataParallel
    from overlapddp import OverlapDDP

    return OverlapDDP


@dataclass
class Variant:
    """One wrapped model with its optimizer, its own step counter and its timings."""

    label: str
    module: nn.Module  # the unwrapped model, compared for bit-equality
    model: nn.Module  # the wrapped model that is trained
    optimizer: torch.optim.Optimizer
    next_step: int = 0
    block_times: list[list[float]] = field(default_factory=list)  # seconds, per repeat
    peak_cuda_bytes: int = 0
    # This rank's perf_counter (start, end) of every timed step, to place fence-log times in a step.
    step_spans: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class RankContext:
    """What every block needs to know about where it runs."""

    args: argparse.Namespace
    rank: int
    device: torch.device


def make_variant(ctx: RankContext, label: str, wrapper: type[nn.Module], find_unused: bool = False) -> Variant:
    """Build a fresh seeded model, wrap it as the command line says and give it its own optimizer."""
    args = ctx.args
    torch.manual_seed(args.seed)
    module = build_model(args.model).to(ctx.device)
    kwargs: dict[str, object] = {"find_unused_parameters": True} if find_unused else {}
    if args.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.bucket_cap_mb
    variant = wrap_variant(
        ctx, label, compiled(module, args) if args.compile == "inner" else module, wrapper, kwargs, args.link_gbps,
        args.optimizer_overlap,
    )
    if args.compile == "outer":
        variant.model = compiled(variant.model, args)
    return variant


def compiled(module: nn.Module, args: argparse.Namespace) -> nn.Module:
    """``torch.compile(module)`` with a backend object of its own: Dynamo keys compiled frames by the
    backend, and two copies of one model class must not run each other's compiled (and cut) graphs."""
    backend = torch._dynamo.lookup_backend(args.backend)
    return torch.compile(module, backend=functools.partial(backend))


def wrap_variant(
    ctx: RankContext,
    label: str,
    module: nn.Module,
    wrapper: type[nn.Module] | None,
    kwargs: dict[str, object],
    link_gbps: float | None,
    optimizer_overlap: bool,
) -> Variant:
    """Wrap ``module`` with ``kwargs`` and give it its own optimizer, so variants share one recipe.

    ``wrapper=None`` trains the bare module, without communication (then neither a link nor kwargs apply).
    """
    model = module
    if wrapper is not None:
        if ctx.device.type == "cuda":
            kwargs = {**kwargs, "device_ids": [ctx.device.index]}
        model = wrapper(module, **kwargs)
        if link_gbps is not None:
            # Same hook, separate state: each variant has its own link, and they never run at once.
            model.register_comm_hook(LinkState(link_gbps), link_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if optimizer_overlap and hasattr(model, "attach_optimizer"):
        model.attach_optimizer(optimizer, overlap=True)  # updates run per bucket at backward's end
    return Variant(label, module, model, optimizer)


def forward_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and cross-entropy over every position (one per image, one per token)."""
    return F.cross_entropy(model(inputs).flatten(0, -2), targets.flatten())


def train_step(variant: Variant, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward, cross-entropy, backward, optimizer step, zero_grad."""
    forward_loss(variant.model, inputs, targets).backward()
    variant.optimizer.step()
    variant.optimizer.zero_grad()


def slowest_rank(durations: list[float]) -> list[float]:
    """Per-step maximum over ranks: a synchronous step is as slow as its slowest rank."""
    times = torch.tensor(durations, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def run_block(
    ctx: RankContext,
    variant: Variant,
    steps: int,
    spans: list[tuple[float, float]] | None = None,
    step: Callable[[Variant, torch.Tensor, torch.Tensor], None] = train_step,
) -> list[float]:
    """Run ``steps`` steps after a barrier; return each step's slowest-rank seconds.

    ``spans``, if given, gets this rank's (start, end) perf_counter times of each step; ``step``
    trains one step (a phase-timing step can stand in for ``train_step``).
    """
    dist.barrier()
    durations = []
    for _ in range(steps):
        inputs, targets = make_batch(ctx.args, ctx.rank, variant.next_step, ctx.device)
        # Reseed the global RNG so dropout-like layers draw the same for both variants.
        torch.manual_seed(step_seed(ctx.args.seed, ctx.rank, variant.next_step))
        start = time.perf_counter()
        step(variant, inputs, targets)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        end = time.perf_counter()
        durations.append(end - start)
        if spans is not None:
            spans.append((start, end))
        variant.next_step += 1
    return slowest_rank(durations)


def run_timed_block(ctx: RankContext, variant: Variant) -> None:
    """Time one repeat's block for a variant and track its CUDA peak memory."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    variant.block_times.append(run_block(ctx, variant, ctx.args.steps, variant.step_spans))
    if ctx.device.type == "cuda":
        variant.peak_cuda_bytes = max(
            variant.peak_cuda_bytes, torch.cuda.max_memory_allocated(ctx.device)
        )


def mismatched_tensors(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of parameters and buffers that are not bit-identical (or not shared)."""
    tensors_a = dict(a.named_parameters()) | dict(a.named_buffers())
    tensors_b = dict(b.named_parameters()) | dict(b.named_buffers())
    if tensors_a.keys() != tensors_b.keys():
        return sorted(tensors_a.keys() ^ tensors_b.keys())
    return [name for name, tensor in tensors_a.items() if not torch.equal(tensor, tensors_b[name])]


def all_ranks_true(flag: bool) -> bool:
    """MIN-reduce a flag so that every rank reports the same verdict."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def per_rank_max_rss_mib(world_size: int, rank: int) -> list[float]:
    """Each rank's process peak RSS (covers both variants; not attributable to one)."""
    rss = torch.zeros(world_size, dtype=torch.float64)
    rss[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    dist.all_reduce(rss)
    return rss.tolist()


def max_over_ranks(value: int) -> int:
    """Largest value of an integer across ranks."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def median_ms(times: list[float]) -> float:
    """Median of step times in seconds, as milliseconds."""
    return statistics.median(times) * 1e3


def log(message: str) -> None:
    """Progress line on stderr, flushed so it interleaves sensibly with the ranks."""
    print(message, file=sys.stderr, flush=True)


def format_duration(seconds: float) -> str:
    """``42 s`` or ``3 min 05 s``, for progress lines."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def timeline_summary(log_: FenceLog, variant: Variant) -> dict[str, object]:
    """This rank's fence-log timeline over the timed steps of ``variant`` (times in ms).

    Every timed step runs one synchronized backward, so the log's i-th iteration is the i-th timed
    step. The representative step is the one whose slowest-rank time is nearest the median.
    """
    from overlapddp import timeline  # not at the top: --candidate ddp runs without overlapddp

    iterations = timeline.summarize(log_)
    if len(iterations) != len(variant.step_spans):
        raise RuntimeError(
            f"The fence log has {len(iterations)} complete iterations but {len(variant.step_spans)} steps "
            "were timed; expected one backward per step."
        )
    exposed = [s.exposed_communication_s * 1e3 for s in iterations]
    last_ready = [s.last_ready_bucket for s in iterations]
    most_common = max(set(last_ready), key=lambda b: (last_ready.count(b), -b))
    steps = [t for block in variant.block_times for t in block]
    median_step = statistics.median(steps)
    index = min(range(len(steps)), key=lambda i: abs(steps[i] - median_step))
    chosen = iterations[index]
    step_start, step_end = variant.step_spans[index]

    def ms(t: float | None) -> float | None:
        return None if t is None else (t - step_start) * 1e3

    spans = [s for s in timeline.bucket_spans(log_) if s.iteration == chosen.iteration]
    return {
        "steps": len(iterations),
        "buckets": len(spans),
        "exposed_communication_ms": {
            "median": statistics.median(exposed),
            "min": min(exposed),
            "max": max(exposed),
            "per_step": exposed,
        },
        "last_ready_bucket": {
            "most_common": most_common,
            "steps": last_ready.count(most_common),
            "per_step": last_ready,
        },
        "representative_step": {
            "index": index,
            "step_ms": steps[index] * 1e3,
            "local_step_ms": (step_end - step_start) * 1e3,
            "backward_end_ms": ms(chosen.backward_end),
            "exposed_communication_ms": chosen.exposed_communication_s * 1e3,
            "buckets": [
                {
                    "bucket": s.bucket,
                    "ready_ms": ms(s.ready),
                    "launched_ms": ms(s.launched),
                    "completed_ms": ms(s.completed),
                    "consumed_ms": ms(s.consumed),
                }
                for s in spans
            ],
        },
    }


def link_summary(args: argparse.Namespace, module: nn.Module) -> dict[str, float] | None:
    """The emulated link's load: gradient bytes per step and the link time they take at least."""
    if args.link_gbps is None:
        return None
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return {
        "gbps": args.link_gbps,
        "gradient_bytes_per_step": nbytes,
        "link_ms_per_step": ring_allreduce_seconds(nbytes, args.world_size, args.link_gbps) * 1e3,
    }


def step_times(variant: Variant) -> dict[str, object]:
    """A variant's median over all timed steps, its per-repeat medians and every step, in ms."""
    return {
        "median_step_ms": median_ms([t for block in variant.block_times for t in block]),
        "repeat_median_ms": [median_ms(block) for block in variant.block_times],
        "step_ms": [[t * 1e3 for t in block] for block in variant.block_times],
    }


def repeat_ratios(reference: Variant, candidate: Variant) -> dict[str, object]:
    """Candidate/reference ratio of each repeat's block medians, and their median, min and max.

    Ratios within a repeat compare blocks that ran back to back, so drift between repeats cancels.
    """
    ratios = [
        statistics.median(cand) / statistics.median(ref)
        for ref, cand in zip(reference.block_times, candidate.block_times, strict=False)
    ]
    return {
        "per_repeat": ratios,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def summarize(reference: Variant, candidate: Variant, orders: list[str]) -> dict[str, object]:
    """Per-variant medians over all timed steps and per-repeat candidate/reference ratios."""
    ratios = repeat_ratios(reference, candidate)
    return {
        "variants": {v.label: step_times(v) for v in (reference, candidate)},
        **{f"ratio_{key}": value for key, value in ratios.items()},
        "first_in_repeat": orders,
    }


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned fixed-width columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) for row in rows]


def format_table(results: dict[str, object], reference: str, candidate: str) -> str:
    """Fixed-width table: variant, median step ms, ratio median [min, max], bit_equal."""
    variants = results["variants"]
    ratio = (
        f"{results['ratio_median']:.3f} [{results['ratio_min']:.3f}, {results['ratio_max']:.3f}]"
    )
    bit_equal = str(results["bit_equal"])
    rows = [
        ("variant", "median step ms", f"ratio vs {reference} median [min, max]", "bit_equal"),
        (reference, f"{variants[reference]['median_step_ms']:.2f}", "1 (reference)", bit_equal),
        (candidate, f"{variants[candidate]['median_step_ms']:.2f}", ratio, bit_equal),
    ]
    lines = aligned(rows)
    link = results["link"]
    if link is not None:
        lines.append(
            f"emulated link: {link['gbps']:g} Gbit/s per rank, {link['gradient_bytes_per_step'] / 2**20:.1f} MiB "
            f"of gradients per step, at least {link['link_ms_per_step']:.1f} ms of link time per step"
        )
    line = results["timeline"]
    if line is None:
        lines.append("timeline: none (only OverlapDDP records a fence log)")
    else:
        exposed = line["exposed_communication_ms"]
        last = line["last_ready_bucket"]
        lines.append(
            f"{candidate} timeline, rank 0, {line['steps']} timed steps, {line['buckets']} buckets: "
            f"exposed communication median {exposed['median']:.2f} ms [{exposed['min']:.2f}, "
            f"{exposed['max']:.2f}]; last bucket ready: {last['most_common']} "
            f"({last['steps']}/{line['steps']} steps)"
        )
    memory = results["memory"]
    if memory["kind"] == "cuda_max_memory_allocated_mib":
        per_variant = ", ".join(f"{k} {v:.1f}" for k, v in memory["per_variant"].items())
        lines.append(
            f"peak CUDA memory allocated in timed blocks (max over ranks), MiB: {per_variant}"
        )
    else:
        per_rank = ", ".join(f"{mib:.1f}" for mib in memory["per_rank"])
        lines.append(
            f"process peak RSS per rank, both variants together (not per variant), MiB: {per_rank}"
        )
    return "\n".join(lines)


def rank_device(args: argparse.Namespace, rank: int) -> torch.device:
    """CPU, or one CUDA device per rank (round-robin over visible devices)."""
    if args.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def benchmark(ctx: RankContext) -> dict[str, object]:
    """Warm up, run the interleaved repeats and check bit-equality; results valid on rank 0."""
    args = ctx.args
    ref_unused = args.find_unused_parameters == "both"
    cand_unused = args.find_unused_parameters in ("both", "candidate")
    ref_label = args.reference + ("+find_unused" if ref_unused else "")
    candidate_label = args.candidate + ("+find_unused" if cand_unused else "")
    candidate_label += "-again" if candidate_label == ref_label else ""
    reference = make_variant(ctx, ref_label, candidate_class(args.reference), ref_unused)
    candidate = make_variant(ctx, candidate_label, candidate_class(args.candidate), cand_unused)
    for variant in (reference, candidate):
        run_block(ctx, variant, args.warmup)
    # Recorded on every rank (same cost everywhere), from the first timed step on.
    fence_log = candidate.model.record_fences() if args.candidate == "overlapddp" else None
    orders = []
    timed_start = time.perf_counter()
    for repeat in range(args.repeats):
        order = (reference, candidate) if repeat % 2 == 0 else (candidate, reference)
        for variant in order:
            run_timed_block(ctx, variant)
        orders.append(order[0].label)
        if ctx.rank == 0:
            ref_ms = median_ms(reference.block_times[-1])
            cand_ms = median_ms(candidate.block_times[-1])
            elapsed = time.perf_counter() - timed_start
            left = elapsed / (repeat + 1) * (args.repeats - repeat - 1)
            eta = f"about {format_duration(left)} left" if left else f"done in {format_duration(elapsed)}"
            log(
                f"repeat {repeat + 1}/{args.repeats} ({order[0].label} first): "
                f"{ref_label} {ref_ms:.2f} ms, {candidate_label} {cand_ms:.2f} ms, "
                f"ratio {cand_ms / ref_ms:.3f}; {eta}"
            )
    mismatches = mismatched_tensors(reference.module, candidate.module)
    results = summarize(reference, candidate, orders)
    results["bit_equal"] = all_ranks_true(not mismatches)
    results["rank0_mismatched_tensors"] = mismatches
    if ctx.device.type == "cuda":
        results["memory"] = {
            "kind": "cuda_max_memory_allocated_mib",
            "per_variant": {
                v.label: max_over_ranks(v.peak_cuda_bytes) / 2**20 for v in (reference, candidate)
            },
        }
    else:
        results["memory"] = {
            "kind": "process_max_rss_mib",
            "per_rank": per_rank_max_rss_mib(args.world_size, ctx.rank),
        }
    results["labels"] = [reference.label, candidate.label]
    results["timeline"] = None if fence_log is None else timeline_summary(fence_log, candidate)
    results["link"] = link_summary(args, candidate.module)
    return results


def run_rank(
    rank: int,
    args: argparse.Namespace,
    store_port: int,
    run_benchmark: Callable[[RankContext], dict[str, object]],
    report_results: Callable[[argparse.Namespace, dict[str, object]], None],
) -> None:
    """Entry point of one spawned rank: join the group, benchmark, report on rank 0."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size)
    group = dist.group.WORLD  # held to the end: see below
    try:
        ctx = RankContext(args, rank, rank_device(args, rank))
        results = run_benchmark(ctx)
        if rank == 0:
            report_results(args, results)
    finally:
        dist.destroy_process_group()
    exit_holding(group)


def exit_holding(group: object) -> NoReturn:
    """End a rank whose results are delivered, with no destructor run and ``group`` still referenced.

    A gloo worker thread can still hold a finished collective's tensors, or a callback that holds
    the group; freed during interpreter finalization (or the group on its own thread) they abort the
    process after it finished ("terminate called without an active exception", seen in CI).
    ``os._exit`` runs no destructor and no finalization; ``group`` is taken only so that the caller's
    reference lasts until then. An error before this point propagates as usual.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(args: argparse.Namespace, results: dict[str, object]) -> None:
    """Print the table and optionally write everything, with the configuration, as JSON."""
    reference, candidate = results["labels"]
    print(format_table(results, reference, candidate), flush=True)
    if args.json:
        write_json(args, results)
    if args.plot:
        for path in plots.write_all(results, vars(args), Path(args.plot)):
            print(f"wrote {path}", flush=True)


def write_json(args: argparse.Namespace, results: dict[str, object]) -> None:
    """Write the results to ``args.json`` with the configuration and torch version, to reproduce them."""
    payload = {"config": vars(args), "torch": torch.__version__, **results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")


def add_run_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """Options every interleaved benchmark here shares: ranks, batch, repeats, seed, output, device."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    parser.add_argument("--image-size", type=int, default=64, help="input side for vision models")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def check_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject counts ``add_run_arguments``'s options cannot take, through ``parser.error``."""
    for name in ("world_size", "batch_size", "image_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults keep a resnet18 run short on a small CPU box."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="resnet18", help="torchvision model name, 'mlp' or 'transformer'"
    )
    add_run_arguments(parser, steps=20, warmup=3)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="default: DDP's own default"
    )
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="X",
        help="reduce through an emulated serialized link of X Gbit/s per rank (benchmarks/link.py), "
        "on both variants; default: no hook, DDP's own path",
    )
    parser.add_argument(
        "--compile",
        choices=("none", "inner", "outer"),
        default="none",
        help="inner: Wrapper(torch.compile(model)); outer: torch.compile(Wrapper(model)); both variants alike",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend for --compile")
    parser.add_argument(
        "--optimizer-overlap",
        action="store_true",
        help="OverlapDDP updates each bucket as soon as it is reduced (attach_optimizer(overlap=True))",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="write step-time and bucket-timeline PNGs here (needs matplotlib)",
    )
    parser.add_argument(
        "--candidate",
        choices=("overlapddp", "ddp"),
        default="overlapddp",
        help="wrapper compared against the reference; 'ddp' against DDP runs DDP against itself",
    )
    parser.add_argument(
        "--reference",
        choices=("ddp", "overlapddp"),
        default="ddp",
        help="the wrapper the candidate is compared against (default: stock DDP)",
    )
    parser.add_argument(
        "--find-unused-parameters",
        choices=("off", "both", "candidate"),
        default="off",
        help="find_unused_parameters=True on both variants, or on the candidate only (with --reference "
        "overlapddp: the flag's own cost)",
    )
    args = parser.parse_args(argv)
    check_run_arguments(parser, args)
    if args.link_gbps is not None and not args.link_gbps > 0:
        parser.error("--link-gbps must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    """Check the candidate imports, start the rendezvous store and spawn the ranks."""
    args = parse_args(argv)
    if args.plot and not plots.matplotlib_available():
        sys.exit(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or this project's 'plot' extra: pip install -e '.[plot]')."
        )
    try:
        candidate_class(args.candidate)
    except ImportError as error:
        sys.exit(f"cannot import the candidate ({error}); use --candidate ddp for an A/A run")
    launch(args, benchmark, report)


def launch(
    args: argparse.Namespace,
    run_benchmark: Callable[[RankContext], dict[str, object]],
    report_results: Callable[[argparse.Namespace, dict[str, object]], None],
) -> None:
    """Spawn ``args.world_size`` single-threaded gloo ranks that run ``run_benchmark``; rank 0 reports.

    Both functions must be module-level, so that the spawned ranks can unpickle them.
    """
    # Port 0 lets the OS pick a free port; the parent hosts the store for the run.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=STORE_TIMEOUT)
    mp.spawn(
        run_rank,
        args=(args, store.port, run_benchmark, report_results),
        nprocs=args.world_size,
        join=True,
    )


if __name__ == "__main__":
    main()
