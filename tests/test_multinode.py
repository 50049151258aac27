"""Multi-node launch: two torchrun agents ("nodes") on this machine meet through a c10d rendezvous.

This is the launch that docs/multinode.md describes for two hosts, with 127.0.0.1 as the rendezvous
endpoint, one rank per node and gloo on the loopback interface. The port is a free one the OS
picked (bind to port 0, read it, close), so concurrent runs never collide, and every run has its
own rendezvous id. Both agents run under a timeout and are killed with their workers if it expires.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
STEP_LINE = re.compile(r"^step (\d+): loss (\S+),", re.MULTILINE)


def free_port() -> int:
    """A port nobody listens on right now: the OS picks it for a socket that is then closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_command(node_rank: int, port: int, rdzv_id: str) -> list[str]:
    """One node's torchrun. On one machine both nodes would try to host the rendezvous store, so
    ``is_host`` says which does (on separate hosts torchrun works that out from the endpoint)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}",
        str(REPO / "examples" / "train_lm.py"), "--steps", "2",
    ]


def test_two_nodes_with_c10d_rendezvous_train_the_lm():
    port, rdzv_id = free_port(), f"overlapddp-test-{uuid.uuid4().hex}"
    # CPU tier: gloo over the loopback interface, one intra-op thread per rank.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}
    # Each agent leads its own process group, so a timeout can kill it together with its worker.
    nodes = [
        subprocess.Popen(
            agent_command(node_rank, port, rdzv_id), cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        for node_rank in (0, 1)
    ]
    outputs: list[tuple[str, str]] = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        logs = [node.communicate() for node in nodes]
        raise AssertionError(f"the two nodes did not finish within {TIMEOUT_S} s\n{logs}") from None
    for node_rank, (node, (stdout, stderr)) in enumerate(zip(nodes, outputs, strict=False)):
        assert node.returncode == 0, (
            f"node {node_rank} exited with {node.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    # The c10d rendezvous assigns global ranks (--node-rank is only used by the static backend), so
    # either node may hold rank 0, which alone prints; exactly one of them must have.
    printing = [stdout for stdout, _ in outputs if STEP_LINE.search(stdout)]
    assert len(printing) == 1, outputs
    assert "OverlapDDP(TinyLM" in printing[0] and "on 2 x cpu" in printing[0], printing[0]
    losses = {int(step): float(loss) for step, loss in STEP_LINE.findall(printing[0])}
    assert set(losses) == {0, 1} and all(math.isfinite(loss) for loss in losses.values()), printing[0]
