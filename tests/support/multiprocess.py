"""Running one function on N real ranks: processes from a warm fork server, gloo on 127.0.0.1, no fixed port.

The parent owns a TCPStore on port 0 (the OS picks a free port) and hands its port to the ranks,
so concurrent runs never collide. Each rank uses one intra-op thread.

A run that deadlocks fails ``timeout_s`` after every rank joined the process group (default
``DEFAULT_TIMEOUT_S``, well under a CI harness's limit; starting up has its own limit, since
spawning and importing torch is slow on a loaded machine), naming the test, the ranks that did
not finish, where each of them hung (their Python stacks, dumped on request by ``faulthandler``)
and what the finished ranks returned. On a slow machine ``OVERLAPDDP_TEST_TIMEOUT_SCALE`` (e.g.
``2``) stretches every such timeout.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180
# From spawning until every rank has joined the process group: importing torch in four ranks took
# 148 s on two cores under a load of 16 (seven engineers' work).
STARTUP_TIMEOUT_S = 300
# For the few spawns that run many checks (a whole parity matrix, a soak, torch.compile): still
# under a 600 s harness limit, and enough for them on two cores shared with other work.
SLOW_TIMEOUT_S = 540
TIMEOUT_SCALE_ENV = "OVERLAPDDP_TEST_TIMEOUT_SCALE"
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only; elsewhere no stacks are dumped
_STACK_WAIT_S = 10.0  # at most this long for a hung rank to write its stacks before it is killed


def _rank_main(
    rank: int, world_size: int, port: int, target: Callable, args: tuple, results: Any, pg_timeout_s: float,
    stack_file: str, environment: dict[str, str],
) -> None:
    os.environ.clear()  # a forked rank has the fork server's environment: give it the test's, as spawn would
    os.environ.update(environment)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    groups: list = []  # every process group, held until this process ends: see _end_without_teardown
    with open(stack_file, "w") as stacks:
        if _STACK_SIGNAL is not None:  # the parent asks for every thread's stack when this rank hangs
            faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
            )
            results.put((rank, "started", None))  # the run's own timeout counts from here
            try:
                results.put((rank, "ok", target(rank, world_size, *args)))
            finally:
                groups = _every_group()
                dist.destroy_process_group()
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if _STACK_SIGNAL is not None:
                faulthandler.unregister(_STACK_SIGNAL)  # before its file closes
    _end_without_teardown(results, groups)


def _every_group() -> list:
    """The default group and every ``new_group`` of this rank (torch's registry; private API, so
    only the default group where it moved)."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return list(registry) if registry is not None else [dist.group.WORLD]


def _end_without_teardown(results: Any, groups: list) -> None:
    """Deliver this rank's results, then exit with no destructors run.

    A collective's ``.then`` callbacks run on a gloo worker thread and are released there after the
    waiter has already woken; PowerSGD's hold the process group. If that release drops the group's
    last reference (``destroy_process_group`` dropped the registry's), the group is destroyed on its
    own worker thread, which then joins itself: "terminate called after throwing an instance of
    'std::system_error': Resource deadlock avoided" and exit code -6, after the rank had finished
    (seen in CI, and here 1 run in 3 of the tuned-plan PowerSGD check). ``groups`` keeps a
    reference to each on this thread, and ``os._exit`` ends the process before any destructor can run.
    """
    results.close()
    results.join_thread()  # every result is in the pipe before the process goes
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # ``groups`` are still held: none is destroyed on one of its own threads


