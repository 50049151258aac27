"""Fake CUDA streams and events with vector clocks, and a dispatch mode that checks every access.

Each stream has a vector clock: its own counter ticks at every access, an event copies the clock of
the stream it is recorded on, and a wait merges the event's (or the other stream's) clock into the
waiting stream's. An access by stream ``s`` happens after an access ``(t, n)`` (the ``n``-th access
of stream ``t``) when ``t`` is ``s`` or ``s``'s clock holds ``t`` at ``n`` or more. The host has a
clock too: what it has seen finish (an event's ``synchronize``, ``.item()``, a gloo work waited
on); every stream merges it before each access, since work enqueued after the host saw something
finish runs after it.

Rules checked (each broken rule is a finding, with both accesses named):

- a read happens after the last write of its storage on every other stream;
- a write happens after the last write and every read since, on every other stream;
- a storage freed on the host was used only by its allocation stream, by streams it was recorded
  for (``record_stream``), or by accesses its allocation stream is already ordered after (the
  caching allocator hands a freed block to the next allocation on the allocation stream).

Storages are keyed by identity (the ``StorageImpl``), so views of a flat bucket buffer alias it and
CPU tensors count; a sparse tensor is its indices and values, plus its own object (gloo's sparse
all-reduce replaces both inside it).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from overlapddp.device_streams import CudaKit

HOST_SYNCS = {"aten._local_scalar_dense.default"}


class SimStream:
    """A fake ``torch.cuda.Stream``."""

    def __init__(self, sim: "Sim", name: str) -> None:
        self.sim = sim
        self.name = name
        self.stream_id = name
        self.clock: dict[str, int] = {name: 0}
        self.device = torch.device("cpu")

    def wait_event(self, event: "SimEvent") -> None:
        self.sim.wait_event(self, event)

    def wait_stream(self, other: "SimStream") -> None:
        self.sim.wait_stream(self, other)

    def synchronize(self) -> None:
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
        self.sim.merge_host(stream)
        self.clock = dict(stream.clock)

    def wait(self, stream: SimStream | None = None) -> None:
        self.sim.wait_event(stream or self.sim.current, self)

    def synchronize(self) -> None:
        if self.clock is not None:
            self.sim.host_sees(self.clock)

    def elapsed_time(self, other: "SimEvent") -> float:
        return 1.0  # milliseconds; the model has no timing


@dataclass
class Access:
    stream: str
    tick: int
    what: str


@dataclass
class StorageRecord:
    label: str
    alloc: str  # the stream the storage was allocated on
    last_write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)  # the latest read per stream since the last write
    used: dict[str, Access] = field(default_factory=dict)  # the latest access per stream, ever
    recorded: set[str] = field(default_factory=set)  # streams record_stream named


def _site(depth: int) -> tuple[str, int, str]:
    """The (file, line, function) of a caller ``depth`` frames up, for mutation sites and messages."""
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


class Sim:
    """Streams, events, the host's clock, every storage's accesses, and the findings so far.

    ``skip_waits`` names waits of ``device_streams.WAITS`` to leave out; ``skip_records`` names
    ``record_stream`` call sites (``path:line``) to leave out: the mutation matrix's mutants.
    """

    def __init__(self, skip_waits: frozenset[str] = frozenset(), skip_records: frozenset[str] = frozenset()) -> None:
        self.skip_waits = skip_waits
        self.skip_records = skip_records
        self.streams: dict[str, SimStream] = {}
        self.default = self.stream("default")
        self._stack: list[SimStream] = [self.default]
        self.host: dict[str, int] = {}
        self.records: dict[int, StorageRecord] = {}
        self.findings: list[str] = []
        self.context = ""  # what the scenario is doing, for messages
        self.record_sites: set[str] = set()  # record_stream call sites that ran
        self._labels = 0
        self.autograd: Any = None  # the engine's model, while simulating (backends.AutogradModel)
        self.frees_on_current = False  # CPU threads free memory themselves (set by the gloo model)
        self._names: dict[str, int] = {}

    # -- streams and clocks ---------------------------------------------------------------------

    def stream(self, name: str) -> SimStream:
        if name not in self.streams:
            self.streams[name] = SimStream(self, name)
        return self.streams[name]

    def new_stream(self, prefix: str) -> SimStream:
        self._names[prefix] = self._names.get(prefix, 0) + 1
        return self.stream(f"{prefix}{self._names[prefix]}")

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

    def merge_host(self, stream: SimStream) -> None:
        _merge(stream.clock, self.host)

    def tick(self, stream: SimStream) -> int:
        self.merge_host(stream)
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        return stream.clock[stream.name]

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        if event.clock is not None:
            _merge(stream.clock, event.clock)

    def wait_stream(self, stream: SimStream, other: SimStream) -> None:
        self.merge_host(other)
        _merge(stream.clock, other.clock)

    def host_sees(self, clock: dict[str, int]) -> None:
        _merge(self.host, clock)

    def synchronize(self) -> None:
        for stream in self.streams.values():
            self.host_sees(stream.clock)

    @staticmethod
    def _after(stream: SimStream, access: Access) -> bool:
        return access.stream == stream.name or stream.clock.get(access.stream, 0) >= access.tick

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

    def _record(self, key: int, owner: Any, kind: str, what: str) -> StorageRecord:
        record = self.records.get(key)
        if record is None:
            self._labels += 1
            label = f"{kind} #{self._labels} (from {what} on {self.current.name})"
            record = self.records[key] = StorageRecord(label, self.current.name)
            weakref.finalize(owner, self._freed, key, record)
        return record

    def access(self, tensor: torch.Tensor, write: bool, what: str, stream: SimStream | None = None,
               allocates: bool = False, metadata: bool = False) -> None:
        """One access of ``tensor`` by ``what`` on ``stream``; ``metadata``: only a sparse tensor's own
        object is read (a view of its indices or values)."""
        stream = stream or self.current
        for key, owner, kind in self.parts(tensor)[:1] if metadata else self.parts(tensor):
            record = self._record(key, owner, kind, what)
            if allocates:
                record.alloc = stream.name
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

    def record_stream(self, tensor: torch.Tensor, stream: SimStream, site: str) -> None:
        self.record_sites.add(site)
        if site in self.skip_records:
            return
        for key, owner, kind in self.parts(tensor):
            self._record(key, owner, kind, "record_stream").recorded.add(stream.name)

    def keep_alive(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """What a backend does for its own stream (NCCL stashes its tensors until the work is done)."""
        for key, owner, kind in self.parts(tensor):
            self._record(key, owner, kind, "collective").recorded.add(stream.name)

    def _freed(self, key: int, record: StorageRecord) -> None:
        """CUDA: the block goes back to its allocation stream's pool, reused once every stream it was
        recorded for reaches where it is now. CPU (``frees_on_current``): freed by the current thread, or
        by the last of the backend's workers that kept it."""
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


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for name, tick in other.items():
        if into.get(name, 0) < tick:
            into[name] = tick


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class Accesses(TorchDispatchMode):
    """Records each op's reads and writes, from its schema, on the current fake stream.

    An argument marked written (``Tensor(a!)``) is written; one that only aliases (a view) is not
    accessed; any other tensor argument is read; a fresh output is written where it is allocated.
    ``.item()`` reads, then the host sees the current stream finish.
    """

    def __init__(self, sim: Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        name = str(func)
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
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
        for tensor in reads:
            self.sim.access(tensor, False, name)
        for tensor in views:
            self.sim.access(tensor, False, name, metadata=True)
        out = func(*args, **kwargs)
        for tensor in writes:
            self.sim.access(tensor, True, name)
        results = out if isinstance(out, (list, tuple)) else (out,)
        for ret, result in zip(schema.returns, results, strict=False):
            if ret.alias_info is None:
                for tensor in _tensors(result):
                    self.sim.access(tensor, True, name, allocates=True)
        if name in HOST_SYNCS:
            self.sim.host_sees(self.sim.current.clock)
        return out


class SimKit(CudaKit):
    """The CUDA kit on fake streams: waits the mutation leaves out are skipped, and each
    ``record_stream`` is noted with its call site."""

    def __init__(self, sim: Sim) -> None:
        super().__init__(torch.device("cpu"))
        self.sim = sim

    def new_stream(self, high_priority: bool = False) -> Any:
        caller = _site(1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        return self.sim.new_stream({"fence": "comm", "token_weighting": "tokens"}.get(caller, caller))

    def new_event(self) -> Any:
        return SimEvent(self.sim)

    def current_stream(self) -> Any:
        return self.sim.current

    def use(self, stream: Any) -> Any:
        return self.sim.use(stream)

    def wait_event(self, stream: Any, event: Any, edge: str) -> None:
        if edge not in self.sim.skip_waits:
            self.sim.wait_event(stream, event)

    def wait_stream(self, stream: Any, other: Any, edge: str) -> None:
        if edge not in self.sim.skip_waits:
            self.sim.wait_stream(stream, other)

    def wait_future(self, future: torch.futures.Future, edge: str) -> Any:
        if edge in self.sim.skip_waits:
            return future.value()  # the host has the value; no stream is ordered after the collective
        return future.wait()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        path, line, _ = _site(1)
        self.sim.record_stream(tensor, stream, f"{_relative(path)}:{line}")


def _relative(path: str) -> str:
    marker = "/overlapddp/"
    return "overlapddp/" + path.rsplit(marker, 1)[-1] if marker in path else path
