"""A CPU stand-in for the CUDA kit (overlapddp/device_streams.py) that records every stream call,
and a counter of host reads, so the CUDA path's ordering and its host syncs can be checked without
a GPU."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FakeStream:
    def __init__(self, kit: "RecordingKit", name: str) -> None:
        self.kit = kit
        self.name = name
        self.stream_id = name

    def __repr__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:  # torch.cuda.Stream compares by stream, not by object
        return isinstance(other, FakeStream) and other.kit is self.kit and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FakeEvent:
    def __init__(self, kit: "RecordingKit", name: str) -> None:
        self.kit = kit
        self.name = name
        self.recorded_on: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream
        self.kit.calls.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.kit.calls.append(("synchronize", self.name))

    def __repr__(self) -> str:
        return self.name


class RecordingKit:
    """Hands out named fake streams and events; ``calls`` lists what was done with them, in order.

    ``skip`` names waits (see ``device_streams.WAITS``) to leave out, as a GPU mutation run does.
    """

    def __init__(self, skip: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple] = []
        self.streams: dict[str, FakeStream] = {"main": FakeStream(self, "main")}
        self.current = self.streams["main"]
        self._created = 0
        self._events = 0
        self.skip = skip

    def stream(self, name: str) -> FakeStream:
        return self.streams.setdefault(name, FakeStream(self, name))

    def new_stream(self, high_priority: bool = False) -> FakeStream:
        self._created += 1
        return self.stream(f"side{self._created}")

    def new_event(self) -> FakeEvent:
        self._events += 1
        return FakeEvent(self, f"e{self._events}")

    def current_stream(self) -> FakeStream:
        """A new object for the same stream each call, as ``torch.cuda.current_stream()`` returns."""
        return FakeStream(self, self.current.name)

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[FakeStream]:
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    def wait_event(self, stream: FakeStream, event: FakeEvent, edge: str) -> None:
        if edge not in self.skip:
            self.calls.append(("wait_event", stream.name, event.name, edge))

    def wait_stream(self, stream: FakeStream, other: FakeStream, edge: str) -> None:
        if edge not in self.skip:
            self.calls.append(("wait_stream", stream.name, other.name, edge))

    def wait_future(self, future: torch.futures.Future, edge: str) -> Any:
        self.calls.append(("wait_future", self.current.name, edge))
        return future.wait()

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.calls.append(("record_stream", tensor.untyped_storage().data_ptr(), stream.name))


class HostReads(TorchDispatchMode):
    """Counts the operations that make the host read a tensor's values (``.item()``, ``bool()``,
    ``.tolist()`` of one element, ``.to("cpu")``): on CUDA each one waits for the device."""

    READS = {"aten._local_scalar_dense.default", "aten._to_copy.default", "aten.to.dtype_layout"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if str(func) in self.READS and isinstance(args[0], torch.Tensor):
            self.reads.append((str(func), args[0].untyped_storage().data_ptr()))
        return func(*args, **(kwargs or {}))
