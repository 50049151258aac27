"""Per-iteration cost of the desync progress records (overlapddp/progress.py).

Each synchronized iteration writes this rank's record to the process group's store twice (after the
forward, after the reduction), and once more for a bucket not yet reduced when the rank starts waiting
for it; this times three such writes per iteration, on every rank at once, and prints the median and
the 90th percentile per iteration of the slowest rank:

    python benchmarks/progress_cost.py --world-size 2 --iterations 2000

Divide by a model's step time (benchmarks/compare.py) for the share of a step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlapddp.progress import ProgressRecord  # noqa: E402


def run_rank(rank: int, world_size: int, port: int, iterations: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(minutes=2))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    record = ProgressRecord(dist.group.WORLD, 1, torch.device("cpu"))
    per_iteration = []
    unfinished = torch.futures.Future()  # a bucket still being reduced
    dist.barrier()
    for iteration in range(1, iterations + 1):
        started = time.perf_counter()
        record.forward(iteration, iteration - 1, False)
        record.wait_for(0, unfinished)
        record.reduced(iteration, iteration)
        per_iteration.append(time.perf_counter() - started)
    slowest = torch.tensor(sorted(per_iteration), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        values = slowest.tolist()
        p90 = values[int(0.9 * len(values))]
        print(f"{world_size} ranks, {iterations} iterations: three store writes per iteration, median "
              f"{statistics.median(values) * 1e6:.1f} us, p90 {p90 * 1e6:.1f} us (slowest rank)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(run_rank, args=(args.world_size, store.port, args.iterations), nprocs=args.world_size)


if __name__ == "__main__":
    main()
