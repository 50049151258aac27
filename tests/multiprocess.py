"""Running one function on N real ranks: spawned processes, gloo on 127.0.0.1, no fixed port.

The parent owns a TCPStore on port 0 (the OS picks a free port) and hands its port to the ranks,
so concurrent runs never collide. Each rank uses one intra-op thread.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 600


def _rank_main(
    rank: int, world_size: int, port: int, target: Callable, args: tuple, results: Any, pg_timeout_s: float
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        try:
            results.put((rank, "ok", target(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world_size: int,
    target: Callable,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120,
    dying: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on every rank; return the results in rank order.

    Raises with every failing rank's traceback, or after ``timeout_s`` with the ranks that hung.
    Ranks in ``dying`` are expected to exit without a result (their entry is None).
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(
            target=_rank_main, args=(r, world_size, store.port, target, args, results, pg_timeout_s), daemon=True
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        while len(collected) < world_size - len(dying):
            rank, status, value = results.get(timeout=timeout_s)
            collected[rank] = (status, value)
    except Exception:
        missing = sorted(set(range(world_size)) - set(collected))
        errors = "\n".join(f"rank {r}:\n{v}" for r, (s, v) in sorted(collected.items()) if s == "error")
        raise AssertionError(f"ranks {missing} gave no result within {timeout_s} s\n{errors}") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    return [collected[r][1] if r in collected else None for r in range(world_size)]
