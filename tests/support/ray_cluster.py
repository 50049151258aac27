"""A two-node Ray cluster on this machine for the tests: ``ray start --head`` plus ``ray start --address``.

Each node has one CPU, so a ``TorchTrainer`` with two one-CPU workers puts one worker on each node.
Both nodes stay on loopback addresses, the head on 127.0.0.2 and the second node on 127.0.0.3: Ray
replaces 127.0.0.1 and ``localhost`` (in ``--node-ip-address`` and ``--address``) with the machine's
outward address, but keeps the rest of 127.0.0.0/8; and two addresses let Ray Train see two nodes,
as on two machines.
Each ``ray start --block`` runs in its own session; teardown ends those sessions' processes by their
ids, so nothing else on the machine that runs Ray is touched.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
START_TIMEOUT_S = 90


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _session_pids(session: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session:  # stat's field 6, the session id
                pids.append(int(entry.name))
    return pids


class RayCluster:
    """Starts the two nodes; ``address`` is the head's; ``stop()`` ends every process they started."""

    def __init__(self, log_dir: Path, python_path: str) -> None:
        self.log_dir = log_dir
        # gloo binds the loopback interface, whatever the host name resolves to
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": python_path, "GLOO_SOCKET_IFNAME": "lo"}
        self.procs: list[subprocess.Popen] = []
        self.port = _free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.port}"

    def _node(self, ip: str, env: dict[str, str], *extra: str) -> None:
        ports = {name: _free_port(ip) for name in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                                   "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                   "runtime-env-agent-port")}
        command = ["ray", "start", "--block", f"--node-ip-address={ip}", "--num-cpus=1", "--disable-usage-stats",
                   "--object-store-memory=100000000", "--include-log-monitor=false",
                   *(f"--{name}={port}" for name, port in ports.items()), *extra]
        log = open(self.log_dir / f"ray_node_{len(self.procs)}.log", "w")
        self.procs.append(subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=log))

    def start(self) -> None:
        self._node(HEAD_IP, self.env, "--head", f"--port={self.port}", "--include-dashboard=false")
        self._wait(lambda: _listening(HEAD_IP, self.port), "the head node")
        self._node(SECOND_IP, self.env, f"--address={self.address}")

    def wait_for_nodes(self, alive: Callable[[], int]) -> None:
        self._wait(lambda: alive() == 2, "the second node to join")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[-1] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(path.read_text()[-2000:] for path in sorted(self.log_dir.glob("ray_node_*.log")))
                raise RuntimeError(f"Ray did not start ({what}; exited: {dead}):\n{logs}")
            time.sleep(0.25)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # ray start --block stops its node's processes
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            for pid in _session_pids(proc.pid):  # what is left: workers, agents, a node that did not stop
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        # The head wrote its address here for ray.init() to find; that cluster is gone now.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip() == self.address:
            current.unlink()


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False
