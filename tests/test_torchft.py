"""OverlapDDP on torchft: replicas killed, restarted and hung under a real lighthouse, against torchft's DDP.

One run of three replica processes (see tests/torchft_replicas.py) serves every multi-process check:
replica 2 is killed in the backward of step KILL and restarted, rejoining at step REJOIN after
recovering live from a peer; replica 1 hangs in the backward of step HANG and is dropped. The
parameters at the end must equal, bit for bit, those of torchft's own DDP run through the same faults.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("torchft")

from torchft._torchft import LighthouseServer  # noqa: E402

from tests import torchft_replicas as replicas  # noqa: E402
from tests.multiprocess import scaled_timeout  # noqa: E402

KILL, REJOIN, HANG = 2, 4, 6
PLAN = replicas.Plan(replicas=3, faults={KILL: (2, "kill"), HANG: (1, "hang")}, rejoin=REJOIN)
RUN_LIMIT_S = 150


@dataclass
class Outcome:
    logs: dict[int, list[dict[str, Any]]]
    states: dict[int, dict[str, Any]]
    exits: dict[str, int | None]


def run_plan(plan: replicas.Plan) -> Outcome:
    """Start a lighthouse per variant and a process per replica; restart the killed one; kill the
    hung one once the others are done; stop everything."""
    lighthouses = {
        name: LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=replicas.JOIN_TIMEOUT_MS,
                               heartbeat_timeout_ms=replicas.HEARTBEAT_TIMEOUT_MS)
        for name in ("ours", "ref")
    }
    context = mp.get_context("spawn")
    addresses = {name: server.address() for name, server in lighthouses.items()}
    killed = {r for r, kind in plan.faults.values() if kind == "kill"}
    hung = {r for r, kind in plan.faults.values() if kind == "hang"}
    procs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="overlapddp-torchft-") as scratch:

        def start(replica: int, restarted: bool) -> None:
            proc = context.Process(target=replicas.replica_main, daemon=True,
                                   args=(replica, addresses, plan.to_json(), scratch, restarted))
            proc.start()
            procs[f"{replica}{'+' if restarted else ''}"] = proc

        try:
            for r in range(plan.replicas):
                start(r, False)
            finishing = [f"{r}+" if r in killed else f"{r}" for r in range(plan.replicas) if r not in hung]
            deadline = time.monotonic() + scaled_timeout(RUN_LIMIT_S)
            while time.monotonic() < deadline:
                for r in killed:
                    if f"{r}+" not in procs and procs[f"{r}"].exitcode is not None:
                        start(r, True)
                if all(key in procs and procs[key].exitcode is not None for key in finishing):
                    break
                time.sleep(0.1)
            exits = {key: proc.exitcode for key, proc in procs.items()}
        finally:
            for proc in procs.values():
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
            for server in lighthouses.values():
                server.shutdown()
        out = Path(scratch)
        logs = {r: json.loads((out / f"log_{r}.json").read_text())
                for r in range(plan.replicas) if (out / f"log_{r}.json").exists()}
        states = {r: torch.load(out / f"state_{r}.pt") for r in range(plan.replicas) if (out / f"state_{r}.pt").exists()}
    return Outcome(logs, states, exits)


@pytest.fixture(scope="module")
def outcome() -> Outcome:
    return run_plan(PLAN)


def _finishers(plan: replicas.Plan) -> list[int]:
    hung = {r for r, kind in plan.faults.values() if kind == "hang"}
    return [r for r in range(plan.replicas) if r not in hung]


def test_survivors_and_the_restarted_replica_finish(outcome: Outcome) -> None:
    # Replica 2 ended by its own SIGKILL, its restart (2+) and replica 0 finished, replica 1 was
    # still hanging when the others were done (killed by the test: exit -9 or None).
    assert outcome.exits["2"] == -9, outcome.exits
    assert outcome.exits["0"] == 0 and outcome.exits["2+"] == 0, (outcome.exits, outcome.logs)
    assert sorted(outcome.states) == _finishers(PLAN), outcome.exits


def _expected_participants(step: int) -> int:
    """3 replicas, 2 after the kill, 3 again from the rejoin, 2 after the hang."""
    return 2 if KILL <= step < REJOIN or step >= HANG else 3


def test_each_step_committed_once_with_the_quorums_world_size(outcome: Outcome) -> None:
    for r in _finishers(PLAN):
        for variant in ("ours", "ref"):
            committed = [e for e in outcome.logs[r] if e["variant"] == variant and e["committed"]]
            first = REJOIN if r == 2 else 0  # the restarted replica's own log starts where it rejoined
            assert [e["step"] for e in committed] == list(range(first, replicas.STEPS)), (r, variant, committed)
            found = [e["participants"] for e in committed]
            expected = [_expected_participants(e["step"]) for e in committed]
            assert found == expected, (r, variant, found, expected)


def test_a_failed_allreduce_is_applied_by_no_replica(outcome: Outcome) -> None:
    # ours: replica 2 died, and replica 1 hung, with their buckets in flight; every other replica's
    # attempt of that step failed and was not committed. ref: the faulty replica never reached that
    # step, so nothing failed. No other attempt failed (a layout that differs on the restarted
    # replica would make its first step fail).
    for r in _finishers(PLAN):
        failed = [(e["variant"], e["step"]) for e in outcome.logs[r] if not e["committed"]]
        expected = [("ours", KILL)] * (r != 2) + [("ours", HANG)]
        assert failed == expected, (r, outcome.logs[r])


def test_parameters_equal_torchfts_ddp_through_the_same_faults(outcome: Outcome) -> None:
    reference = outcome.states[0]["ref"]["a"]
    for r in _finishers(PLAN):
        state = outcome.states[r]
        for variant in ("ours", "ref"):
            for name, value in state[variant]["a"].items():
                assert torch.equal(value, reference[name]), (r, variant, name)
        for name, value in state["ours"]["b"].items():  # model B: no reference (torchft's never rebuilds)
            assert torch.equal(value, outcome.states[0]["ours"]["b"][name]), (r, name)
    moved = any(not torch.equal(v, p) for v, p in zip(reference.values(), replicas.model_a().parameters()))
    assert moved, "the reference run did not train"