def _rank_context() -> Any:
    """Ranks fork from a server that imported torch and overlapddp once per test process.

    Spawning imports them again in every rank (about 8 s of CPU each, most of a short test's cost);
    forking from the test process itself is unsafe (its TCPStore and gloo threads). The server
    starts at the first run of this process, so it imports the package as it is on disk then, and
    what torch reads from the environment at import time is read then too (each rank gets the
    test's environment at its start, for everything read later).
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "overlapddp"])
    return context


def scaled_timeout(timeout_s: float) -> float:
    """``timeout_s`` stretched by ``OVERLAPDDP_TEST_TIMEOUT_SCALE`` (default 1)."""
    return timeout_s * float(os.environ.get(TIMEOUT_SCALE_ENV, "1"))


def run_ranks(
    world_size: int,
    target: Callable,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 120,
    dying: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on every rank; return the results in rank order.

    Raises with every failing rank's traceback; with the ranks that exited without a result; or,
    ``timeout_s`` (scaled, see the module docstring) after every rank started, with the ranks that
    hung and their stacks. Ranks in ``dying`` are expected to exit without a result (their entry is None).
    """
    limit = scaled_timeout(timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = _rank_context()
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="overlapddp-ranks-") as scratch:
        stack_files = [str(Path(scratch) / f"rank{r}.stacks") for r in range(world_size)]
        procs = [
            context.Process(
                target=_rank_main,
                args=(r, world_size, store.port, target, args, results, pg_timeout_s, stack_files[r], dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            collected, problem = _collect(procs, results, world_size, dying, limit)
            if problem is not None:
                raise AssertionError(_report(problem, procs, collected, stack_files, dying))
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    return [collected[r][1] if r in collected else None for r in range(world_size)]


def _collect(
    procs: list[Any], results: Any, world_size: int, dying: frozenset[int], limit: float
) -> tuple[dict[int, tuple[str, Any]], str | None]:
    """Gather each rank's (status, value) until all expected ranks answered, one exited silently,
    or ``limit`` seconds passed since all had started; returns what was gathered and, if the run
    did not complete, why."""
    collected: dict[int, tuple[str, Any]] = {}
    started: set[int] = set()
    expected = set(range(world_size)) - set(dying)
    startup_limit = scaled_timeout(STARTUP_TIMEOUT_S)
    startup_deadline = time.monotonic() + startup_limit
    deadline: float | None = None
    while not expected <= set(collected):
        if _receive(results, started, collected, 0.5):
            continue
        if deadline is None and all(r in started or procs[r].exitcode is not None for r in range(world_size)):
            deadline = time.monotonic() + limit
        silent = [r for r in sorted(expected - set(collected)) if procs[r].exitcode is not None]
        if silent:
            while _receive(results, started, collected, 1.0):  # a result still in an exited rank's pipe
                pass
            silent = [r for r in silent if r not in collected]
            if silent:
                codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in silent)
                return collected, f"ranks {silent} exited without a result ({codes})"
        if deadline is None and time.monotonic() > startup_deadline:
            late = sorted(set(range(world_size)) - started)
            return collected, f"ranks {late} did not join the process group within {startup_limit:g} s"
        if deadline is not None and time.monotonic() > deadline:
            while _receive(results, started, collected, 0.1):
                pass
            missing = sorted(expected - set(collected))
            if missing:
                return collected, f"ranks {missing} did not finish within {limit:g} s"
    return collected, None


def _receive(results: Any, started: set[int], collected: dict[int, tuple[str, Any]], wait_s: float) -> bool:
    """Take one message from the ranks, if one comes within ``wait_s``; returns whether one came."""
    try:
        rank, status, value = results.get(timeout=wait_s)
    except queue.Empty:
        return False
    if status == "started":
        started.add(rank)
    else:
        collected[rank] = (status, value)
    return True


def _report(
    problem: str, procs: list[Any], collected: dict[int, tuple[str, Any]], stack_files: list[str],
    dying: frozenset[int],
) -> str:
    """The failure message: the test, the problem, the hung ranks' stacks, the finished ranks' answers."""
    hung = [r for r, proc in enumerate(procs) if proc.is_alive() and r not in collected and r not in dying]
    if _STACK_SIGNAL is not None:
        for r in hung:
            os.kill(procs[r].pid, _STACK_SIGNAL)
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline and not all(_written(stack_files[r]) for r in hung):
            time.sleep(0.1)
        time.sleep(0.2 if hung else 0)  # a stack is written in several pieces
    for r in hung:
        procs[r].kill()
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)")
    lines = [f"{test}: {problem}"]
    for r in hung:
        stacks = Path(stack_files[r]).read_text() if _written(stack_files[r]) else ""
        lines.append(f"--- rank {r} hung here:\n{stacks.strip() or '(no stack was written)'}")
    for r, (status, value) in sorted(collected.items()):
        said = value if status == "error" else _short(repr(value))
        lines.append(f"--- rank {r} finished ({status}):\n{said}")
    return "\n".join(lines)


def _written(path: str) -> bool:
    return Path(path).exists() and Path(path).stat().st_size > 0


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"
