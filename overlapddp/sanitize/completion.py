"""Which collectives are still in flight for whom, and is this access ordered after them?

A collective is in flight from its launch until the rank observes its completion: its work's
``wait()``, its future's ``wait()`` or ``value()``, a ``then`` callback on it, a poll that answers
complete. Each launch gets a name in the stream clocks (``clocks.py``); an observation merges that
name into the clock of whoever observed it (the host for a CPU collective, the current stream for a
CUDA one). An access of a collective's memory is a finding unless the stream making it (the host,
for CPU memory) is ordered after the completion: a read of what it writes, or any write. So is a
collective never observed when the next one on its memory starts or the detector ends, and one of its
tensors freed before it was observed.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from overlapddp.sanitize.clocks import COLLECTIVES, HOST
from overlapddp.sanitize.findings import DROPPED, NEVER, READ, WRITE, Finding, user_site
from overlapddp.sanitize.memory import Span, SpanIndex, describe, span_of
from overlapddp.sanitize.names import Names
from overlapddp.sanitize.streams import StreamModel

OUTPUT, INPUT = "output", "input"
# How an observation orders a CUDA collective: these make the current stream wait for it (NCCL's
# work and future ``wait()``, a ``then`` callback's stream); ``value()`` orders no stream; a poll
# that answers complete means the device finished it, which the host has now seen.
STREAM_WAITS = ("wait", "future wait", "callback")


@dataclass(eq=False)
class InFlight:
    """One launched collective: what it touches, where it came from, and who has seen it complete.

    ``token``: its name in the clocks; an observer's clock holding it at 1 is ordered after it.
    ``forced``: the private buffers it writes under ``--force`` (their result is delivered at the
    first observation), or None.
    """

    number: int
    op: str
    group_size: int
    launched_at: str
    device: bool
    spans: list[tuple[Span, str]]
    tensors: list[weakref.ref]
    shape: str  # its first tensor's dtype and shape, for when none is left
    forced: Any = None
    observed: bool = False  # by anyone: not a never-completed collective
    retired: bool = False
    finalizers: list[weakref.finalize] = field(default_factory=list)

    @property
    def token(self) -> str:
        return f"{self.op}#{self.number}"

    def collective(self) -> str:
        return f"{self.op} over {self.group_size} rank{'s' if self.group_size != 1 else ''}"


class Collectives:
    """Every collective in flight on this rank, the memory index over them, and the findings."""

    def __init__(self, model: StreamModel, names: Names, rank: Callable[[], int],
                 report: Callable[[Finding], None]) -> None:
        self.model = model
        self.names = names
        self._rank = rank
        self._report = report
        self._index = SpanIndex()
        self._pending: dict[int, InFlight] = {}
        self._count = 0
        self._lock = threading.RLock()
        self._seen: set[tuple[str, str, str, str]] = set()
        self.last_site = "<start>:0"

    def __bool__(self) -> bool:
        """Whether any collective's memory is still watched (the access check's fast path)."""
        return bool(self._index)

    # -- launch, observe, retire -------------------------------------------------------------------

    def launch(self, op: str, group_size: int, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
               forced: Any = None, depth: int = 2) -> InFlight:
        """A collective was launched with ``outputs`` (written) and ``inputs`` (only read)."""
        site = user_site(depth + 1) or self.last_site
        with self._lock:
            self.last_site = site
            self._count += 1
            spans = [(s, role) for role, group in ((OUTPUT, outputs), (INPUT, inputs))
                     for s in map(span_of, group) if s is not None]
            device = any(self.model.on_device(t) for t in outputs + inputs)
            tensors = outputs + inputs
            entry = InFlight(self._count, op, group_size, site, device, spans, [weakref.ref(t) for t in tensors],
                             describe(tensors[0]) if tensors else "no tensor", forced)
            for span, _ in spans:
                for earlier, _ in self._index.overlapping(span):
                    self._superseded(earlier, entry)
            for span, role in spans:
                self._index.add(span, entry, role)
            self._pending[entry.number] = entry
            if device:  # it runs on the communication stream: whoever waits for that stream sees it complete
                self.model.clocks.of(COLLECTIVES)[entry.token] = 1
            for tensor in outputs + inputs:
                self._watch_free(entry, tensor)
        return entry

    def _superseded(self, earlier: InFlight, later: InFlight) -> None:
        """The next collective on ``earlier``'s memory starts: if nobody observed it, it never completed."""
        if not earlier.observed:
            self._find(NEVER, earlier, self._name(earlier, None), later.launched_at, f"next {later.op} launched")
        self._retire(earlier)

    def _watch_free(self, entry: InFlight, tensor: torch.Tensor) -> None:
        if tensor.layout != torch.strided or tensor.numel() == 0:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        shape = describe(tensor)
        entry.finalizers.append(weakref.finalize(storage, self._freed, entry, shape))

    def _freed(self, entry: InFlight, shape: str) -> None:
        with self._lock:
            if entry.retired or entry.observed:
                return
            # Freed by a backend's thread (no user frame): the rank's last launch came before it.
            site = user_site(2) or self.last_site
            self._find(DROPPED, entry, shape, site, "free")

    def observe(self, entries: list[InFlight], how: str) -> None:
        """This rank observed ``entries`` complete: by ``how`` (``wait``, ``future wait``, ``callback``,
        ``value`` or ``poll``), on the calling thread's current stream."""
        with self._lock:
            for entry in entries:
                if entry.retired:
                    continue
                entry.observed = True
                completion = {entry.token: 1}
                if not entry.device or how == "poll":
                    self.model.clocks.host_sees(completion)
                elif how in STREAM_WAITS:
                    self.model.clocks.wait(self.model.current(), completion)
                if entry.forced is not None and (how != "value" or not entry.device):
                    entry.forced.deliver()
                    entry.forced = None
                if self._seen_by(HOST, entry):
                    self._retire(entry)

    def _seen_by(self, stream: str, entry: InFlight) -> bool:
        self.model.clocks.merge_host(stream)
        return self.model.clocks.ordered_after(stream, entry.token, 1)

    def _retire(self, entry: InFlight) -> None:
        """Nothing about ``entry`` can be a finding any more: stop watching its memory."""
        if entry.retired:
            return
        entry.retired = True
        self._index.remove(entry)
        self._pending.pop(entry.number, None)
        for finalizer in entry.finalizers:
            finalizer.detach()
        self.model.clocks.forget(entry.token)

    # -- accesses ------------------------------------------------------------------------------------

    def access(self, tensor: torch.Tensor, write: bool, op: Any) -> None:
        """``op`` (an aten op) reads (or writes) ``tensor`` on the current stream (the host, for host memory)."""
        if not self._index.may_hold(tensor):
            return
        span = span_of(tensor)
        if span is None:
            return
        with self._lock:
            hits = self._index.overlapping(span)
            if not hits:
                return
            stream = self.model.current() if self.model.on_device(tensor) else HOST
            for entry, role in hits:
                if entry.retired or self._seen_by(stream, entry):
                    if self._seen_by(HOST, entry):
                        self._retire(entry)
                    continue
                if write or role == OUTPUT:
                    site = user_site(3) or self.last_site
                    self._find(WRITE if write else READ, entry, self._name(entry, tensor), site, _short(op))

    def end(self, site: str) -> None:
        """The detector stops: every collective nobody observed never completed."""
        with self._lock:
            for entry in sorted(self._pending.values(), key=lambda e: e.number):
                if not entry.observed:
                    self._find(NEVER, entry, self._name(entry, None), site, "end")
                self._retire(entry)

    # -- findings --------------------------------------------------------------------------------------

    def _name(self, entry: InFlight, tensor: torch.Tensor | None) -> str:
        """The accessed tensor as the user knows it (a parameter or its gradient), else the
        collective's tensor's name; with the accessed (or collective's) tensor's dtype and shape."""
        held = [t for t in (ref() for ref in entry.tensors) if t is not None]
        for candidate in ([tensor] if tensor is not None else []) + held:
            named = self.names.named(candidate)
            if named is not None:
                return f"{named[0]} ({describe(named[1])})"
        shown = tensor if tensor is not None else (held[0] if held else None)
        return describe(shown) if shown is not None else entry.shape

    def _find(self, kind: str, entry: InFlight, tensor: str, accessed_at: str, access: str) -> None:
        key = (kind, entry.launched_at, accessed_at, tensor)
        if key in self._seen:
            return
        self._seen.add(key)
        finding = Finding(kind, tensor, entry.collective(), entry.launched_at, accessed_at, access, self._rank())
        self._report(finding)


def _short(op: Any) -> str:
    """``aten.add_`` for ``aten.add_.Tensor``: the op as a user recognises it."""
    name = str(op)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
