"""What NCCL, gloo's worker threads and the autograd engine do with streams, as the detector sees it.

Each rule names the torch source it models, torch 2.11 to 2.14 (where they differ, the laxest
behaviour is modelled, so that the detector finds more). Line numbers are of the headers torch
2.14.1 installs (``torch/include/...``, read for this model); the ``.cpp`` files are not installed,
so for them the file and function in pytorch/pytorch's tree are named, from reading them at those
versions, without lines. Each rule has a litmus test on hardware in ``tests/gpu/test_stream_model.py``.

NCCL (``torch/csrc/distributed/c10d/ProcessGroupNCCL.{hpp,cpp}``, ``ATen/core/ivalue_inl.h``):

- N1 an async collective runs on the group's NCCL stream after that stream waited on the launching
  (current) stream (``ProcessGroupNCCL::collective``, ``syncStream``), and the work stashes its
  tensors instead of ``recordStream`` (``ProcessGroupNCCL.hpp`` 183-192, ``TensorShelf`` 252-268,
  ``stashed_for_allocator_safety_`` 495-502) until it is waited, or until the watchdog has seen it
  complete (``shelvesToUnstash_``, 1441-1451);
- N2 ``Work.wait()`` makes the current stream wait on the end event and releases the stash
  (``WorkNCCL::wait``/``synchronize``/``synchronizeStream``, hpp 358-371; "we'll clear this list in
  synchronizeStream, just after user-facing stream(s) are synced", 495): from then on the tensors'
  memory is guarded by their allocation stream and ``record_stream`` only;
- N3 a synchronous collective (``async_op=False``, passed down as ``opts.asyncOp``:
  ``torch/distributed/distributed_c10d.py`` 3893 in ``all_reduce``, 3772 in ``broadcast``; ``c10d/Types.hpp`` 133;
  ``collective(..., bool asyncOp)``, hpp 1155-1164) runs on the current stream itself, with no event
  to wait on and no stash (``ProcessGroupNCCL::collective`` in the .cpp picks the current stream when
  ``!asyncOp``, read at 2.14; the litmus test checks it on the torch it runs on);
- N4 the future is complete at enqueue, with events recorded on the NCCL stream for its value's
  devices (``ivalue_inl.h`` 955-970, ``Future::markCompleted``); its ``wait()`` makes the current
  stream wait on those events and records the value's device storages for that stream (899-903,
  ``synchronizeWithCurrentStreams`` 1207-1222, ``recordDataPtrOnStream``); ``value()`` orders nothing;
- N5 ``then`` and ``add_done_callback`` run the callback at once (the parent is complete) on a pool
  stream that first waits on the parent's events and records the parent value's storages for it
  (``invokeCallback``, 1181-1201: ``getStreamFromGlobalPool``, ``MultiStreamGuard``,
  ``synchronizeWithCurrentStreams``); the child future records events only on the devices its
  value's storages are on (``markCompleted`` 940-970 with ``getDevicesOfStorages`` 1262-1275, which
  skips CPU storages), so a value that holds no CUDA storage (None, a number, host memory) records
  none and its ``wait()`` orders nothing;
- N6 a sparse tensor is refused (``ProcessGroupNCCL::allreduce``, .cpp).

The flat reduce-scatter and all-gather (``reduce_scatter_tensor``, ``all_gather_into_tensor`` and
their ``*_single`` names; ``ProcessGroupNCCL::_reduce_scatter_base``, ``_allgather_base``) go through
the same ``collective`` with an input and an output: N1 to N4 hold for them, the stash keeping both.

Gloo (CPU, ``ProcessGroupGloo.cpp``): an async collective reads and writes its tensors on a worker
thread, modelled as one more stream that starts after the host and that the host joins when it waits
on the work or its future; callbacks run on that worker after the collective. A sparse all-reduce
replaces its input's indices and values there. Its reduce-scatter's work has no future
(``get_future()`` raises "Work::getFuture not implemented").

CUDA-aware futures (``torch.futures.Future(devices=[...])``, ``ivalue_inl.h``, as N4 and N5's child):

- F1 ``set_result`` records an event on the setting thread's current stream for each device the value's
  storages are on (``markCompleted`` 940-970); ``wait()`` blocks the host until it is set, then makes
  the waiter's current stream wait on those events and records the value's storages for it (899-903).
  A future made without devices records and orders nothing on any stream.

torchft 0.2.0 on CUDA (``torchft/manager.py``, ``Manager.allreduce`` and ``_ManagedWork``):

- T1 the work keeps the stream current when it was made (``_ManagedWork.__init__``:
  ``torch.accelerator.current_stream()``); its ``wait()`` asserts that the caller's current stream is
  that one (``_assert_same_stream``, before anything else), then, on that stream
  (``get_stream_context``), waits on the process group's work and runs the manager's division by the
  participants (``allreduce``'s callback, on the callback chain ``wait()`` builds).

The autograd engine (``torch/csrc/autograd/``):

- A1 a node runs on its stream, the stream of its first input's metadata (``node.h`` 250-269,
  ``Node::stream``), captured when the node was made in forward (``input_metadata.h`` 62-64, 122);
  backward of the root starts after the root's stream waited on the caller's (``engine.cpp``,
  ``Engine::execute``: the root's ``InputBuffer::add``);
- A2 so an ``AccumulateGrad`` runs on the stream current when it was created (``accumulate_grad.h``
  44-45, its constructor adds the variable's input metadata): for most parameters the stream of the
  first forward op that used them, but a node kept alive (the reducer holds them with
  ``find_unused_parameters``) keeps the stream of its creation;
- A3 every node whose input gradient was produced on another stream first waits for it
  (``input_buffer.h`` 51-59, ``InputBuffer::add`` with the producer and consumer streams, for every
  node);
- A4 end-of-backward callbacks run on the caller's stream after it waited on the leaf streams only
  (``graph_task.h`` 128-132: ``leaf_streams``, "synced with leaf_streams in exec_post_processing";
  the leaf streams are those of nodes with no next edges: the accumulations), not on every stream
  backward used.

Every node runs on the root's stream, except a branch of forward declared to run on another stream
(:meth:`AutogradModel.branch_on`) and the accumulations of held nodes (A2).

Collectives are modelled for a one-rank group (the result is the input); the group itself is the
test process's real one-rank gloo group, used for ranks and sizes and host-level object gathers.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.utils._python_dispatch import _disable_current_modes

from overlapddp import device_streams, torch_compat
from tests.support.streams.sim import (
    DEVICE,
    HOST,
    Accesses,
    HostReads,
    Sim,
    SimEvent,
    SimStream,
    _tensors,
    package_site,
)


class SimFuture(Future):
    """A collective's (or callback's) future under the model: complete, with the ordering of its
    backend. ``after`` is the event (NCCL; None when the value holds no device memory, N5) or worker
    clock (gloo) a waiter is ordered after."""

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
        if not self._backend.sim.mutated("wait"):
            self._backend.join(self._after, self._value)
        return self.value()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        stream = self._backend.callback_stream(self._after, self._value)
        with self._backend.sim.use(stream):
            try:
                result = callback(self)
            except Exception as error:  # the child future carries the callback's error, as torch's does
                return SimFuture(self._backend, None, self._backend.child_events(stream, None), error)
            return SimFuture(self._backend, result, self._backend.child_events(stream, result))

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        stream = self._backend.callback_stream(self._after, self._value)
        with self._backend.sim.use(stream):
            callback(self)


class SimWork:
    """A collective's ``Work`` under the model: ``tensors``, its result (the output); ``inputs``, what
    else it read; ``stash``: the stream NCCL keeps them all for until the work is waited (N1, N2);
    ``has_future``: False for gloo's reduce-scatter, whose ``get_future()`` raises."""

    def __init__(self, backend: "Backend", tensors: list[torch.Tensor], after: Any,
                 stash: SimStream | None = None, inputs: tuple[torch.Tensor, ...] = (),
                 has_future: bool = True) -> None:
        self._backend = backend
        self._tensors = tensors
        self._inputs = inputs
        self._after = after
        self._stash = stash
        self._has_future = has_future

    def wait(self, timeout: Any = None) -> bool:
        if self._backend.sim.mutated("wait"):
            return True
        self._backend.join(self._after, None)
        if self._stash is not None:
            for tensor in [*self._tensors, *self._inputs]:
                self._backend.sim.release(tensor, self._stash)
            self._stash = None
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def get_future(self) -> Future:
        if not self._has_future:
            raise RuntimeError("Work::getFuture not implemented.")  # gloo's reduce-scatter, as torch says it
        return SimFuture(self._backend, list(self._tensors), self._after)


