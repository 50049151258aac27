"""Train resnet18 on synthetic 32x32 images with torch's PowerSGD communication hook and many buckets.

Launch (gloo on CPU, nccl when CUDA is available; --standalone picks a free port):

    torchrun --standalone --nproc-per-node 2 examples/comm_hook_powersgd.py --steps 3

The hook is torch's own, registered unmodified, exactly as with DistributedDataParallel::

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1,
                          start_powerSGD_iter=2, warm_start=True, random_seed=0)
    model.register_comm_hook(state, powerSGD_hook)

Steps 0 and 1 are plain all-reduces (``start_powerSGD_iter=2``); from step 2 on every bucket is
compressed to rank-1 factors P and Q, so ``--steps 3`` is the shortest run that compresses. With
``--bucket-cap-mb 1`` resnet18's 11M parameters fall into dozens of buckets.

Why OverlapDDP here: ``powerSGD_hook`` issues its second and third collectives (the all-reduces of
P and Q) from completion callbacks of the first. Stock DDP starts each bucket's hook as soon as the
bucket is ready, so with several buckets in flight those follow-up collectives can be issued in a
different order on different ranks. NCCL tolerates little of that and gloo none: ``--ddp`` with
several buckets on gloo can hang, abort with a size mismatch, or silently reduce one bucket's P with
another's. Measured on torch 2.14.1, 2 CPU ranks, the 11 buckets of ``--bucket-cap-mb 1``: three of
three ``--ddp --steps 6`` runs died at step 2, the first compressed step (gloo's "Received data size
doesn't match expected size", or the peer's connection reset). OverlapDDP starts
bucket b's hook only after bucket b-1's future has completed, so every rank issues every collective
in the same order, while still overlapping the first bucket's chain with the rest of backward.
``--timeout-s`` bounds the process group's collectives, so a mismatched run ends with an error
instead of hanging forever.

Rank 0 prints its own loss each step, then PowerSGD's counters (iteration, compressed buckets,
compression rate).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

# Make the checkout's ``overlapddp`` importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import setup  # noqa: E402

from overlapddp import OverlapDDP  # noqa: E402

# Either wrapper: the loop below uses only what they share.
Wrapped = OverlapDDP | DistributedDataParallel

NUM_CLASSES = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (PowerSGD compresses from step 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0, help="small caps give many buckets")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120, help="process group timeout for each collective")
    parser.add_argument("--ddp", action="store_true", help="use torch's DistributedDataParallel (may hang, see above)")
    return parser.parse_args()


def build_model(args: argparse.Namespace, device: torch.device) -> tuple[Wrapped, PowerSGDState]:
    """resnet18, wrapped with small buckets, with torch's PowerSGD hook registered on the wrapper."""
    torch.manual_seed(args.seed)
    net = torchvision.models.resnet18(weights=None, num_classes=NUM_CLASSES).to(device)
    wrapper = DistributedDataParallel if args.ddp else OverlapDDP
    device_ids = [device.index] if device.type == "cuda" else None
    model = wrapper(net, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
    state = PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, warm_start=True, random_seed=0
    )
    model.register_comm_hook(state, powerSGD_hook)
    return model, state


def get_batch(args: argparse.Namespace, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random images and labels; each rank draws its own."""
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(NUM_CLASSES, (args.batch_size,), generator=generator)
    return images.to(device), labels.to(device)


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build, wrap, register the hook and train; rank 0 prints its loss per step and PowerSGD's counters."""
    rank = dist.get_rank()
    model, state = build_model(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    if rank == 0:
        wrapper = type(model).__name__
        print(f"{wrapper}(resnet18) + powerSGD_hook on {dist.get_world_size()} x {device.type}, "
              f"bucket_cap_mb={args.bucket_cap_mb}", flush=True)
    model.train()
    for step in range(args.steps):
        began = time.perf_counter()
        images, labels = get_batch(args, generator, device)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, {1000 * (time.perf_counter() - began):.0f} ms", flush=True)
    if rank == 0:
        # One error-feedback tensor per bucket that PowerSGD compressed.
        rate, _, _ = state.compression_stats()
        print(f"PowerSGD: iteration {state.iter}, {len(state.error_dict)} buckets compressed, "
              f"compression rate {rate:.1f}x", flush=True)


def main() -> None:
    args = parse_args()
    device = setup(args.timeout_s)
    train(args, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
