#!/usr/bin/env python3
"""A pytest server with torch already imported, so that a mutant's tests do not start Python cold.

Importing torch (with Dynamo, which overlapddp's compile support loads) takes most of a short
test's time: about 8 s of CPU in the test process and again in every rank it spawns. The server
imports torch once and never imports overlapddp or the tests. For each request it forks a child
that runs ``pytest.main`` in its own process group; that child first forks its own
``multiprocessing`` fork server (torch already imported), so the ranks the tests start also begin
warm, and each of them, like the child, imports overlapddp from disk: the mutant on disk now.
Killing the group ends the child, its fork server and every rank at once.

    python3 tools/warm_pytest.py serve SOCKET            # runs until killed
    python3 tools/warm_pytest.py run SOCKET PYTEST_ARGS  # prints the run's output; exits with its status

A client that goes away (cosmic-ray's timeout kills it) has its run's process group killed.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import traceback

# What the server imports once. Not overlapddp, nor tests/: those must come from disk per run.
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.algorithms.ddp_comm_hooks",
    "torch._dynamo",
    "torch.multiprocessing",
    "pytest",
)


def _start_rank_server() -> str:
    """Fork this run's ``multiprocessing`` fork server from this warm, single-threaded process.

    The standard one starts a fresh interpreter (a cold torch import) and, reached from a forked
    process, is not its child; this one is both warm and a child, so ``ensure_running`` sees it.
    """
    from multiprocessing import connection, forkserver, util

    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            forkserver.main(listener.fileno(), alive_r, [])  # serves forks until every client is gone
        finally:  # it ends with SystemExit: leave without running the pytest child's handlers
            os._exit(0)
    listener.close()
    os.close(alive_r)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    util.debug("warm fork server %s", pid)
    return address


def _run_child(request: dict, output_path: str) -> None:
    """In the forked child: run pytest as asked, output to ``output_path``; never returns."""
    os.setpgid(0, 0)  # one process group: this child, its fork server and every rank (the parent sets it too)
    with open(output_path, "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.argv = ["pytest", *request["args"]]
    code, address = 3, None
    try:
        address = _start_rank_server()
        import pytest

        code = int(pytest.main(request["args"]))
    except BaseException:
        traceback.print_exc()  # status 3 with the reason: never a silent "killed"
    finally:
        if address is not None:  # multiprocessing's own cleanup runs at exit, which os._exit skips
            shutil.rmtree(os.path.dirname(address), ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_one(connection: socket.socket) -> None:
    request = json.loads(connection.makefile("r").readline())
    with tempfile.NamedTemporaryFile(prefix="warm-pytest-", suffix=".log", delete=False) as log:
        output_path = log.name
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run_child(request, output_path)
    try:
        os.setpgid(pid, pid)  # here too, so the group exists before the child gets to it
    except OSError:
        pass  # the child already made it (or has exited)
    status = None
    while status is None:
        readable, _, _ = select.select([connection], [], [], 0.2)
        if readable and not connection.recv(1, socket.MSG_PEEK):  # the client went away: end the run
            _kill_group(pid)
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
    _kill_group(pid)  # whatever the run left behind (ranks of a failed run)
    with open(output_path) as output:
        text = output.read()
    os.unlink(output_path)
    try:
        connection.sendall((json.dumps({"status": status, "output": text}) + "\n").encode())
    except OSError:
        pass  # the client is gone


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    import importlib

    sys.dont_write_bytecode = True  # a mutant's bytecode must never be cached for the next one
    for name in WARM_MODULES:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            try:
                _serve_one(connection)
            except Exception:  # one broken request (a client gone mid-line) must not end the server
                traceback.print_exc()


def run(path: str, args: list[str]) -> int:
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    client.sendall((json.dumps(request) + "\n").encode())
    answer = json.loads(client.makefile("r").readline())
    sys.stdout.write(answer["output"])
    return int(answer["status"])


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("serve", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    sys.exit(run(sys.argv[2], sys.argv[3:]))
