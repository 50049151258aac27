"""Replica groups for the torchft tests: one spawned process per replica group, driven by a fault plan.

Each replica process trains four variants side by side, each on its own lighthouse and manager:
``ours`` (overlapddp's torchft wrapper) and ``ref`` (torchft's own DDP) with the Manager's default
asynchronous quorum, and ``ours_sync`` and ``ref_sync`` with ``use_async_quorum=False``; each wraps
model A (one parameter per bucket) and model B (several parameters per bucket). Each step is two
micro-batches, the first under ``no_sync()``. One round runs one committed step of each variant, in
that order; a fault planned for ``ours`` at a step hits the replica in that step's backward, after
its first buckets were launched:

- ``kill``: the replica SIGKILLs itself (the parent restarts it, see ``restart``);
- ``hang``: it sleeps past every timeout (the parent kills it once the others are done).

The other variants see the same replicas go, at the same step: a replica that dies or hangs in
``ours`` never reaches their step. A restarted replica rejoins every variant at step ``rejoin``:
the others wait there, in the step's files under ``scratch``, until it has asked the lighthouse for
a quorum (so every variant's quorum of that step includes it, whatever the machine's load). With
the asynchronous quorum it heals during that step and applies its peers' state in
``should_commit()``, after its first backward; with the synchronous one, before its forward.

Every attempt is logged (variant, step, participants, committed), and each replica that finishes
writes its final parameters; the test compares them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.support.multiprocess import scaled_timeout

STEPS = 8
LR = 0.05
# Both stretched by OVERLAPDDP_TEST_TIMEOUT_SCALE (tests/support/multiprocess.py) on a slow machine.
TIMEOUT_S = scaled_timeout(5.0)  # collectives, should_commit, checkpoint transfers: a hung replica fails a step
JOIN_TIMEOUT_MS = int(scaled_timeout(3000))  # the lighthouse's wait for a heartbeating replica that does not join
HEARTBEAT_TIMEOUT_MS = 1500  # a replica without heartbeats for this long is dead
MAX_ATTEMPTS = 5  # of one step, before a replica gives up (a planted bug must fail, not loop)


@dataclass(frozen=True)
class Plan:
    """Where the faults are: ``faults`` maps an ``ours`` step to ``(replica, "kill" | "hang")``."""

    replicas: int
    faults: dict[int, tuple[int, str]] = field(default_factory=dict)
    rejoin: int | None = None  # the step at which a killed replica, restarted, rejoins
    check_commit: bool = True  # False: a planted bug, the step applied whatever should_commit says

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "faults": {str(k): v for k, v in self.faults.items()}})

    @staticmethod
    def from_json(text: str) -> Plan:
        raw = json.loads(text)
        raw["faults"] = {int(k): tuple(v) for k, v in raw["faults"].items()}
        return Plan(**raw)


VARIANTS = {"ours": True, "ref": True, "ours_sync": False, "ref_sync": False}  # name: use_async_quorum
OURS = {"ours": "ref", "ours_sync": "ref_sync"}  # each of ours, and the torchft DDP it must equal


def model_a() -> nn.Module:
    """Reduced one parameter per bucket (``A_KWARGS``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def model_b() -> nn.Module:
    """With a 1 KB cap: three buckets, two of them with several parameters (DDP without
    find_unused_parameters would reduce one bucket in its first backward, two once rebuilt)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 8))


# A cap of one byte: each parameter its own bucket.
A_KWARGS: dict[str, Any] = {"bucket_cap_mb_list": [1 / 2**20]}
B_KWARGS: dict[str, Any] = {"bucket_cap_mb": 1 / 1024}


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


class Variant:
    """One model family on its own lighthouse and manager; ``step_once`` runs one attempt."""

    def __init__(self, name: str, replica: int, lighthouse: str, plan: Plan) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.name, self.replica, self.plan, self.lighthouse = name, replica, plan, lighthouse
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S)), min_replica_size=2,
            load_state_dict=self._load, state_dict=self._save, use_async_quorum=VARIANTS[name], init_sync=False,
            replica_id=f"replica_{replica}", store_addr="127.0.0.1", store_port=self.store.port, rank=0,
            world_size=1, lighthouse_addr=lighthouse, hostname="127.0.0.1",
            timeout=timedelta(seconds=TIMEOUT_S), quorum_timeout=timedelta(seconds=60),
            connect_timeout=timedelta(seconds=30),
        )
        if name in OURS:
            from overlapddp.integrations.torchft import DistributedDataParallel as wrapper
        else:
            from torchft import DistributedDataParallel as wrapper
        for key, build, kwargs in (("a", model_a, A_KWARGS), ("b", model_b, B_KWARGS)):
            self.models[key] = wrapper(self.manager, build(), **kwargs)
            self.optimizers[key] = torch.optim.SGD(self.models[key].parameters(), lr=LR)
            if name in OURS:
                self.models[key].attach_optimizer(self.optimizers[key])  # the guard: steps only on reduced gradients

    def _save(self) -> dict[str, Any]:
        return {k: (m.module.state_dict(), self.optimizers[k].state_dict()) for k, m in self.models.items()}

    def _load(self, state: dict[str, Any]) -> None:
        for k, (weights, optim) in state.items():
            self.models[k].module.load_state_dict(weights)
            self.optimizers[k].load_state_dict(optim)

    def step_once(self, fault: str | None, log: list[dict[str, Any]]) -> bool:
        # Synchronous quorum: a recovering replica heals here, before forward. Asynchronous: the quorum
        # runs during the forward, and a recovering replica's own step (its batch) does not count.
        self.manager.start_quorum()
        for optimizer in self.optimizers.values():
            optimizer.zero_grad()
        inputs, target = batch(self.replica, self.manager.current_step())
        for key, model in self.models.items():
            with model.no_sync():  # two micro-batches: the first accumulated locally
                nn.functional.mse_loss(model(inputs[:8]), target[:8]).backward()
            if fault is not None and key == "a":
                _plant_fault(model.module, fault)
            nn.functional.mse_loss(model(inputs[8:]), target[8:]).backward()
        participants = self.manager.num_participants()  # waits for the quorum
        step = self.manager.current_step()
        committed = self.manager.should_commit()
        if committed or not self.plan.check_commit:
            for optimizer in self.optimizers.values():
                optimizer.step()
        error = self.manager.errored()
        log.append({"variant": self.name, "step": step, "participants": participants, "committed": bool(committed),
                    "error": None if error is None else str(error.original_exception)})
        return bool(committed)

    def final_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {n: p.detach().clone() for n, p in m.module.named_parameters()} for k, m in self.models.items()}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _plant_fault(module: nn.Module, fault: str) -> None:
    """Kill or hang this process when the first layer's weight gradient is accumulated: the last
    gradient of backward, so every other bucket has been launched by then."""
    first = next(module.parameters())

    def strike(_: torch.Tensor) -> None:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    first.register_post_accumulate_grad_hook(strike)


def _wait_for(path: Path, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {limit_s} s for {what} ({path})")
        time.sleep(0.05)


def replica_main(replica: int, lighthouses: dict[str, str], plan_json: str, scratch: str, restarted: bool) -> None:
    """One replica group: train both variants to ``STEPS`` under ``plan``; write log and state."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    plan = Plan.from_json(plan_json)
    out = Path(scratch)
    log: list[dict[str, Any]] = []
    variants = [Variant(name, replica, lighthouses[name], plan) for name in VARIANTS]
    if not restarted:  # every replica heartbeats before the first quorum, so that it has them all
        (out / f"started_{replica}").touch()
        for r in range(plan.replicas):
            _wait_for(out / f"started_{r}", f"replica {r} to start")
    try:
        while any(v.manager.current_step() < STEPS for v in variants):
            for variant in variants:
                _one_committed_step(variant, replica, plan, out, restarted, log)
        (out / f"log_{replica}.json").write_text(json.dumps(log))
        torch.save({v.name: v.final_state() for v in variants}, out / f"state_{replica}.pt")
    except BaseException:
        (out / f"log_{replica}.json").write_text(json.dumps(log))
        raise
    finally:
        for variant in variants:
            variant.shutdown()
    sys.stdout.flush()
    os._exit(0)  # no process-group destructors on gloo's threads (see tests/support/multiprocess.py)


def _one_committed_step(variant: Variant, replica: int, plan: Plan, out: Path, restarted: bool,
                        log: list[dict[str, Any]]) -> None:
    for attempt in range(MAX_ATTEMPTS):
        step = variant.manager.current_step()
        if step >= STEPS:
            return
        if plan.rejoin is not None and (restarted and step == 0 or not restarted and step == plan.rejoin):
            _rejoin_barrier(variant, replica, plan, out, restarted)
        fault = None
        if variant.name == "ours" and attempt == 0 and not restarted:
            planned = plan.faults.get(step)
            fault = planned[1] if planned is not None and planned[0] == replica else None
        if variant.step_once(fault, log):
            return
    raise RuntimeError(f"replica {replica}: {variant.name} step {variant.manager.current_step()} failed "
                       f"{MAX_ATTEMPTS} times; log: {log}")


def _rejoin_barrier(variant: Variant, replica: int, plan: Plan, out: Path, restarted: bool) -> None:
    """At step ``rejoin``: the restarted replica asks for its quorum first, then the others do, once
    the lighthouse has its request (so the quorum that forms when they join has all three)."""
    name = variant.name
    others = [r for r in range(plan.replicas) if not _killed(plan, r)]
    if restarted:
        for r in others:
            _wait_for(out / f"{name}_at_rejoin_{r}", f"replica {r} at the rejoin step")
        (out / f"{name}_rejoining").touch()
    else:
        (out / f"{name}_at_rejoin_{replica}").touch()
        _wait_for(out / f"{name}_rejoining", "the restarted replica")
        deadline = time.monotonic() + 60
        while _waiting_for_quorum(variant.lighthouse) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the restarted replica's quorum request did not reach {variant.lighthouse}")
            time.sleep(0.05)


def _waiting_for_quorum(lighthouse: str) -> int:
    """How many replicas have asked the lighthouse for the next quorum (its dashboard's status line)."""
    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    # "... only have 1 participants, need ..." or, once enough asked, "Valid quorum with 2 participants, ..."
    found = re.search(r"(?:have|with) (\d+) participants", status)
    return int(found.group(1)) if found else 0


def _killed(plan: Plan, replica: int) -> bool:
    return any(r == replica and kind == "kill" for r, kind in plan.faults.values())
