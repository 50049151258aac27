"""torchft's training script with one import swapped: tests/support/torchft_train_ddp.py run as written
(torchft's DDP) and with ``from torchft import DistributedDataParallel`` replaced by overlapddp's,
two replica groups each, a real lighthouse per job, the Manager's default asynchronous quorum.

Two scenarios, each running both jobs at once: healthy, and replica group 1 killed (SIGKILL) once it
has applied step KILL - 1, then restarted, recovering live from its peer at step KILL. Every
process must end with exit code 0 (a crash at interpreter exit included) except the killed one, the
attempts (step, participants, committed) of both jobs must be the same, and the final parameters of
every replica group of the swapped job must equal torchft's, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

from torchft.coordination import LighthouseServer  # noqa: E402

from tests.support.multiprocess import scaled_timeout  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "torchft_train_ddp.py"
THEIRS = "from torchft import DistributedDataParallel\n"
OURS = "from overlapddp.integrations.torchft import DistributedDataParallel\n"
REPLICAS, STEPS, KILL = 2, 8, 4
RUN_LIMIT_S = 240


@dataclass
class Job:
    """One launch of the script: a lighthouse and a process per replica group (and the restarts)."""

    script: Path
    out: Path
    kill_at: int | None
    lighthouse: Any = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    stores: list[Any] = field(default_factory=list)  # each launch's TCPStore, as torchrun's agent serves it

    def start(self) -> None:
        self.out.mkdir()
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=REPLICAS, join_timeout_ms=10_000)
        for replica in range(REPLICAS):
            self._launch(replica, restarted=False)

    def _launch(self, replica: int, restarted: bool) -> None:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse.address(), "REPLICA_GROUP_ID": str(replica),
               "NUM_REPLICA_GROUPS": str(REPLICAS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "RANK": "0", "WORLD_SIZE": "1", "STEPS": str(STEPS), "OUT": str(self.out), "GLOO_SOCKET_IFNAME": "lo",
               "PG_TIMEOUT_S": str(scaled_timeout(20.0)), "OMP_NUM_THREADS": "1"}
        if self.kill_at is not None and replica == 1 and not restarted:
            env["KILL_AT_STEP"] = str(self.kill_at)
        log = open(self.out / f"stderr_{replica}{'+' if restarted else ''}.txt", "w")  # noqa: SIM115
        self.procs[f"{replica}{'+' if restarted else ''}"] = subprocess.Popen(
            [sys.executable, str(self.script)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.out)

    def poll(self) -> bool:
        """Restart the killed replica group once it is gone; True once every last process ended."""
        if self.kill_at is not None and "1+" not in self.procs and self.procs["1"].poll() is not None:
            self._launch(1, restarted=True)
        last = ["0", "1+" if self.kill_at is not None else "1"]
        return all(key in self.procs and self.procs[key].poll() is not None for key in last)

    def stop(self) -> dict[str, int | None]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        self.lighthouse.shutdown()
        return {key: proc.returncode for key, proc in self.procs.items()}

    def result(self, replica: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        return (json.loads((self.out / f"log_{replica}.json").read_text()),
                torch.load(self.out / f"state_{replica}.pt"))

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("stderr_*")))


def swapped_script(folder: Path) -> Path:
    """The script with its DDP import line, and nothing else, replaced by overlapddp's."""
    text = SCRIPT.read_text()
    assert text.count(THEIRS) == 1, f"{SCRIPT} must import torchft's DDP on a line of its own"
    swapped = folder / "train_ddp_swapped.py"
    swapped.write_text(text.replace(THEIRS, OURS))
    return swapped


@dataclass
class Scenario:
    exits: dict[str, dict[str, int | None]]
    jobs: dict[str, Job]


def run_both(folder: Path, kill_at: int | None) -> Scenario:
    """The script as written and swapped, side by side, each with its own lighthouse."""
    jobs = {"torchft": Job(SCRIPT, folder / "torchft", kill_at), "overlapddp": Job(swapped_script(folder),
                                                                                  folder / "overlapddp", kill_at)}
    exits: dict[str, dict[str, int | None]] = {}
    try:
        for job in jobs.values():
            job.start()
        deadline = time.monotonic() + scaled_timeout(RUN_LIMIT_S)
        while time.monotonic() < deadline and not all([job.poll() for job in jobs.values()]):
            time.sleep(0.1)
    finally:
        for name, job in jobs.items():
            exits[name] = job.stop()
    return Scenario(exits, jobs)


@pytest.fixture(scope="module")
def scenarios() -> Any:
    with tempfile.TemporaryDirectory(prefix="overlapddp-torchft-script-") as scratch:
        folder = Path(scratch)
        (folder / "healthy").mkdir()
        (folder / "killed").mkdir()
        yield {"healthy": run_both(folder / "healthy", None), "killed": run_both(folder / "killed", KILL)}


@pytest.mark.parametrize("name", ["healthy", "killed"])
def test_every_process_exits_cleanly(scenarios: dict[str, Scenario], name: str) -> None:
    scenario = scenarios[name]
    for job_name, exits in scenario.exits.items():
        expected = {"0": 0, "1": 0} if name == "healthy" else {"0": 0, "1": -9, "1+": 0}
        assert exits == expected, (job_name, exits, scenario.jobs[job_name].output())


@pytest.mark.parametrize("name", ["healthy", "killed"])
def test_the_swapped_script_trains_bit_equal_to_torchfts_ddp(scenarios: dict[str, Scenario], name: str) -> None:
    jobs = scenarios[name].jobs
    reference_log, reference = jobs["torchft"].result(0)
    for replica in range(REPLICAS):
        for job_name, job in jobs.items():
            log, state = job.result(replica)
            assert set(state) == set(reference), (job_name, replica)
            for key, value in state.items():
                assert torch.equal(value, reference[key]), (name, job_name, replica, key)
        assert jobs["overlapddp"].result(replica)[0] == jobs["torchft"].result(replica)[0], (name, replica)
    committed = [a["step"] for a in reference_log if a["committed"]]
    assert committed == list(range(STEPS)), reference_log
    assert all(a["committed"] for a in reference_log), reference_log
    if name == "killed":  # the restarted replica heals at step KILL: it is not counted among the participants
        rejoined = jobs["torchft"].result(1)[0]
        assert rejoined[0] == {"step": KILL, "participants": 1, "committed": True}, rejoined