class DeviceFuture(Future):
    """``torch.futures.Future(devices=...)`` under the model (F1), set by the host on any thread."""

    def __init__(self, backend: "Backend") -> None:
        super().__init__()
        self._backend = backend
        self._after: Any = None  # the events ``set_result`` recorded (None: the value holds no device memory)

    def set_result(self, result: Any) -> None:
        self._after = self._backend.child_events(self._backend.sim.current, result)
        super().set_result(result)

    def wait(self) -> Any:
        value = super().wait()  # the host blocks until the future is set, as torch's does
        if not self._backend.sim.mutated("wait"):
            self._backend.join(self._after, value)
        return value


class TorchftWork:
    """torchft's ``_ManagedWork`` on CUDA (T1), around the model's work on ``tensor``, for a manager
    of one participant."""

    def __init__(self, sim: Sim, work: SimWork, tensor: torch.Tensor) -> None:
        self._sim = sim
        self._work = work
        self._tensor = tensor
        self._stream = sim.current  # the stream the work was made on

    def wait(self, timeout: Any = None) -> bool:
        if self._sim.mutated("wait"):
            return True
        if self._sim.current is not self._stream:  # torchft's ``assert self._stream == current_stream()``
            raise AssertionError(f"torchft's _ManagedWork.wait() (model) was called on stream {self._sim.current}, "
                                 f"and its work was made on {self._stream}")
        with self._sim.use(self._stream):
            self._work.wait()
            self._tensor /= 1  # the manager's division by its one participant
        return True


