"""OverlapDDP on torchft: replicas killed, restarted and hung under a real lighthouse, against torchft's DDP.

One run of three replica processes (see tests/support/torchft_replicas.py) serves every multi-process check,
with the Manager's default asynchronous quorum and with a synchronous one: replica 2 is killed in the
backward of step KILL and restarted, rejoining at step REJOIN after recovering live from a peer;
replica 1 hangs in the backward of step HANG and is dropped. The parameters at the end must equal,
bit for bit, those of torchft's own DDP run through the same faults with the same quorum.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("torchft")

from torchft.coordination import LighthouseServer  # noqa: E402

from tests.support import torchft_replicas as replicas  # noqa: E402
from tests.support.multiprocess import run_ranks, scaled_timeout  # noqa: E402

KILL, REJOIN, HANG = 2, 4, 6
PLAN = replicas.Plan(replicas=3, faults={KILL: (2, "kill"), HANG: (1, "hang")}, rejoin=REJOIN)
RUN_LIMIT_S = 150


@dataclass
class Outcome:
    logs: dict[int, list[dict[str, Any]]]
    states: dict[int, dict[str, Any]]
    exits: dict[str, int | None]
    lighthouse_status: str  # ours' lighthouse dashboard once the finishers were done, the hung replica alive


def run_plan(plan: replicas.Plan) -> Outcome:
    """Start a lighthouse per variant and a process per replica; restart the killed one; kill the
    hung one once the others are done; stop everything."""
    lighthouses = {
        name: LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=replicas.JOIN_TIMEOUT_MS,
                               heartbeat_timeout_ms=replicas.HEARTBEAT_TIMEOUT_MS)
        for name in replicas.VARIANTS
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
            status = urllib.request.urlopen(addresses["ours"] + "/status", timeout=10).read().decode()
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
        states = {r: torch.load(out / f"state_{r}.pt")
                  for r in range(plan.replicas) if (out / f"state_{r}.pt").exists()}
    return Outcome(logs, states, exits, status)


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


def test_the_hung_replica_is_named_and_out_of_the_quorum(outcome: Outcome) -> None:
    # The lighthouse's dashboard names the last quorum's members, then every heartbeating replica:
    # replica 1 still heartbeats (its process hangs) but is no longer in the quorum.
    members, heartbeats = outcome.lighthouse_status.split("<h2>Heartbeats</h2>")
    assert "<b>replica_0:" in members and "<b>replica_2:" in members, members
    assert "replica_1:" not in members and "replica_1:" in heartbeats, outcome.lighthouse_status


def _expected_participants(step: int, use_async_quorum: bool) -> int:
    """3 replicas, 2 after the kill, 3 again from the rejoin, 2 after the hang. With the asynchronous
    quorum the replica that heals at the rejoin step is not a participant of that step (its buckets
    are sent as zeros, and its peers' mean is applied once it has their state)."""
    healing = use_async_quorum and step == REJOIN
    return 2 if KILL <= step < REJOIN or step >= HANG or healing else 3


def test_each_step_committed_once_with_the_quorums_world_size(outcome: Outcome) -> None:
    for r in _finishers(PLAN):
        for variant, use_async_quorum in replicas.VARIANTS.items():
            committed = [e for e in outcome.logs[r] if e["variant"] == variant and e["committed"]]
            first = REJOIN if r == 2 else 0  # the restarted replica's own log starts where it rejoined
            assert [e["step"] for e in committed] == list(range(first, replicas.STEPS)), (r, variant, committed)
            found = [e["participants"] for e in committed]
            expected = [_expected_participants(e["step"], use_async_quorum) for e in committed]
            assert found == expected, (r, variant, found, expected)


def test_a_failed_allreduce_is_applied_by_no_replica(outcome: Outcome) -> None:
    # ours: replica 2 died, and replica 1 hung, with their buckets in flight; every other replica's
    # attempt of that step failed and was not committed. The other variants: the faulty replica never
    # reached that step, so nothing failed. No other attempt failed (a layout that differs on the
    # restarted replica would make its first step fail).
    for r in _finishers(PLAN):
        failed = [(e["variant"], e["step"]) for e in outcome.logs[r] if not e["committed"]]
        expected = [("ours", KILL)] * (r != 2) + [("ours", HANG)]
        assert failed == expected, (r, outcome.logs[r])


def test_parameters_equal_torchfts_ddp_through_the_same_faults(outcome: Outcome) -> None:
    for ours, ref in replicas.OURS.items():
        for key, build in (("a", replicas.model_a), ("b", replicas.model_b)):
            reference = outcome.states[0][ref][key]
            for r in _finishers(PLAN):
                for variant in (ours, ref):
                    for name, value in outcome.states[r][variant][key].items():
                        assert torch.equal(value, reference[name]), (r, variant, key, name)
            initial = build().parameters()
            moved = any(not torch.equal(v, p) for v, p in zip(reference.values(), initial, strict=True))
            assert moved, f"the reference run {ref} did not train model {key}"


# -- one replica group: every check in one spawned process -------------------------------------


def _lone_replica_checks(rank: int, world_size: int) -> dict[str, str | None]:
    """Run each check below with managers of one-replica jobs, each with its own lighthouse and store;
    return each check's traceback, or None. (A process of its own: the wrappers' one-rank group,
    the managers' and the gloo groups' threads end with it.)"""
    import traceback

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    started: list[Any] = []  # held until the process ends

    def manager(pg: Any = None) -> Any:
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = pg if pg is not None else ProcessGroupGloo(timeout=timedelta(seconds=10))
        made = Manager(
            pg=pg, min_replica_size=1, load_state_dict=None, state_dict=None, init_sync=False, replica_id="lone",
            store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1", timeout=timedelta(seconds=10),
        )
        started.append((made, pg, lighthouse, store))
        return made

    results: dict[str, str | None] = {}
    for check in (_overlap_check, _compression_check, _refusal_check):
        try:
            check(manager)
            results[check.__name__] = None
        except BaseException:
            results[check.__name__] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def lone_checks() -> dict[str, str | None]:
    return run_ranks(1, _lone_replica_checks, timeout_s=240)[0]


def _train_steps(manager: Any, model: Any, steps: int) -> None:
    for _ in range(steps):
        manager.start_quorum()
        model.zero_grad()
        inputs, target = replicas.batch(0, manager.current_step())
        torch.nn.functional.mse_loss(model(inputs), target).backward()
        assert manager.should_commit()


def test_buckets_reduce_while_backward_goes_on_and_torchfts_ddp_waits(lone_checks) -> None:
    assert lone_checks["_overlap_check"] is None, lone_checks["_overlap_check"]


def test_fp16_compression_goes_through_the_manager(lone_checks) -> None:
    assert lone_checks["_compression_check"] is None, lone_checks["_compression_check"]


def test_options_that_cannot_go_through_the_manager_are_refused_by_name(lone_checks) -> None:
    assert lone_checks["_refusal_check"] is None, lone_checks["_refusal_check"]


def _overlap_check(lone_replica: Any) -> None:
    """With every all-reduce held back 0.3 s, ours launches all buckets of a backward before the first
    completes; torchft's DDP waits for each bucket in its hook, so each launch follows a completion."""
    from torchft import DistributedDataParallel as TorchftDDP

    from benchmarks.slow_group import SlowProcessGroupGloo
    from overlapddp.integrations.torchft import DistributedDataParallel

    def order(wrapper: Any) -> list[str]:
        pg = SlowProcessGroupGloo(delay_s=0.3, timeout=timedelta(seconds=10))
        manager = lone_replica(pg)
        model = wrapper(manager, replicas.model_b(), **replicas.B_KWARGS)
        _train_steps(manager, model, 1)
        pg.events.clear()
        _train_steps(manager, model, 1)
        return [tag for tag, _ in sorted(pg.events, key=lambda e: e[1])]

    ours = order(DistributedDataParallel)
    assert ours == ["launch"] * 3 + ["done"] * 3, ours  # model B's three buckets
    theirs = order(TorchftDDP)
    assert theirs == ["launch", "done"] * 3, theirs


def _compression_check(lone_replica: Any) -> None:
    """torch's fp16_compress_hook, registered on ours, sends each bucket in float16 through the
    manager: with one participant every gradient is its local value rounded to float16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from overlapddp.integrations.torchft import DistributedDataParallel

    manager = lone_replica()
    model = DistributedDataParallel(manager, replicas.model_b(), **replicas.B_KWARGS)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plain = replicas.model_b()
    for step in range(2):
        _train_steps(manager, model, 1)
        plain.zero_grad()
        inputs, target = replicas.batch(0, step)
        torch.nn.functional.mse_loss(plain(inputs), target).backward()
        for (name, ours), local in zip(model.module.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(ours.grad, local.grad.half().float()), (step, name)
    with pytest.raises(RuntimeError, match="before the first backward"):
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)


def _refusal_check(lone_replica: Any) -> None:
    """Each refused option raises, naming itself and why."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.distributed.fsdp import MixedPrecision

    from overlapddp.integrations.torchft import REFUSED, DistributedDataParallel

    manager = lone_replica()
    net = replicas.model_b()
    refused = {
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16),
        "delay_all_reduce_named_params": list(net.named_parameters())[:1],
        "bucket_plan": "tuned",
        "device_mesh": object(),
        "find_unused_parameters": False,
        "static_graph": True,
    }
    assert set(refused) | {"process_group", "param_to_hook_all_reduce"} == set(REFUSED)
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"torchft: {name}(=\S+)? is not supported: {REFUSED[name][:30]}"):
            DistributedDataParallel(manager, net, **{name: value})
    with pytest.raises(TypeError, match="manager must be a torchft.Manager, got Sequential"):
        DistributedDataParallel(net, net)
    with pytest.raises(TypeError, match="'bucket_cap' is not an argument of DistributedDataParallel"):
        DistributedDataParallel(manager, net, bucket_cap=1)
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True))
    with pytest.raises(ValueError, match=r"sparse gradients \(0 have sparse=True\)"):
        DistributedDataParallel(manager, sparse)

    model = DistributedDataParallel(manager, net)
    state = powerSGD_hook.PowerSGDState(process_group=None)
    with pytest.raises(ValueError, match="powerSGD_hook cannot be registered: every bucket is already reduced through the torchft"):
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    with pytest.raises(ValueError, match=r"attach_optimizer\(overlap=True\) is not supported: each bucket's update"):
        model.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
    with pytest.raises(ValueError, match=r"join\(\) is not supported"):
        model.join()
    with pytest.raises(ValueError, match="count_tokens is not supported"):
        model.count_tokens(3)
    with pytest.raises(ValueError, match="pickling or copy.deepcopy is not supported"):
        copy.deepcopy(model)


def test_the_docs_show_the_one_line_usage() -> None:
    usage = "from overlapddp.integrations.torchft import DistributedDataParallel"
    root = Path(__file__).resolve().parents[2]
    for page in (root / "README.md", root / "docs" / "frameworks.md"):
        assert usage in page.read_text(), f"{page} no longer shows {usage}"
    frameworks = (root / "docs" / "frameworks.md").read_text()
    section = frameworks.split("## torchft")[1].split("\n## ")[0]
    assert "What a torchft user changes: one import." in section
    assert "use_async_quorum=False" not in section, "the swap needs no change to the Manager's arguments"
