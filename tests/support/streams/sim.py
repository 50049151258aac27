"""Fake CUDA streams and events with vector clocks, host memory, and the modes that check every access.

Each stream has a vector clock: its own counter ticks at every access, an event copies the clock of
the stream it is recorded on, and a wait merges the event's (or the other stream's) clock into the
waiting stream's. An access by stream ``s`` happens after an access ``(t, n)`` (the ``n``-th access
of stream ``t``) when ``t`` is ``s`` or ``s``'s clock holds ``t`` at ``n`` or more.

The host is a stream too (``host``): its clock is what the host has seen finish (an event's or a
stream's ``synchronize``, ``torch.cuda.synchronize()``, a blocking copy to the host, a gloo work
waited on), and every device stream merges it before each access, since work enqueued after the
host saw something finish (or did something) runs after it. The clocks themselves are the race
detector's (``overlapddp/sanitize/clocks.py``): one model of completion for both.

Memory is tagged where it lives: ``device`` (every tensor by default: the scenarios' CPU tensors
stand in for CUDA ones), ``pinned`` (``pin_memory=True``, ``.pin_memory()``) or ``host`` (pageable:
``torch.frombuffer``, ``torch.from_numpy``, the results of host ops). An op whose tensors are all in
host memory runs on the host stream. A copy between device and host memory runs on the current
stream; unless it is non-blocking with pinned memory on the host side the host then waits for that
stream (a blocking copy), except a non-blocking one from pageable memory, whose source the host
reads at once. Host reads (``.item()``, ``float``/``int``/``bool``, ``.tolist()``, ``.numpy()``,
``__array__``, ``data_ptr()`` of host memory) of host memory are ordered by the host clock only: a
stream wait never orders the host. Of device memory they read on the current stream, then the host
waits for it (``.numpy()`` and ``__array__`` of device memory raise on CUDA, a finding here).

Rules checked (each broken rule is a finding, with both accesses named):

- a read happens after the last write of its storage on every other stream (the host included);
- a write happens after the last write and every read since, on every other stream;
- a storage freed on the host was used only by its allocation stream, by streams it was recorded
  for (``record_stream``; for pinned memory, every stream a non-blocking copy used it on, as torch's
  host allocator records an event there), or by accesses its allocation stream is already ordered
  after (the caching allocator hands a freed block to the next allocation on the allocation stream;
  host memory is allocated by the host).

Storages are keyed by identity (the ``StorageImpl``), so views of a flat bucket buffer alias it and
CPU tensors count; a sparse tensor is its indices and values, plus its own object (gloo's sparse
all-reduce replaces both inside it).

A :class:`Mutant` changes one call site of the package while a scenario runs (a wait left out, an
event recorded one access earlier, a host read that does not wait): the sites are found in the
package's source by ``tools/stream_mutations.py``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from overlapddp.sanitize.clocks import StreamClocks

HOST_SYNCS = {"aten._local_scalar_dense.default"}
DEVICE, PINNED, HOST = "device", "pinned", "host"
PACKAGE = "/overlapddp/"
KIT = "/overlapddp/device_streams.py"
MODEL = ("/tests/support/streams/sim.py", "/tests/support/streams/backends.py")


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run ``method`` holding its sim's lock: the threads the model observes share its clocks and records."""
    @functools.wraps(method)
    def locked(self: "Sim", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


@dataclass(frozen=True)
class Mutant:
    """One call site of the package changed while a scenario runs.

    ``kind``: ``wait`` (the wait is left out: a stream or event wait, a future's or work's ``wait()``,
    a ``synchronize``), ``record_stream`` (left out), ``record`` (an event record left out),
    ``record earlier`` (the event misses the last work queued on its stream), ``host sync`` (a host
    read of device memory that does not make the host wait). ``path``, ``first``..``last``: the call.
    """

    kind: str
    path: str
    first: int
    last: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.path}:{self.first} {self.text}"


def package_site(depth: int = 1, through_torch: bool = False) -> tuple[str, int] | None:
    """(path, line) of the first caller in the package, ``depth`` frames up, past the model's own frames
    and the CUDA kit (whose calls are made for its callers) and, with ``through_torch``, torch's Python
    code; None when another frame comes first (torch's own code, a test's)."""
    frame: Any = sys._getframe(depth + 1)
    while frame is not None:
        name = frame.f_code.co_filename
        if PACKAGE in name and not name.endswith(KIT):
            return "overlapddp/" + name.rsplit(PACKAGE, 1)[-1], frame.f_lineno
        if not (name.endswith(KIT) or name.endswith(MODEL) or (through_torch and "/torch/" in name)):
            return None
        frame = frame.f_back
    return None