class Backend:
    """One backend's model; ``collective`` stands in for ``dist.all_reduce`` and ``dist.broadcast``."""

    name = ""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def collective(self, tensor: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        raise NotImplementedError

    def flat_collective(self, output: torch.Tensor, input: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        """``reduce_scatter_tensor`` or ``all_gather_into_tensor``: reads ``input``, writes ``output``."""
        raise NotImplementedError

    @staticmethod
    def one_rank_result(output: torch.Tensor, input: torch.Tensor) -> None:
        """A one-rank group's result: the output is the input (the detector's own copy is no access)."""
        with _disable_current_modes(), torch.no_grad():
            output.copy_(input)

    def peer(self, tensor: torch.Tensor, what: str) -> None:
        """A fake second rank's contribution to the result, if the scenario has one (``Sim.peer``)."""
        if self.sim.peer is not None:
            with _disable_current_modes():
                self.sim.peer(tensor, what)

    def join(self, after: Any, value: Any) -> None:
        raise NotImplementedError

    def callback_stream(self, after: Any, value: Any) -> SimStream:
        raise NotImplementedError

    def end_of(self, stream: SimStream) -> Any:
        raise NotImplementedError

    def child_events(self, stream: SimStream, value: Any) -> Any:
        """What a waiter on a callback's future (resolved to ``value`` on ``stream``) is ordered after."""
        return self.end_of(stream)


class Nccl(Backend):
    name = "nccl"

    def __init__(self, sim: Sim) -> None:
        super().__init__(sim)
        self.stream = sim.stream("nccl")

    def collective(self, tensor: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        if tensor.layout != torch.strided:  # N6
            raise RuntimeError(f"ProcessGroupNCCL (model) does not support {tensor.layout} tensors in {what}.")
        if not async_op:  # N3: on the current stream, nothing kept
            self.sim.access(tensor, False, f"nccl {what} (synchronous)")
            self.sim.access(tensor, True, f"nccl {what} (synchronous)")
            self.peer(tensor, what)
            return None
        self.sim.wait_stream(self.stream, self.sim.current)  # N1
        self.stream.op_start = self.stream.clock.get(self.stream.name, 0)
        self.sim.access(tensor, False, f"nccl {what}", self.stream)
        self.sim.access(tensor, True, f"nccl {what}", self.stream)
        self.peer(tensor, what)
        self.sim.keep_alive(tensor, self.stream)  # N1: the stash
        return SimWork(self, [tensor], self.end_of(self.stream), stash=self.stream)

    def flat_collective(self, output: torch.Tensor, input: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        """N1 to N4 for a collective with its own output (``ProcessGroupNCCL::_reduce_scatter_base`` and
        ``_allgather_base`` go through the same ``collective`` as ``allreduce``): both tensors stashed."""
        stream = self.stream if async_op else self.sim.current  # N3: synchronous on the current stream
        if async_op:
            self.sim.wait_stream(self.stream, self.sim.current)  # N1
            self.stream.op_start = self.stream.clock.get(self.stream.name, 0)
        label = f"nccl {what}" + ("" if async_op else " (synchronous)")
        self.sim.access(input, False, label, stream)
        self.one_rank_result(output, input)
        self.sim.access(output, True, label, stream)
        self.peer(output, what)
        if not async_op:
            return None
        for tensor in (output, input):
            self.sim.keep_alive(tensor, self.stream)  # N1: the stash
        return SimWork(self, [output], self.end_of(self.stream), stash=self.stream, inputs=(input,))

    def end_of(self, stream: SimStream) -> SimEvent:
        event = SimEvent(self.sim)
        self.sim.merge_host(stream)
        event.clock = dict(stream.clock)
        return event

    def child_events(self, stream: SimStream, value: Any) -> SimEvent | None:
        """N5: events only for the devices the value's storages are on."""
        if any(self.sim.place(t) == DEVICE for t in _tensors(value)):
            return self.end_of(stream)
        return None

    def join(self, after: SimEvent | None, value: Any) -> None:
        current = self.sim.current
        if after is not None:
            self.sim.wait_event(current, after)  # N2, N4
        for tensor in _tensors(value):
            self.sim.keep_alive(tensor, current)  # N4: recordDataPtrOnStream

    def callback_stream(self, after: SimEvent | None, value: Any) -> SimStream:
        pool = self.sim.new_stream("pool")  # N5
        if after is not None:
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

    def flat_collective(self, output: torch.Tensor, input: torch.Tensor, what: str, async_op: bool) -> SimWork | None:
        """On a worker thread, like ``collective``; the reduce-scatter's work has no future."""
        worker = self.sim.new_stream("gloo worker ")
        self.sim.wait_stream(worker, self.sim.current)
        self.sim.access(input, False, f"gloo {what}", worker)
        self.one_rank_result(output, input)
        self.sim.access(output, True, f"gloo {what}", worker)
        for tensor in (output, input):
            self.sim.keep_alive(tensor, worker)
        work = SimWork(self, [output], worker, inputs=(input,), has_future=what != "reduce_scatter")
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
    """The autograd engine's callback queue: end-of-backward callbacks on the caller's stream, after
    it waited on the leaf streams (A4)."""

    def __init__(self, real: Any, autograd: "AutogradModel") -> None:
        self._real = real
        self._autograd = autograd

    def queue_callback(self, callback: Callable[[], None]) -> None:
        sim = self._autograd.sim
        frame = self._autograd.frames[-1] if self._autograd.frames else _Frame(sim.current, sim.current)

        def run() -> None:
            for stream in frame.leaves:
                if stream is not frame.caller:
                    sim.wait_stream(frame.caller, stream)  # A4: the leaf streams only
            with sim.use(frame.caller):
                callback()

        self._real.queue_callback(run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Frame:
    """One running backward: the caller's stream, the root's, and the leaf streams (those that ran an
    accumulation)."""

    def __init__(self, caller: SimStream, stream: SimStream) -> None:
        self.caller = caller
        self.stream = stream
        self.leaves: list[SimStream] = []


class AutogradModel:
    """``torch.autograd.backward`` on the root's stream, after it waited on the caller's (A1).

    Every node runs on the root's stream, except a branch of forward that ran on another stream
    (:meth:`branch_on`): its nodes, its parameters' accumulation and their post-accumulate-grad
    hooks run on that stream, after it waited for the gradient (A3); and an accumulation whose node
    was kept from an earlier stream (:meth:`hold`, A2). Each accumulation notes its stream as a
    leaf stream (A4), seen through the post-accumulate-grad hooks (every parameter the wrapper
    reduces has one).
    """

    def __init__(self, sim: Sim, real: Callable) -> None:
        self.sim = sim
        self.real = real
        self.frames: list[_Frame] = []
        self._leaving: dict[int, Callable[[], None]] = {}  # per branch parameter: its hook, this forward
        self._held: dict[int, tuple[torch.Tensor, SimStream]] = {}  # A2: parameter -> its node's stream
        self._pending: list[int] = []  # held parameters whose hooks are registered at the next backward

    def backward(self, tensors: Any, *args: Any, **kwargs: Any) -> None:
        self._register_held()
        caller = self.sim.current
        roots = _tensors(tensors)
        record = self.sim.records.get(self.sim.parts(roots[0])[0][0]) if roots and self.sim.parts(roots[0]) else None
        stream = self.sim.stream(record.last_write.stream) if record and record.last_write else caller
        if stream is self.sim.host_stream:
            stream = caller
        if stream is not caller:
            self.sim.wait_stream(stream, caller)
        self.frames.append(_Frame(caller, stream))
        try:
            with self.sim.use(stream):
                self.real(tensors, *args, **kwargs)
        finally:
            self.frames.pop()

    def accumulated(self) -> None:
        """A post-accumulate-grad hook runs: its stream is a leaf stream of this backward (A4)."""
        if self.frames and self.sim.current not in self.frames[-1].leaves:
            self.frames[-1].leaves.append(self.sim.current)

    def branch_on(self, output: torch.Tensor, params: list[torch.Tensor], stream: SimStream) -> None:
        """Backward of the branch of forward that made ``output`` from ``params`` runs on ``stream``
        (where forward ran it), after that stream waited for ``output``'s gradient; so do the
        parameters' accumulation and post-accumulate-grad hooks. Call for each forward."""
        left = [len(params)]

        def enter(grad: torch.Tensor) -> None:
            self.sim.wait_stream(stream, self.sim.current)  # A3: a consumer waits for its input
            self.sim.keep_alive(grad, stream)  # and records it for the consumer's stream
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

    def hold(self, params: list[torch.Tensor]) -> None:
        """The parameters' ``AccumulateGrad`` nodes are made now and kept (A2): they run on the current
        stream from now on, whatever stream forward uses."""
        for param in params:
            if id(param) not in self._held:
                self._held[id(param)] = (param, self.sim.current)
                self._pending.append(id(param))

    def _register_held(self) -> None:
        """Hooks after the wrapper's own (registered by then), so that the wrapper's hook runs on the
        held stream: the pre-hook enters it (A3), the last post-accumulate-grad hook leaves it."""
        for key in self._pending:
            param, stream = self._held[key]

            def enter(grad: torch.Tensor, stream: SimStream = stream) -> None:
                self.sim.wait_stream(stream, self.sim.current)  # A3
                self.sim.keep_alive(grad, stream)
                self.sim._stack.append(stream)

            param.register_hook(enter)
            param.register_post_accumulate_grad_hook(lambda p: self.sim._stack.pop())
        self._pending.clear()


_REAL_IS_AVAILABLE = torch.cuda.is_available


def _available_to_comm_hooks() -> bool:
    """torch's comm hooks see CUDA (PowerSGD then syncs the device in its last callback, as on a GPU)."""
    caller = sys._getframe(1).f_code.co_filename
    return "ddp_comm_hooks" in caller or _REAL_IS_AVAILABLE()


_STREAM_NAMES = {"fence": "comm", "token_weighting": "tokens"}


@contextlib.contextmanager
def simulate(sim: Sim, backend: str = "nccl") -> Iterator[Backend]:  # noqa: C901 - one patch per modelled API, in one place
    """Route collectives, streams, events, backward and its callbacks through the model while the
    block runs, and record every access, on every thread started meanwhile. The package's real ``CudaKit`` runs on the fake
    ``torch.cuda`` and makes its futures as :class:`DeviceFuture`; ``Tensor.is_cuda`` is true, for the package, of device memory (under the NCCL model; gloo's path
    is the CPU one)."""
    model: Backend = Nccl(sim) if backend == "nccl" else Gloo(sim)
    autograd = sim.autograd = AutogradModel(sim, torch.autograd.backward)

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
        return model.collective(tensor, "all_reduce", async_op)

    def broadcast(tensor: torch.Tensor, src: Any = None, group: Any = None, async_op: bool = False, **_: Any):
        return model.collective(tensor, "broadcast", async_op)

    def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                       async_op: bool = False):
        return model.flat_collective(output, input, "reduce_scatter", async_op)

    def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False):
        return model.flat_collective(output, input, "all_gather", async_op)

    def cuda_stream(device: Any = None, priority: int = 0, **_: Any) -> SimStream:
        site = package_site(1)
        if site is not None:
            module = site[0].rsplit("/", 1)[-1].removesuffix(".py")
            return sim.new_stream(_STREAM_NAMES.get(module, module))
        return sim.new_stream("high priority " if priority < 0 else "user ")

    real_is_cuda = torch._C.TensorBase.is_cuda

    def is_cuda(tensor: torch.Tensor) -> bool:
        if backend == "nccl" and package_site(1) is not None:
            return sim.place(tensor) == DEVICE
        return real_is_cuda.__get__(tensor)

    def on_host(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def made(*args: Any, **kwargs: Any) -> torch.Tensor:
            tensor = make(*args, **kwargs)
            sim.tag(tensor, HOST, make.__name__)
            return tensor

        return made

    def record_stream(tensor: torch.Tensor, stream: SimStream) -> None:
        sim.record_stream(tensor, stream)

    def synchronize(device: Any = None) -> None:
        sim.synchronize()

    def hook_noting_leaves(tensor: torch.Tensor, hook: Callable) -> Any:
        def noted(param: torch.Tensor) -> None:
            autograd.accumulated()
            hook(param)

        return real_post_hook(tensor, noted)

    real_post_hook = torch.Tensor.register_post_accumulate_grad_hook
    real_accumulators = _reducer_module().grad_accumulators

    def held_accumulators(params: Any) -> list[Any]:
        autograd.hold(list(params))
        return real_accumulators(params)

    real_start = threading.Thread.start

    def start_observed(thread: threading.Thread) -> None:
        """A thread started while the model runs has its ops recorded too (a dispatch mode is per thread),
        on its own current streams (the sim's are per thread, as CUDA's)."""
        run = thread.run

        def observed() -> None:
            with Accesses(sim):
                run()

        thread.run = observed  # type: ignore[method-assign]
        real_start(thread)

    patches = [
        (threading.Thread, "start", start_observed),
        (dist, "get_backend", lambda group=None: model.name),
        (dist, "all_reduce", all_reduce),
        (dist, "broadcast", broadcast),
        *[(where, name, reduce_scatter) for where, name in _flat_names("reduce_scatter")],
        *[(where, name, all_gather) for where, name in _flat_names("all_gather")],
        (torch.cuda, "Stream", cuda_stream),
        (torch.cuda, "Event", lambda *a, **k: SimEvent(sim, *a, **k)),
        (torch.cuda, "current_stream", lambda device=None: sim.current),
        (torch.cuda, "default_stream", lambda device=None: sim.default),
        (torch.cuda, "stream", lambda stream: sim.use(stream)),
        (torch.cuda, "synchronize", synchronize),
        (torch.cuda, "is_available", _available_to_comm_hooks),
        (torch.autograd, "backward", autograd.backward),
        (torch_compat, "_ENGINE", _Engine(torch_compat._ENGINE, autograd)),
        (torch.Tensor, "is_cuda", property(is_cuda)),
        (torch.Tensor, "record_stream", record_stream),
        (torch.Tensor, "register_post_accumulate_grad_hook", hook_noting_leaves),
        (device_streams, "Future", lambda devices: DeviceFuture(model)),  # the kit's futures (F1)
        (torch, "frombuffer", on_host(torch.frombuffer)),
        (torch, "from_numpy", on_host(torch.from_numpy)),
        (_reducer_module(), "grad_accumulators", held_accumulators),
        *HostReads(sim).patches(),
    ]
    missing = object()
    saved = [(obj, attr, obj.__dict__.get(attr, missing)) for obj, attr, _ in patches]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        with Accesses(sim):
            yield model
    finally:
        for obj, attr, old in saved:
            if old is missing:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


def _reducer_module() -> Any:
    from overlapddp import reducer

    return reducer


def _flat_names(kind: str) -> list[tuple[Any, str]]:
    """Every name the flat ``kind`` collective is reached by: torch's (old and new) and torch_compat's."""
    old = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}[kind]
    names = [(dist, old), (torch_compat, f"{kind}_flat")]
    return names + ([(dist, f"{kind}_single")] if hasattr(dist, f"{kind}_single") else [])
