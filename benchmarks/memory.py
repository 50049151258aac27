"""Gradient memory with and without ``gradient_as_bucket_view``, counted from live storages.

Launch: ``python benchmarks/memory.py --model resnet18``

One rank, two training steps per setting; then it adds up the bytes of every distinct storage
behind ``param.grad`` and behind OverlapDDP's bucket buffers. With bucket views the gradients *are*
the buckets, so one copy of the gradients disappears.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlapddp import OverlapDDP  # noqa: E402


def gradient_bytes(model: OverlapDDP) -> int:
    """Bytes of distinct storages held by gradients and bucket buffers."""
    storages = {}
    tensors = [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [p.storage.buffer for p in model._reducer.pipelines]
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(model_name: str, bucket_view: bool) -> int:
    torch.manual_seed(0)
    model = OverlapDDP(torchvision.models.get_model(model_name, num_classes=10), gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        out = model(torch.randn(2, 3, 64, 64))
        torch.nn.functional.cross_entropy(out, torch.tensor([0, 1])).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return gradient_bytes(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    copied, viewed = measure(args.model, False), measure(args.model, True)
    print(f"{args.model}: gradients + buckets {copied / 2**20:.1f} MiB with copies, "
          f"{viewed / 2**20:.1f} MiB with gradient_as_bucket_view=True (saves {(copied - viewed) / 2**20:.1f} MiB, "
          f"ratio {viewed / copied:.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