class SimStream:
    """A fake ``torch.cuda.Stream``."""

    def __init__(self, sim: "Sim", name: str) -> None:
        self.sim = sim
        self.name = name
        self.stream_id = name
        self.device = torch.device("cpu")
        self.op_start = 0  # this stream's own tick before its last op began (an event recorded earlier)

    @property
    def clock(self) -> dict[str, int]:
        """This stream's clock in the sim's (and the race detector's) one model of completion."""
        return self.sim.clocks.of(self.name)

    def wait_event(self, event: "SimEvent") -> None:
        if not self.sim.mutated("wait"):
            self.sim.wait_event(self, event)

    def wait_stream(self, other: "SimStream") -> None:
        if not self.sim.mutated("wait"):
            self.sim.wait_stream(self, other)

    def synchronize(self) -> None:
        if not self.sim.mutated("wait"):
            self.sim.host_sees(self.clock)

    def __repr__(self) -> str:
        return self.name


class SimEvent:
    """A fake ``torch.cuda.Event``: the clock of the stream it was last recorded on."""

    def __init__(self, sim: "Sim", enable_timing: bool = False, **_: Any) -> None:
        self.sim = sim
        self.clock: dict[str, int] | None = None

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.sim.current
        if self.sim.mutated("record"):
            return
        self.sim.merge_host(stream)
        self.clock = dict(stream.clock)
        if self.sim.mutated("record earlier"):
            self.clock[stream.name] = stream.op_start  # as if recorded before the last op queued on the stream

    def wait(self, stream: SimStream | None = None) -> None:
        if not self.sim.mutated("wait"):
            self.sim.wait_event(stream or self.sim.current, self)

    def synchronize(self) -> None:
        if self.clock is not None and not self.sim.mutated("wait"):
            self.sim.host_sees(self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "SimEvent") -> float:
        """1 ms (the model has no timing); on CUDA both events must be recorded and complete, or it
        raises (``cudaEventElapsedTime``: not ready, or an invalid handle)."""
        for event in (self, other):
            if event.clock is None or any(self.sim.host.get(s, 0) < t for s, t in event.clock.items()):
                self.sim._find("elapsed_time of an event the host has not seen complete, which raises on CUDA")
        return 1.0


@dataclass
class Access:
    stream: str
    tick: int
    what: str


@dataclass
class StorageRecord:
    label: str
    alloc: str  # the stream the storage was allocated on (``host`` for host memory)
    place: str = DEVICE  # device, pinned or host memory
    last_write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)  # the latest read per stream since the last write
    used: dict[str, Access] = field(default_factory=dict)  # the latest access per stream, ever
    recorded: set[str] = field(default_factory=set)  # streams record_stream named


