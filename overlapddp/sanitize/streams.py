"""On which stream does an access run, and which streams have waited for what?

The detector's question is not whether the host waited for a collective but whether the stream that
touches its memory is ordered after its completion. A CPU tensor is touched by the host, whose
``wait()`` is the completion. A CUDA tensor is touched by the current stream, which has seen a
collective complete only through ``work.wait()`` or the future's ``wait()`` called while it was
current, an event recorded after such a wait, ``wait_stream`` on a stream that has, or the host
having seen it finish (``synchronize``, a blocking copy to the host). :class:`CudaStreams` feeds
these edges into the vector clocks of ``clocks.py`` by patching ``torch.cuda``'s streams and events
while the detector runs; the test suite's CPU model of CUDA (``tests/support/streams``) keeps the same
clocks itself and hands them to the detector in its place.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from overlapddp.sanitize.clocks import HOST, StreamClocks


class StreamModel(Protocol):
    """What the detector asks of streams: the clocks, the calling thread's current stream, and
    whether a tensor's memory is touched on a device stream (else by the host)."""

    clocks: StreamClocks

    def current(self) -> str: ...

    def on_device(self, tensor: torch.Tensor) -> bool: ...

    def after_op(self, func: Any, args: tuple[Any, ...], out: Any) -> None: ...

    def patches(self) -> list[tuple[Any, str, Any]]: ...


class HostStreams:
    """No device: every tensor is host memory, every access is the host's."""

    def __init__(self) -> None:
        self.clocks = StreamClocks()

    def current(self) -> str:
        return HOST

    def on_device(self, tensor: torch.Tensor) -> bool:
        return False

    def after_op(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        return None

    def patches(self) -> list[tuple[Any, str, Any]]:
        return []


def stream_name(stream: Any) -> str:
    """A CUDA stream's name in the clocks: its device and id."""
    return f"cuda:{getattr(stream, 'device_index', 0)}/{stream.stream_id}"


_HOST_SYNCS = {"aten._local_scalar_dense.default", "aten.item.default"}


class CudaStreams:
    """Real CUDA streams and events, followed through patches of ``torch.cuda``'s classes.

    An event keeps the clock of the stream it was recorded on (in ``_clocks_of_events``, by id, as
    CUDA events take no attributes); a wait merges it. The host sees a stream's clock at its or an
    event's ``synchronize``, at ``torch.cuda.synchronize()`` and at a copy from device to host memory.
    """

    def __init__(self) -> None:
        self.clocks = StreamClocks()
        self._events: dict[int, dict[str, int]] = {}

    def current(self) -> str:
        return stream_name(torch.cuda.current_stream())

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def after_op(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """A host read of device memory (``.item()``, a copy to the host) makes the host wait."""
        name = str(func)
        to_host = name in _HOST_SYNCS and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda
        if not to_host and name in ("aten._to_copy.default", "aten.copy_.default") and isinstance(out, torch.Tensor):
            to_host = out.device.type == "cpu" and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if to_host:
            self.clocks.host_sees(self.clocks.of(self.current()))

    def patches(self) -> list[tuple[Any, str, Any]]:
        """(class or module, name, replacement) for each call that orders streams or the host."""
        event, stream = torch.cuda.Event, torch.cuda.Stream
        real_record, real_wait, real_event_sync = event.record, event.wait, event.synchronize
        real_wait_event, real_wait_stream, real_stream_sync = stream.wait_event, stream.wait_stream, stream.synchronize
        real_sync = torch.cuda.synchronize
        clocks, events = self.clocks, self._events

        def record(ev: Any, on: Any = None) -> Any:
            target = on if on is not None else torch.cuda.current_stream()
            clocks.merge_host(stream_name(target))
            events[id(ev)] = dict(clocks.of(stream_name(target)))
            return real_record(ev, on) if on is not None else real_record(ev)

        def wait(ev: Any, on: Any = None) -> Any:
            target = on if on is not None else torch.cuda.current_stream()
            clocks.wait(stream_name(target), events.get(id(ev), {}))
            return real_wait(ev, on) if on is not None else real_wait(ev)

        def event_sync(ev: Any) -> Any:
            clocks.host_sees(events.get(id(ev), {}))
            return real_event_sync(ev)

        def wait_event(st: Any, ev: Any) -> Any:
            clocks.wait(stream_name(st), events.get(id(ev), {}))
            return real_wait_event(st, ev)

        def wait_stream(st: Any, other: Any) -> Any:
            clocks.wait_stream(stream_name(st), stream_name(other))
            return real_wait_stream(st, other)

        def stream_sync(st: Any) -> Any:
            clocks.host_sees(clocks.of(stream_name(st)))
            return real_stream_sync(st)

        def synchronize(device: Any = None) -> Any:
            clocks.host_sees_every_stream()
            return real_sync(device)

        return [(event, "record", record), (event, "wait", wait), (event, "synchronize", event_sync),
                (stream, "wait_event", wait_event), (stream, "wait_stream", wait_stream),
                (stream, "synchronize", stream_sync), (torch.cuda, "synchronize", synchronize)]
