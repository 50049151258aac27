"""Force the gradient race and watch the fence hold: OverlapDDP vs stock DDP with slow communication.

Launch (always CPU/gloo, two ranks):

    torchrun --standalone --nproc-per-node 2 examples/race_demo.py

Two ranks train on deliberately different data, so a gradient read before its all-reduce completes
is this rank's local gradient, not the average, and the next weights are wrong. Three copies of one
small MLP (same initial weights, same data, same optimizer) train side by side for ``--steps``
steps:

- ``ddp``: torch's DistributedDataParallel, the reference;
- ``fenced``: OverlapDDP with rank 1's collectives delayed
  (``overlapddp.testing.delay_communication(model, rank=1, seconds=0.05)``): rank 0's collectives
  wait in flight while its backward ends, and the fence makes ``backward()`` wait for them
  (``--stage completion`` delays when each collective's result is delivered instead of its start);
- ``unfenced``: the same, inside ``overlapddp.testing.unfenced(model)``, a TEST-ONLY mode that
  removes the fence: backward hands out each bucket's buffer without waiting for its collective,
  the bug this project exists to prevent.

After every step rank 0 prints, for each OverlapDDP copy, whether all of its parameters are equal to
DDP's (``torch.equal``) and the largest absolute difference; at the end a verdict per copy. Expected:

    fenced: matches DDP
    unfenced: WRONG weights (expected: ...)

The exit code is 0 when the fenced copy matched DDP at every step, on every rank: the unfenced copy
is expected to be wrong, and its result does not change the exit code.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from overlapddp import OverlapDDP  # noqa: E402
from overlapddp.testing import STAGES, delay_communication, unfenced  # noqa: E402

VARIANTS = ("fenced", "unfenced")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per copy")
    parser.add_argument("--delay-s", type=float, default=0.05, help="delay of each of rank 1's collectives")
    parser.add_argument("--stage", choices=STAGES, default="launch", help="delay the start or the completion")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.01, help="small caps give several buckets")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_net(seed: int) -> nn.Module:
    """The same small MLP (same initial weights) for every copy."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def get_batch(rank: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different on each rank (other seed, other scale), identical for every copy on one rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 1_000 * rank + step)
    inputs = torch.randn(16, 32, generator=generator) * (1 + 2 * rank)
    targets = torch.randn(16, 8, generator=generator) + rank
    return inputs, targets


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int, seed: int) -> None:
    inputs, targets = get_batch(rank, step, seed)
    F.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # reuse the gradient tensors, as many training loops do


def compare(model: nn.Module, reference: nn.Module) -> tuple[bool, float]:
    """(every parameter equal to the reference's, largest absolute difference)."""
    pairs = list(zip(model.parameters(), reference.parameters(), strict=False))
    equal = all(torch.equal(a, b) for a, b in pairs)
    worst = max((a - b).abs().max().item() for a, b in pairs)
    return equal, worst


def run(args: argparse.Namespace) -> bool:
    """Train the three copies; returns whether the fenced copy matched DDP at every step on every rank."""
    rank = dist.get_rank()
    ddp = DistributedDataParallel(build_net(args.seed), bucket_cap_mb=args.bucket_cap_mb)
    ours = {name: OverlapDDP(build_net(args.seed), bucket_cap_mb=args.bucket_cap_mb) for name in VARIANTS}
    optimizers = {
        name: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for name, model in [("ddp", ddp), *ours.items()]
    }
    if rank == 0:
        print(f"2 ranks, different data per rank; rank 1's collectives delayed {1000 * args.delay_s:.0f} ms "
              f"at {args.stage}; {args.steps} steps of DDP, fenced and unfenced (test-only) OverlapDDP", flush=True)
    always_equal = {name: True for name in VARIANTS}
    with ExitStack() as stack:
        stack.enter_context(delay_communication(ours["fenced"], rank=1, seconds=args.delay_s, stage=args.stage))
        # Unfenced first, then the delay around it: each context swaps the reducer's fence, so the
        # other order would replace the delayed fence by the unfenced one and drop the delay.
        stack.enter_context(unfenced(ours["unfenced"]))
        stack.enter_context(delay_communication(ours["unfenced"], rank=1, seconds=args.delay_s, stage=args.stage))
        for step in range(args.steps):
            train_step(ddp, optimizers["ddp"], rank, step, args.seed)
            report = []
            for name, model in ours.items():
                train_step(model, optimizers[name], rank, step, args.seed)
                equal, worst = compare(model.module, ddp.module)
                always_equal[name] &= equal
                report.append(f"{name} equal={equal} max_abs_diff={worst:.3e}")
            if rank == 0:
                print(f"step {step}: " + " | ".join(report), flush=True)
    # Every rank must agree that the fenced copy matched: MIN over ranks of 1 (matched) / 0 (not).
    fenced_ok = torch.tensor([int(always_equal["fenced"])])
    dist.all_reduce(fenced_ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        if fenced_ok.item():
            print("fenced: matches DDP", flush=True)
        else:
            print("fenced: DIFFERS from DDP (a bug in OverlapDDP: please report it)", flush=True)
        if always_equal["unfenced"]:
            print("unfenced: matches DDP (the race did not show this time; expected WRONG weights)", flush=True)
        else:
            print("unfenced: WRONG weights (expected: without the fence, gradients are read before "
                  "their all-reduce completes)", flush=True)
    return bool(fenced_ok.item())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # CPU on purpose: the race is the same, and no GPU is needed
    ok = run(args)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
