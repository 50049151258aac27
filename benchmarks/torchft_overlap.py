"""Forward + backward time per step on torchft: torchft's own DDP against overlapddp's torchft wrapper.

Launch (the script starts its lighthouses and replica processes itself; CPU, gloo):

    python benchmarks/torchft_overlap.py --replicas 2 --delay-ms 20 --steps 10 --repeats 5

Each replica process builds the same MLP three times, each on its own lighthouse and ``Manager``
(torchft's defaults: the quorum runs asynchronously, during the forward), whose process group is
``benchmarks/slow_group.py``'s: every all-reduce completes ``--delay-ms`` after it was issued.
The three wrappers: ``torchft`` (``torchft.DistributedDataParallel``), ``overlapddp``
(``overlapddp.integrations.torchft.DistributedDataParallel``: DDP's first layout kept for good,
unused parameters searched each forward, as torchft's DDP) and ``rebuilt`` (plain ``OverlapDDP``
with the integration's manager hook: DDP's layout rebuilt after the first step, no search; what a
recovering replica could not follow, so fault-free runs only). After ``--warmup`` steps of each,
each repeat times ``--steps`` steps of each wrapper in turn, the order rotating. A step's time is
from the forward (just after ``zero_grad()`` started the quorum) to the return of
``loss.backward()``, on the slowest replica: every wrapper has every bucket reduced and written to
``.grad`` by then (torchft's waits in each bucket's hook, ours at the end of backward).
``should_commit`` is outside the timed span.

Printed: per repeat, the median step time of each and the ratios torchft's / ours and rebuilt /
ours, then each ratio's median with its min and max over repeats, the bucket counts, and whether
the parameters are bit-equal at the end (with 2 replicas each element's sum has one order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's overlapddp and benchmarks

WIDTH, DEPTH, BATCH = 256, 8, 64
WRAPPERS = ("torchft", "overlapddp", "rebuilt")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, WIDTH)]
    for _ in range(DEPTH):
        layers += [nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(WIDTH, 8))


def _manager(replica: int, lighthouse: str, delay_s: float, models: dict[str, nn.Module]) -> Any:
    from torchft import Manager

    from benchmarks.slow_group import SlowProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=SlowProcessGroupGloo(delay_s=delay_s, timeout=timedelta(seconds=60)), min_replica_size=1,
        load_state_dict=lambda state: models["model"].module.load_state_dict(state),
        state_dict=lambda: models["model"].module.state_dict(), init_sync=False,
        replica_id=f"bench_{replica}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=timedelta(seconds=60),
    )
    return manager, store


def replica_main(replica: int, lighthouses: dict[str, str], args: argparse.Namespace, results: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from torchft import DistributedDataParallel as TorchftDDP

    from overlapddp.integrations.torchft import DistributedDataParallel as Ours

    wrappers = {"torchft": TorchftDDP, "overlapddp": Ours, "rebuilt": _rebuilt}
    cap = None if args.bucket_cap_mb == 0 else args.bucket_cap_mb
    variants: dict[str, dict[str, Any]] = {}
    for name, wrapper in wrappers.items():
        holder: dict[str, nn.Module] = {}
        manager, store = _manager(replica, lighthouses[name], args.delay_ms / 1000, holder)
        model = wrapper(manager, build_model(), bucket_cap_mb=cap)
        holder["model"] = model
        variants[name] = {"manager": manager, "store": store, "model": model,
                          "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}
    step_counter = {name: 0 for name in variants}

    def step(name: str) -> float:
        v = variants[name]
        v["manager"].start_quorum()
        v["optimizer"].zero_grad()
        g = torch.Generator().manual_seed(1000 * step_counter[name] + replica)
        x, y = torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 8, generator=g)
        start = time.perf_counter()
        loss = nn.functional.mse_loss(v["model"](x), y)
        loss.backward()
        elapsed = time.perf_counter() - start
        if v["manager"].should_commit():
            v["optimizer"].step()
        step_counter[name] += 1
        return elapsed

    for _ in range(args.warmup):
        for name in variants:
            step(name)
    repeats = []
    for r in range(args.repeats):
        order = WRAPPERS[r % 3:] + WRAPPERS[:r % 3]
        repeats.append({name: [step(name) for _ in range(args.steps)] for name in order})
    params = {name: [p.detach().clone() for p in v["model"].module.parameters()] for name, v in variants.items()}
    equal = all(torch.equal(a, b) for name in WRAPPERS[1:] for a, b in zip(params["torchft"], params[name], strict=True))
    buckets = {name: len(variants[name]["model"].bucket_indices()) for name in WRAPPERS[1:]}
    results.put((replica, {"repeats": repeats, "bit_equal": equal, "buckets": buckets}))
    for v in variants.values():
        v["manager"].shutdown(wait=False)
    results.close()
    results.join_thread()
    os._exit(0)  # no process-group destructors on gloo's threads


def _rebuilt(manager: Any, module: nn.Module, bucket_cap_mb: float | None) -> nn.Module:
    """Plain OverlapDDP on this rank's own group (made by the integration's wrapper, built first),
    its buckets reduced by the integration's manager hook: DDP's layout, rebuilt after the first step."""
    from overlapddp import OverlapDDP
    from overlapddp.integrations.torchft import ManagerReduction, manager_allreduce_hook

    model = OverlapDDP(module, process_group=dist.group.WORLD, bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(ManagerReduction(manager), manager_allreduce_hook)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25, help="0: DDP's default caps (1 MiB, then 25)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from torchft.coordination import LighthouseServer

    lighthouses = {name: LighthouseServer(bind="127.0.0.1:0", min_replicas=args.replicas) for name in WRAPPERS}
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=replica_main, args=(r, {n: s.address() for n, s in lighthouses.items()},
                                                         args, results)) for r in range(args.replicas)]
    for proc in procs:
        proc.start()
    try:
        gathered = dict(results.get(timeout=1200) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for server in lighthouses.values():
            server.shutdown()
    report(args, gathered)


def report(args: argparse.Namespace, gathered: dict[int, dict[str, Any]]) -> None:
    rows = []
    for r in range(args.repeats):
        # a step's time is the slowest replica's
        slowest = {name: [max(gathered[rep]["repeats"][r][name][i] for rep in gathered) for i in range(args.steps)]
                   for name in WRAPPERS}
        medians = {name: statistics.median(times) for name, times in slowest.items()}
        rows.append({**{f"{n}_ms": round(1000 * m, 2) for n, m in medians.items()},
                     "ratio": round(medians["torchft"] / medians["overlapddp"], 3),
                     "rebuilt_ratio": round(medians["rebuilt"] / medians["overlapddp"], 3)})
    summary: dict[str, Any] = {
        "replicas": args.replicas, "delay_ms": args.delay_ms, "bucket_cap_mb": args.bucket_cap_mb,
        "buckets": gathered[0]["buckets"], "steps": args.steps, "repeats": args.repeats, "per_repeat": rows,
        "bit_equal": all(g["bit_equal"] for g in gathered.values()),
    }
    for key in ("ratio", "rebuilt_ratio"):
        ratios = [row[key] for row in rows]
        summary[key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    for row in rows:
        print(f"torchft DDP {row['torchft_ms']:8.2f} ms   overlapddp {row['overlapddp_ms']:8.2f} ms   "
              f"rebuilt {row['rebuilt_ms']:8.2f} ms   torchft/ours {row['ratio']:.2f}   "
              f"rebuilt/ours {row['rebuilt_ratio']:.3f}")
    for key, label in (("ratio", "torchft's / ours"), ("rebuilt_ratio", "rebuilt / ours")):
        print(f"{label}: median {summary[key]['median']:.3f} (min {summary[key]['min']:.3f}, "
              f"max {summary[key]['max']:.3f}) over {args.repeats} repeats")
    print(f"buckets {summary['buckets']}; {args.delay_ms} ms per all-reduce; bit-equal: {summary['bit_equal']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
