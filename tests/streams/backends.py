"""What NCCL, gloo's worker threads and the autograd engine do with streams, as the detector sees it.

NCCL (torch 2.14's ``ProcessGroupNCCL`` and ``ivalue::Future`` on CUDA):

- an async collective runs on the group's NCCL stream after that stream waited on the launching
  (current) stream, and keeps its tensors alive until it is done;
- ``Work.wait()`` makes the current stream wait on the collective's end event;
- the future is complete at enqueue; its ``wait()`` makes the current stream wait on its events and
  records its value's storages for that stream; ``value()`` orders nothing;
- ``then`` and ``add_done_callback`` run the callback at once on a pool stream that first waits on
  the parent's events (and records the parent value's storages for it); the child's events are
  recorded there after the callback;
- a synchronous collective is an async one waited at once; a sparse tensor is refused.

Gloo (CPU): an async collective reads and writes its tensors on a worker thread, modelled as one
more stream that starts after the host and that the host joins when it waits on the work or its
future; callbacks run on that worker after the collective. A sparse all-reduce replaces its input's
indices and values there.

The autograd engine: backward runs on the stream the root was produced on, after that stream waited
on the caller's; end-of-backward callbacks run on the caller's stream after it waited on backward's.

Collectives are modelled for a one-rank group (the result is the input); the group itself is the
test process's real one-rank gloo group, used for ranks and sizes and host-level object gathers.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.futures import Future

from overlapddp import torch_compat
from tests.streams.sim import Accesses, Sim, SimEvent, SimStream, _tensors


class SimFuture(Future):
    """A collective's (or callback's) future under the model: complete, with the ordering of its
    backend. ``after`` is the event (NCCL) or worker clock (gloo) a waiter is ordered after."""

    def __init__(self, backend: "Backend", value: Any, after: Any, error: BaseException | None = None) -> None:
        super().__init__()
        self._backend = backend
        self._value = value
        self._after = after
        self._error = error

    def done(self) -> bool:
        return True

    def value(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self) -> Any:
        self._backend.join(self._after, self._value)
        return self.value()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        stream = self._backend.callback_stream(self._after, self._value)
        with self._backend.sim.use(stream):
            try:
                result = callback(self)
            except Exception as error:  # the child future carries the callback's error, as torch's does
                return SimFuture(self._backend, None, self._backend.end_of(stream), error)
            return SimFuture(self._backend, result, self._backend.end_of(stream))

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        stream = self._backend.callback_stream(self._after, self._value)
        with self._backend.sim.use(stream):
            callback(self)


class SimWork:
    """A collective's ``Work`` under the model."""

    def __init__(self, backend: "Backend", tensors: list[torch.Tensor], after: Any) -> None:
        self._backend = backend
        self._tensors = tensors  # NCCL keeps its tensors until the work is done
        self._after = after

    def wait(self, timeout: Any = None) -> bool:
        self._backend.join(self._after, None)
        return True

    def result(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def get_future(self) -> Future:
        return SimFuture(self._backend, list(self._tensors), self._after)


class Backend:
    """One backend's model; ``collective`` stands in for ``dist.all_reduce`` and ``dist.broadcast``."""

    name = ""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def collective(self, tensor: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        raise NotImplementedError

    def join(self, after: Any, value: Any) -> None:
        raise NotImplementedError
    def callback_stream(self, after: Any, value: Any) -> SimStream:
        raise NotImplementedError

    def end_of(self, stream: SimStream) -> Any:
        raise NotImplementedError


class Nccl(Backend):
    name = "nccl"

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        self.stream = sim.stream("nccl")

    def collective(self, tensor: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        if tensor.layout != torch.strided:
            raise RuntimeError(f"ProcessGroupNCCL (model) does not support {tensor.layout} tensors in {what}.")
        self.sim.wait_stream(self.stream, self.sim.current)
        self.sim.access(tensor, False, f"nccl {what}", self.stream)
        self.sim.access(tensor, True, f"nccl {what}", self.stream)
        self.sim.keep_alive(tensor, self.stream)
        work = SimWork(self, [tensor], self.end_of(self.stream))
        if async_op:
            return work
        work.wait()
        return None

    def end_of(self, stream: SimStream) -> SimEvent:
        event = SimEvent(self.sim)
        event.record(stream)
        return event

    def join(self, after: SimEvent, value: Any) -> None:
        current = self.sim.current
        self.sim.wait_event(current, after)
        for tensor in _tensors(value):
            self.sim.keep_alive(tensor, current)

    def callback_stream(self, after: SimEvent, value: Any) -> SimStream:
        pool = self.sim.new_stream("pool")
        self.sim.wait_event(pool, after)
        for tensor in _tensors(value):
            self.sim.keep_alive(tensor, pool)
        return pool


class Gloo(Backend):
    name = "gloo"

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        sim.frees_on_current = True

    def collective(self, tensor: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        worker = self.sim.new_stream("gloo worker ")
        self.sim.wait_stream(worker, self.sim.current)
        self.sim.access(tensor, False, f"gloo {what}", worker)
        self.sim.access(tensor, True, f"gloo {what}", worker)  # sparse: replaces its indices and values
        self.sim.keep_alive(tensor, worker)  # the work holds its tensors until it ran
        work = SimWork(self, [tensor], worker)
        if async_op:
            return work
        work.wait()
        return None

    def end_of(self, stream: SimStream) -> dict[str, int]:
        self.sim.merge_host(stream)
        return dict(stream.clock)

    def join(self, after: Any, value: Any) -> None:
        clock = after if isinstance(after, dict) else self.end_of(after)
        self.sim.host_sees(clock)
    def callback_stream(self, after: Any, value: Any) -> SimStream:
        if isinstance(after, SimStream):
            return after  # the worker that ran the collective runs its callbacks
        worker = self.sim.new_stream("gloo worker ")  # a later callback, after the chain so far
        worker.clock.update(after)
        return worker


class _Engine:
    """The autograd engine's callback queue, with end-of-backward callbacks on the caller's stream."""

    def __init__(self, real: Any, autograd: "AutogradModel") -> None:
        self._real = real
        self._autograd = autograd

    def queue_callback(self, callback: Callable[[], None]) -> None:
        sim = self._autograd.sim
        frame = self._autograd.frames[-1] if self._autograd.frames else _Frame(sim.current, sim.current)

        def run() -> None:
            for stream in [frame.stream, *frame.leaves]:
                if stream is not frame.caller:
                    sim.wait_stream(frame.caller, stream)  # the engine's leaf-stream sync
            with sim.use(frame.caller):
                callback()

        self._real.queue_callback(run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Frame:
    """One running backward: the caller's stream, the root's, and the other streams gradients were
    accumulated on."""

    def __init__(self, caller: SimStream, stream: SimStream) -> None:
        self.caller = caller
        self.stream = stream
        self.leaves: list[SimStream] = []


class AutogradModel:
    """``torch.autograd.backward`` on the root's stream, after it waited on the caller's.

    Every node runs on the root's stream, except a branch of forward that ran on another stream
    (:meth:`branch_on`): its nodes, its parameters' accumulation and their post-accumulate-grad
    hooks run on that stream, after it waited for the gradient.
    """

    def __init__(self, sim: Sim, real: Callable) -> None:
        self.sim = sim
        self.real = real
        self.frames: list[_Frame] = []
        self._leaving: dict[int, Callable[[], None]] = {}  # per branch parameter: its hook, this forward

    def backward(self, tensors: Any, *args: Any, **kwargs: Any) -> None:
        caller = self.sim.current
        roots = _tensors(tensors)
        record = self.sim.records.get(self.sim.parts(roots[0])[0][0]) if roots and self.sim.parts(roots[0]) else None
        stream = self.sim.stream(record.last_write.stream) if record and record.last_write else caller
        if stream is not caller:
            self.sim.wait_stream(stream, caller)
        self.frames.append(_Frame(caller, stream))
        try:
            with self.sim.use(stream):
                self.real(tensors, *args, **kwargs)
        finally:
            self.frames.pop()

    def branch_on(self, output: torch.Tensor, params: list[torch.Tensor], stream: SimStream) -> None:
        """Backward of the branch of forward that made ``output`` from ``params`` runs on ``stream``
        (where forward ran it), after that stream waited for ``output``'s gradient; so do the
        parameters' accumulation and post-accumulate-grad hooks. Call for each forward."""
        left = [len(params)]

        def enter(grad: torch.Tensor) -> None:
            self.sim.wait_stream(stream, self.sim.current)  # the engine: a consumer waits for its input
            self.sim.keep_alive(grad, stream)  # and records it for the consumer's stream
            self.frames[-1].leaves.append(stream)
            self.sim._stack.append(stream)

        def leave() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.sim._stack.pop()

        output.register_hook(enter)
        for param in params:
            if id(param) not in self._leaving:  # one hook per parameter, calling this forward's ``leave``
                param.register_post_accumulate_grad_hook(lambda p: self._leaving[id(p)]())
            self._leaving[id(param)] = leave


_REAL_IS_AVAILABLE = torch.cuda.is_available


def _available_to_comm_hooks() -> bool:
    """torch's comm hooks see CUDA (PowerSGD then syncs the device in its last callback, as on a GPU)."""
    caller = sys._getframe(1).f_code.co_filename
    return "ddp_comm_hooks" in caller or _REAL_IS_AVAILABLE()


@contextlib.contextmanager
def simulate(sim: Sim, backend: str = "nccl") -> Iterator[Backend]:
    """Route collectives, streams, events, backward and its callbacks through the model while the
    block runs, and record every access."""
    model: Backend = Nccl(sim) if backend == "nccl" else Gloo(sim)
    autograd = sim.autograd = AutogradModel(sim, torch.autograd.backward)

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
        return model.collective(tensor, "all_reduce", async_op)

    def broadcast(tensor: torch.Tensor, src: Any = None, group: Any = None, async_op: bool = False, **_: Any):
        return model.collective(tensor, "broadcast", async_op)

    def cuda_stream(device: Any = None, priority: int = 0, **_: Any) -> SimStream:
        return sim.new_stream("high priority " if priority < 0 else "user ")

    patches = [
        (dist, "get_backend", lambda group=None: model.name),
        (dist, "all_reduce", all_reduce),
        (dist, "broadcast", broadcast),
        (torch.cuda, "Stream", cuda_stream),
        (torch.cuda, "Event", lambda *a, **k: SimEvent(sim, *a, **k)),
        (torch.cuda, "current_stream", lambda device=None: sim.current),
        (torch.cuda, "default_stream", lambda device=None: sim.default),
        (torch.cuda, "stream", lambda stream: sim.use(stream)),
        (torch.cuda, "synchronize", lambda device=None: sim.synchronize()),
        (torch.cuda, "is_available", _available_to_comm_hooks),
        (torch.autograd, "backward", autograd.backward),
        (torch_compat, "_ENGINE", _Engine(torch_compat._ENGINE, autograd)),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        with Accesses(sim):
            yield model
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)