class Sim:
    """Streams, events, the host, every storage's accesses, and the findings so far.

    ``mutant``: the one call site changed in this run (the mutation matrix), or None.
    """

    def __init__(self, mutant: Mutant | None = None) -> None:
        self.mutant = mutant
        self.clocks = StreamClocks()  # every stream's vector clock, the host's included
        self.streams: dict[str, SimStream] = {}
        self.default = self.stream("default")
        self.host_stream = self.stream(HOST)
        self.host = self.host_stream.clock  # what the host has seen finish, and its own accesses
        self._threads = threading.local()  # each thread's stack of current streams (see ``_stack``)
        self.lock = threading.RLock()  # held by each clock and record update (``_locked``)
        self.records: dict[int, StorageRecord] = {}
        self.findings: list[str] = []
        self.context = ""  # what the scenario is doing, for messages
        self.sites: set[tuple[str, str, int]] = set()  # (kind, path, line) of each mutable call that ran
        self._labels = 0
        self.autograd: Any = None  # the engine's model, while simulating (backends.AutogradModel)
        self.frees_on_current = False  # CPU threads free memory themselves (set by the gloo model)
        # A fake second rank: called with each collective's tensor and name after the one-rank result,
        # to change it as the other rank's contribution would (a joined rank's peer still training).
        self.peer: Any = None
        self._names: dict[str, int] = {}

    # -- mutation sites ---------------------------------------------------------------------------

    def mutated(self, kind: str) -> bool:
        """Note the package call site that made the model's caller act as run; whether this run's mutant
        changes it."""
        site = package_site(1, through_torch=kind == "host sync")
        if site is None:
            return False
        self.sites.add((kind, *site))
        mutant = self.mutant
        return mutant is not None and mutant.kind == kind and mutant.path == site[0] and \
            mutant.first <= site[1] <= mutant.last

    # -- streams and clocks ---------------------------------------------------------------------

    def stream(self, name: str) -> SimStream:
        if name not in self.streams:
            self.streams[name] = SimStream(self, name)
        return self.streams[name]

    def new_stream(self, prefix: str) -> SimStream:
        self._names[prefix] = self._names.get(prefix, 0) + 1
        return self.stream(f"{prefix}{self._names[prefix]}")

    @property
    def _stack(self) -> list[SimStream]:
        """The calling thread's current streams, innermost last: as on CUDA, the current stream is per
        thread, and a thread starts on the default stream."""
        stack = getattr(self._threads, "stack", None)
        if stack is None:
            stack = self._threads.stack = [self.default]
        return stack

    @property
    def current(self) -> SimStream:
        return self._stack[-1]

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()

    @_locked
    def merge_host(self, stream: SimStream) -> None:
        self.clocks.merge_host(stream.name)

    @_locked
    def tick(self, stream: SimStream) -> int:
        return self.clocks.tick(stream.name)

    @_locked
    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        if event.clock is not None:
            self.clocks.wait(stream.name, event.clock)

    @_locked
    def wait_stream(self, stream: SimStream, other: SimStream) -> None:
        self.clocks.wait_stream(stream.name, other.name)

    @_locked
    def host_sees(self, clock: dict[str, int]) -> None:
        self.clocks.host_sees(clock)

    def synchronize(self) -> None:
        if self.mutated("wait"):
            return
        for stream in list(self.streams.values()):
            self.host_sees(stream.clock)

    def _after(self, stream: SimStream, access: Access) -> bool:
        return self.clocks.ordered_after(stream.name, access.stream, access.tick)

    # -- storages ---------------------------------------------------------------------------------

    def parts(self, tensor: torch.Tensor) -> list[tuple[int, Any, str]]:
        """(key, storage or tensor to watch, kind) of each piece of memory ``tensor`` is made of."""
        if tensor.layout == torch.sparse_coo:
            pieces = [(id(tensor), tensor, "sparse tensor")]
            with _disable_current_modes():  # the detector's own look is no access
                inner = ((tensor._indices(), "indices"), (tensor._values(), "values"))
            for part, kind in inner:
                storage = part.untyped_storage()
                pieces.append((storage._cdata, storage, kind))
            return pieces
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return []
        storage = tensor.untyped_storage()
        return [(storage._cdata, storage, "storage")]

    def place(self, tensor: torch.Tensor) -> str:
        """Where ``tensor``'s memory lives: device (the default), pinned or host."""
        parts = self.parts(tensor)
        record = self.records.get(parts[-1][0]) if parts else None
        return record.place if record is not None else DEVICE

    def _record(self, key: int, owner: Any, kind: str, what: str, stream: SimStream | None = None,
                place: str | None = None) -> StorageRecord:
        record = self.records.get(key)
        if record is None:
            self._labels += 1
            stream = stream or self.current
            where = "" if place in (None, DEVICE) else f"{place} memory "
            label = f"{where}{kind} #{self._labels} (from {what} on {stream.name})"
            record = self.records[key] = StorageRecord(label, stream.name, place or DEVICE)
            weakref.finalize(owner, self._freed, key, record)
        return record

    def tag(self, tensor: torch.Tensor, place: str, what: str) -> None:
        """``tensor`` is new host (or pinned) memory, made by ``what`` on the host."""
        for key, owner, kind in self.parts(tensor):
            record = self._record(key, owner, kind, what, self.host_stream, place)
            record.place, record.alloc = place, HOST

    @_locked
    def access(self, tensor: torch.Tensor, write: bool, what: str, stream: SimStream | None = None,
               allocates: bool = False, metadata: bool = False, place: str | None = None) -> None:
        """One access of ``tensor`` by ``what`` on ``stream``; ``metadata``: only a sparse tensor's own
        object is read (a view of its indices or values); ``place``: where new memory lives."""
        stream = stream or self.current
        for key, owner, kind in self.parts(tensor)[:1] if metadata else self.parts(tensor):
            record = self._record(key, owner, kind, what, stream, place)
            if allocates:
                record.alloc = stream.name
                if place is not None:
                    record.place = place
            tick = self.tick(stream)
            here = Access(stream.name, tick, what)
            if record.last_write is not None and not self._after(stream, record.last_write):
                self._find(f"{'write' if write else 'read'} by {what} on {stream.name} races the write by "
                           f"{record.last_write.what} on {record.last_write.stream} of {record.label}")
            if write:
                for read in record.reads.values():
                    if not self._after(stream, read):
                        self._find(f"write by {what} on {stream.name} races the read by {read.what} on "
                                   f"{read.stream} of {record.label}")
                record.last_write, record.reads = here, {}
            else:
                record.reads[stream.name] = here
            record.used[stream.name] = here

    def host_read(self, tensor: torch.Tensor, what: str) -> None:
        """The host reads ``tensor``'s values: host memory on the host clock; device memory through a
        blocking copy on the current stream, which the host then waits for."""
        if self.place(tensor) == DEVICE:
            self.access(tensor, False, what)
            if not self.mutated("host sync"):
                self.host_sees(self.current.clock)
        else:
            self.access(tensor, False, what, self.host_stream)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        if self.mutated("record_stream"):
            return
        for key, owner, kind in self.parts(tensor):
            self._record(key, owner, kind, "record_stream").recorded.add(stream.name)

    def keep_alive(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """What a backend does for its own stream (NCCL stashes its tensors until the work is done)."""
        for key, owner, kind in self.parts(tensor):
            self._record(key, owner, kind, "collective").recorded.add(stream.name)

    def release(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """A backend stops keeping ``tensor`` for ``stream`` (NCCL's stash, released at ``work.wait()``)."""
        for key, _, _ in self.parts(tensor):
            record = self.records.get(key)
            if record is not None:
                record.recorded.discard(stream.name)

    @_locked
    def _freed(self, key: int, record: StorageRecord) -> None:
        """CUDA: the block goes back to its allocation stream's pool, reused once every stream it was
        recorded for reaches where it is now. Host memory: the host's (pinned blocks wait for the copies'
        events too). CPU (``frees_on_current``): freed by the current thread, or by the last of the
        backend's workers that kept it."""
        if self.records.get(key) is record:
            del self.records[key]
        first = self.current if self.frees_on_current else self.stream(record.alloc)
        guards = [first] + [self.stream(name) for name in sorted(record.recorded)]
        for guard in guards:
            self.merge_host(guard)
        for use in record.used.values():
            if any(self._after(guard, use) for guard in guards):
                continue
            if self.frees_on_current:
                where, missing = f"by {self.current.name}", ""
            else:
                where = f"reusable on {record.alloc}"
                missing = f" (no record_stream for {use.stream} or a stream after it)"
            self._find(f"{record.label} was freed ({where}) while {use.what} on {use.stream} may still use it{missing}")

    def _find(self, message: str) -> None:
        text = f"{self.context}: {message}" if self.context else message
        if text not in self.findings:
            self.findings.append(text)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


PIN = {"aten._pin_memory.default", "aten.pin_memory.default"}


class Accesses(TorchDispatchMode):
    """Records each op's reads and writes, from its schema, on the stream it runs on.

    An argument marked written (``Tensor(a!)``) is written; one that only aliases (a view) is not
    accessed; any other tensor argument is read; a fresh output is written where it is allocated.
    An op on host memory only runs on the host; a copy between device and host memory is a device
    access of both (see the module docstring for when the host waits). ``.item()`` is a host read.
    Pinned memory is plain CPU memory here: ``pin_memory`` is a host copy tagged pinned.
    """

    def __init__(self, sim: Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # noqa: C901 - the dispatcher: one branch per op kind
        kwargs = dict(kwargs or {})
        sim = self.sim
        name = str(func)
        if name == "aten.is_pinned.default":
            return sim.place(args[0]) == PINNED
        if name in PIN:
            sim.access(args[0], False, name, sim.host_stream)
            out = args[0].clone()
            sim.access(out, True, name, sim.host_stream, allocates=True, place=PINNED)
            return out
        if name in HOST_SYNCS:
            sim.host_read(args[0], name)
            return func(*args, **kwargs)
        pinned_output = bool(kwargs.get("pin_memory"))
        if pinned_output:
            kwargs["pin_memory"] = False  # a CPU build without a driver cannot pin; the tag is the model
        schema = func._schema
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        non_blocking = False
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.name == "non_blocking":
                non_blocking = bool(value)
            tensors = _tensors(value)
            if not tensors:
                continue
            info = arg.alias_info
            if info is not None and info.is_write:
                writes += tensors
            elif info is None:
                reads += tensors
            else:
                views += [t for t in tensors if t.layout == torch.sparse_coo]
        places = {sim.place(t) for t in reads + writes + views}
        sim.current.op_start = sim.current.clock.get(sim.current.name, 0)
        stream, out_place, host_waits, source_on_host = sim.current, None, False, False
        if pinned_output:
            stream, out_place = sim.host_stream, PINNED
        elif places and DEVICE not in places:
            stream, out_place = sim.host_stream, HOST  # a CPU op: the host runs it, now
        elif DEVICE in places and len(places) > 1 and name == "aten.copy_.default":
            host_side = sim.place(writes[0]) if sim.place(writes[0]) != DEVICE else sim.place(reads[0])
            to_device = sim.place(writes[0]) == DEVICE
            if host_side == PINNED and non_blocking:
                for tensor in reads + writes:  # torch's host allocator records an event for the copy's stream
                    if sim.place(tensor) == PINNED:
                        for key, owner, kind in sim.parts(tensor):
                            sim._record(key, owner, kind, name).recorded.add(stream.name)
            elif to_device and non_blocking:
                source_on_host = True  # pageable memory is staged by the host when the copy is queued
            else:
                host_waits = True  # a blocking copy: torch synchronizes the stream
        for tensor in reads:
            on_host = source_on_host and sim.place(tensor) != DEVICE
            sim.access(tensor, False, name, sim.host_stream if on_host else stream)
        for tensor in views:
            sim.access(tensor, False, name, stream, metadata=True)
        out = func(*args, **kwargs)
        for tensor in writes:
            sim.access(tensor, True, name, stream)
        results = out if isinstance(out, (list, tuple)) else (out,)
        for ret, result in zip(schema.returns, results, strict=False):
            if ret.alias_info is None:
                for tensor in _tensors(result):
                    sim.access(tensor, True, name, stream, allocates=True, place=out_place)
        if host_waits:
            sim.host_sees(stream.clock)
        return out


class HostReads:
    """The host reads that reach no operator on a CPU tensor, as patches of ``torch.Tensor``'s methods
    (a function mode would be off inside backward, which torch's ``backward`` hands to it):
    ``tolist``, ``numpy``, ``__array__`` and ``data_ptr`` (of host memory: whoever takes the address
    reads through it); and ``Tensor.to`` a device of host memory, a copy to the device that the CPU
    stand-in would skip."""

    METHODS = ("tolist", "numpy", "__array__", "data_ptr", "to")

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.real = {name: getattr(torch.Tensor, name) for name in self.METHODS}

    def patches(self) -> list[tuple[Any, str, Any]]:
        """(torch.Tensor, method, replacement) for each method."""
        return [(torch.Tensor, name, self._method(name)) for name in self.METHODS]

    def _method(self, name: str) -> Any:
        real = self.real[name]

        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if name == "to":
                return self._to(real, tensor, *args, **kwargs)
            device = self.sim.place(tensor) == DEVICE
            if name in ("numpy", "__array__") and device and package_site(1) is not None:
                self.sim._find(f"{name}() of device memory, which raises on CUDA (copy it to the host first)")
            if not (name == "data_ptr" and device):
                self.sim.host_read(tensor, f"Tensor.{name}")
            return real(tensor, *args, **kwargs)

        return method

    def _to(self, real: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = kwargs.get("device", args[0] if args else None)
        if self.sim.place(tensor) == DEVICE or not isinstance(target, (torch.device, str, int)) or len(args) > 1 \
                or not set(kwargs) <= {"device", "non_blocking"}:
            return real(tensor, *args, **kwargs)
        return self._to_device(tensor, bool(kwargs.get("non_blocking", False)))

    def _to_device(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """``tensor.to(device)`` of host memory: the rules of a copy (see the module docstring)."""
        sim = self.sim
        pinned = sim.place(tensor) == PINNED
        stream = sim.current
        reader = stream if pinned or not non_blocking else sim.host_stream  # pageable: staged by the host now
        sim.access(tensor, False, "Tensor.to (to the device)", reader)
        if pinned and non_blocking:
            for key, owner, kind in sim.parts(tensor):
                sim._record(key, owner, kind, "Tensor.to").recorded.add(stream.name)
        with _disable_current_modes():
            out = tensor.clone()
        sim.access(out, True, "Tensor.to (to the device)", stream, allocates=True, place=DEVICE)
        if not non_blocking:
            sim.host_sees(stream.clock)
        return out
