"""Train a torchvision classifier on synthetic images with OverlapDDP (or stock DDP, for comparison).

Launch (gloo on CPU, nccl when CUDA is available; --standalone picks a free port):

    torchrun --standalone --nproc-per-node 2 examples/train_torchvision.py --steps 2

Other uses:

    # any torchvision classification model, 4 micro-batches per optimizer step
    torchrun --standalone --nproc-per-node 2 examples/train_torchvision.py --model mobilenet_v3_small --grad-accum 4
    # save at the end, then continue from the saved step up to step 20
    torchrun --standalone --nproc-per-node 2 examples/train_torchvision.py --steps 10 --checkpoint /tmp/ckpt.pt
    torchrun --standalone --nproc-per-node 2 examples/train_torchvision.py --steps 20 --checkpoint /tmp/ckpt.pt --resume
    # the same run with torch's DistributedDataParallel
    torchrun --standalone --nproc-per-node 2 examples/train_torchvision.py --steps 2 --ddp

The checkpoint holds the wrapper's ``state_dict()`` (keys start with ``module.``, as with DDP), so a
checkpoint written with ``--ddp`` resumes under OverlapDDP and the other way round. ``--steps`` is
the total number of optimizer steps, so a resumed run trains from the saved step up to ``--steps``.
The data order depends only on ``--seed`` and the step, so a resumed run sees the batches that an
uninterrupted run would have seen. Rank 0 prints its own loss each step.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms

# Make the checkout's ``overlapddp`` importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import setup  # noqa: E402

from overlapddp import OverlapDDP  # noqa: E402

# Either wrapper: the loop below uses only what they share.
Wrapped = OverlapDDP | DistributedDataParallel

NUM_CLASSES = 10
DATASET_SIZE = 512
# Auxiliary heads do not feed the loss, and unused parameters need find_unused_parameters=True.
MODEL_KWARGS: dict[str, dict[str, bool]] = {
    "googlenet": {"aux_logits": False},
    "inception_v3": {"aux_logits": False},
}

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18", help="torchvision classification model name")
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps (a resumed run continues to it)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="images per micro-batch per rank")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--checkpoint", type=Path, help="rank 0 saves model, optimizer and step here at the end")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint and continue from its step")
    parser.add_argument("--ddp", action="store_true", help="use torch's DistributedDataParallel instead")
    args = parser.parse_args()
    if args.resume and args.checkpoint is None:
        parser.error("--resume needs --checkpoint PATH")
    if args.grad_accum < 1:
        parser.error(f"--grad-accum must be at least 1, got {args.grad_accum}")
    return args


def build_model(args: argparse.Namespace, device: torch.device) -> Wrapped:
    """The named model, wrapped; the wrapper broadcasts rank 0's initial weights."""
    torch.manual_seed(args.seed)
    net = torchvision.models.get_model(
        args.model, weights=None, num_classes=NUM_CLASSES, **MODEL_KWARGS.get(args.model, {})
    ).to(device)
    wrapper = DistributedDataParallel if args.ddp else OverlapDDP
    device_ids = [device.index] if device.type == "cuda" else None
    return wrapper(net, device_ids=device_ids)


def build_loader(args: argparse.Namespace) -> DataLoader:
    """Synthetic images; the sampler gives each rank its own share of every epoch."""
    dataset = torchvision.datasets.FakeData(
        size=DATASET_SIZE,
        image_size=(3, args.image_size, args.image_size),
        num_classes=NUM_CLASSES,
        transform=transforms.ToTensor(),
    )
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True)


def micro_batches(loader: DataLoader, start: int) -> Iterator[Batch]:
    """Every micro-batch from global index ``start`` on, across epochs, in the order a fresh run sees them."""
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError(f"{DATASET_SIZE} images are too few for one batch per rank; lower --batch-size.")
    epoch, skip = divmod(start, per_epoch)
    while True:
        loader.sampler.set_epoch(epoch)
        yield from itertools.islice(loader, skip, None)
        epoch, skip = epoch + 1, 0


def load_checkpoint(path: Path, model: Wrapped, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Restore model and optimizer on every rank; returns the number of steps already taken."""
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["step"])


def save_checkpoint(path: Path, model: Wrapped, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Rank 0 writes; the barrier keeps other ranks from exiting before the file is complete."""
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        print(f"saved step {step} to {path}", flush=True)
    dist.barrier()


def train_step(
    model: Wrapped, optimizer: torch.optim.Optimizer, batches: Iterator[Batch], grad_accum: int, device: torch.device
) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss, detached."""
    total = torch.zeros((), device=device)
    for micro in range(grad_accum):
        images, labels = (t.to(device, non_blocking=True) for t in next(batches))
        # All but the last micro-batch accumulate locally; the last backward reduces the sum.
        with model.no_sync() if micro < grad_accum - 1 else nullcontext():
            loss = F.cross_entropy(model(images), labels) / grad_accum
            loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Build, wrap, optionally resume, train and optionally save; rank 0 prints its loss per step."""
    rank = dist.get_rank()
    model = build_model(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = load_checkpoint(args.checkpoint, model, optimizer, device) if args.resume else 0
    if rank == 0:
        wrapper = type(model).__name__
        print(f"{wrapper}({args.model}) on {dist.get_world_size()} x {device.type}, steps {start}..{args.steps - 1}")
    batches = micro_batches(build_loader(args), start * args.grad_accum)
    model.train()
    for step in range(start, args.steps):
        began = time.perf_counter()
        loss = train_step(model, optimizer, batches, args.grad_accum, device).item()
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}, {1000 * (time.perf_counter() - began):.0f} ms", flush=True)
    if args.checkpoint is not None:
        save_checkpoint(args.checkpoint, model, optimizer, max(start, args.steps))


def main() -> None:
    args = parse_args()
    device = setup()
    train(args, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
