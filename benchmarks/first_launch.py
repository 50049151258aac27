"""When does the first bucket reach communication, as a fraction of ``loss.backward()``?

Launch (spawns its own ranks):

    python benchmarks/first_launch.py --backend aot_eager --iterations 6

For each wrapper (stock DDP, OverlapDDP) and form (eager, ``Wrapper(torch.compile(model))``,
``torch.compile(Wrapper(model))``) it trains a 6-layer transformer LM (d 256, seq 64, batch 4) on 2
gloo ranks with ``bucket_cap_mb=1``, registers the same all-reduce comm hook on both wrappers that
notes when it is first called in each backward, and prints, per row, the range over iterations 2 on
(after DDP's rebuild) of (first hook call - backward start) / backward duration on rank 0.
``--no-split`` turns OverlapDDP's graph splitting off (what the numbers were before it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlapddp import OverlapDDP  # noqa: E402

VOCAB, SEQ, D_MODEL, LAYERS, BATCH = 1000, 64, 256, 6, 4


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


class FirstCall:
    """Comm-hook state: the time of the first hook call since ``reset``."""

    def __init__(self) -> None:
        self.first: float | None = None

    def reset(self) -> None:
        self.first = None


def timed_allreduce(state, bucket):  # unannotated: DDP rejects the string annotations of this module
    """DDP's default reduction (average, all-reduce), noting the first call."""
    if state.first is None:
        state.first = time.perf_counter()
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def fractions(wrapper: type, form: str, args: argparse.Namespace, rank: int) -> list[float]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    module = LM()
    backend = functools.partial(torch._dynamo.lookup_backend(args.backend))
    model = wrapper(torch.compile(module, backend=backend) if form == "inner" else module, bucket_cap_mb=1)
    state = FirstCall()
    model.register_comm_hook(state, timed_allreduce)
    if wrapper is OverlapDDP:
        model._graph_splitter.enabled = not args.no_split
    if form == "outer":
        model = torch.compile(model, backend=backend)
    result = []
    for step in range(args.iterations):
        g = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        state.reset()
        start = time.perf_counter()
        loss.backward()
        result.append((state.first - start) / (time.perf_counter() - start))
    return result[2:]


def run(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    rows = []
    for form in args.forms:
        for name, wrapper in (("DDP", DistributedDataParallel), ("OverlapDDP", OverlapDDP)):
            got = fractions(wrapper, form, args, rank)
            rows.append(f"| {form} | {name} | {min(got):.2f}-{max(got):.2f} |")
            if rank == 0:
                print(rows[-1], flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--forms", nargs="+", choices=("eager", "inner", "outer"), default=["eager", "inner", "outer"])
    parser.add_argument("--no-split", action="store_true", help="switch OverlapDDP's graph splitting off")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, backend {args.backend}, split {not args.no_split}\n| form | wrapper | first launch / backward |\n| --- | --- | --- |", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(run, args=(2, store.port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
