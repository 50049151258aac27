"""Which CUDA objects do the fences use? One small factory, so tests can swap in a recording fake.

Every stream, event, future, wait and ``record_stream`` of the CUDA path goes through
:class:`CudaKit`. A test injects a fake kit (CPU only) and asserts the order of those calls; a GPU
test injects a kit that skips one named wait and checks that training then fails. Each wait names
the edge it keeps.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
from torch.futures import Future

# The waits of the CUDA path, named by what each one orders (see fence.py and bucket/token_weighting.py).
WAITS = (
    "gradient",  # the stream that fills a bucket waits for the other streams that accumulated its gradients
    "produced",  # the communication stream waits for the bucket's copy-in
    "collective",  # the communication stream waits for the collective's (or hook chain's) result
    "completed",  # the consumer stream waits for the communication stream before copy-out
    "released",  # the next copy-in (producer stream) waits for the previous copy-out (consumer stream)
    "reader",  # a step, unscale_ or zero_grad on another stream waits for the consumer stream
)


class CudaKit:
    """Streams, events and waits on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, high_priority: bool = False) -> Any:
        return torch.cuda.Stream(device=self.device, priority=-1 if high_priority else 0)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> ContextManager[Any]:
        """Make ``stream`` current while the block runs."""
        return torch.cuda.stream(stream)

    def wait_event(self, stream: Any, event: Any, edge: str) -> None:
        """``stream`` runs nothing further until ``event`` happened; ``edge`` names the ordering kept."""
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any, edge: str) -> None:
        """``stream`` runs nothing further until all work queued so far on ``other`` ran."""
        stream.wait_stream(other)

    def new_future(self) -> Future:
        """A future set on another thread: ``set_result`` records an event on that thread's current
        stream, and ``wait()`` makes the waiter's current stream wait on it (a future without devices
        orders no stream)."""
        return Future(devices=[self.device])

    def wait_future(self, future: Future, edge: str) -> Any:
        """The future's value, with the current stream ordered after the work that produced it."""
        return future.wait()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from being reused before ``stream``'s queued work on it has run
        (a sparse tensor's memory is its indices and values)."""
        if not tensor.is_cuda:
            return
        for part in (tensor._indices(), tensor._values()) if tensor.is_sparse else (tensor,):
            part.record_stream(stream)


def device_context(device: torch.device) -> ContextManager[Any]:
    """Make ``device`` the current CUDA device while the block runs (object collectives on NCCL use
    the current device, which a script that passes only ``device_ids=[local_rank]`` never sets)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def side_stream(enabled: bool) -> Iterator[None]:
    """Run the block on a new CUDA stream when ``enabled``, as Lightning's DDP strategies build the
    wrapper, ordered both ways with the current stream: after the work queued so far (the module's
    initialization, which construction reads and broadcasts over) and before the work queued after
    the block (training, which reads what construction wrote). A new stream is ordered with nothing."""
    if not enabled:
        yield
        return
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)
