"""Race forcing: tools that make a missing fence fail every time instead of once a week.

A training loop that reads a gradient before its collective completes is wrong only when the
collective is slow, so races hide in local tests. These tools force the slow case:

- :func:`delay_communication` delays one rank's collectives (before launch or before completion),
  or its copy into a bucket or out of it (on CUDA: sleep kernels on the stream that does it);
- :func:`delay_parameter_gathers` delays one rank's broadcasts of a sharded optimizer's updated
  parameters, so a ``step()`` that returned before they arrived would be seen;
- :class:`SynchronousReference` trains the obvious way (backward, reduce every gradient and wait,
  then step), the baseline to compare with;
- :func:`unfenced` removes the fence (test-only!) so a race test can be shown to fail.

Example::

    >>> with delay_communication(model, rank=1, seconds=0.05):
    ...     loss_fn(model(x), y).backward(); opt.step()      # must equal the reference, bit for bit
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from overlapddp.clock import BucketStamps
from overlapddp.fence import CudaFence, Fence, FenceLog
from overlapddp.module_sync import broadcast_coalesced
from overlapddp.shard.optimizer import ShardedOptimizer
from overlapddp.torch_compat import cuda_sleep
from overlapddp.wrapper import OverlapDDP

STAGES = ("launch", "completion", "production", "consumption")


class DelayedFence(Fence):
    """Wraps a fence and delays its collectives by ``seconds``, at one stage.

    ``launch``: the collective starts late, so the other ranks' collectives wait for it.
    ``completion``: the collective's future resolves late, so its readers must wait longer (on
    CUDA its result is written late on the callback's stream: NCCL runs callbacks at enqueue).
    ``production``: the copy into each bucket starts late (CUDA: on the producer stream), so
    the collective must wait for it.
    ``consumption``: the copy out of each bucket starts late (CUDA: on the consumer stream), so
    the next iteration's copy-in and a reader on another stream must wait for it.
    """

    def __init__(self, inner: Fence, seconds: float, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}.")
        if seconds < 0:
            raise ValueError(f"seconds must not be negative, got {seconds}.")
        self.inner = inner
        self.seconds = seconds
        self.stage = stage
        self._on_cuda: dict[int, bool] = {}  # per bucket, from its last fill

    @property
    def log(self) -> FenceLog | None:
        return self.inner.log

    @log.setter
    def log(self, value: FenceLog | None) -> None:
        self.inner.log = value

    @property
    def stamps(self) -> BucketStamps | None:
        return self.inner.stamps

    @stamps.setter
    def stamps(self, value: BucketStamps | None) -> None:
        self.inner.stamps = value

    def gradient_ready(self, bucket: int, param: int | None = None) -> None:
        self.inner.gradient_ready(bucket, param)

    def fill(self, bucket: int, fill: Callable[[], torch.Tensor]) -> None:
        self.inner.fill(bucket, self._delayed_fill(bucket, fill))

    def launch(self, bucket: int, fill: Callable[[], torch.Tensor] | None, start: Callable[[], Future]) -> None:
        fill = None if fill is None else self._delayed_fill(bucket, fill)
        if self.stage == "launch":
            time.sleep(self.seconds)
            self.inner.launch(bucket, fill, lambda: _after_device_sleep(start, self.seconds))
        elif self.stage == "completion":
            self.inner.launch(bucket, fill, lambda: _resolve_late(start(), self.seconds, self._on_cuda[bucket]))
        else:
            self.inner.launch(bucket, fill, start)

    def _delayed_fill(self, bucket: int, fill: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``fill``, late at the production stage; notes where the bucket lives (for the completion stage)."""

        def delayed() -> torch.Tensor:
            if self.stage == "production":
                self._sleep_where_the_copy_runs()
            buffer = fill()
            self._on_cuda[bucket] = buffer.is_cuda
            return buffer

        return delayed

    def complete(self, bucket: int) -> object:
        value = self.inner.complete(bucket)
        if self.stage == "consumption":
            self._sleep_where_the_copy_runs()
        return value

    def _sleep_where_the_copy_runs(self) -> None:
        if isinstance(self.inner, CudaFence):
            _device_sleep(self.seconds)
        else:
            time.sleep(self.seconds)

    def consumed(self, bucket: int, consumer: str, written: Sequence[torch.Tensor] = ()) -> None:
        self.inner.consumed(bucket, consumer, written)

    def backward_ended(self) -> None:
        self.inner.backward_ended()

    def end_iteration(self) -> None:
        self.inner.end_iteration()

    def make_visible(self, strict: bool, gradients: Sequence[torch.Tensor] = ()) -> None:
        self.inner.make_visible(strict, gradients)

    def in_flight(self) -> list[int]:
        return self.inner.in_flight()

    def abandon(self) -> list[int]:
        return self.inner.abandon()


def _device_sleep(seconds: float) -> None:
    """A sleep kernel of at least ``seconds`` on the current CUDA stream (it counts clock cycles)."""
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 2_000_000)
    cuda_sleep(int(seconds * max(khz, 2_000_000) * 1e3))


def _after_device_sleep(start: Callable[[], Future], seconds: float) -> Future:
    """On CUDA also delay the stream the collective is issued on (a sleep kernel before it)."""
    if torch.cuda.is_available() and torch.cuda.current_stream() != torch.cuda.default_stream():
        _device_sleep(seconds)
    return start()


def _resolve_late(future: Future, seconds: float, on_cuda: bool) -> Future:
    if on_cuda:
        return future.then(lambda done: _written_late_on_stream(done, seconds))
    return _resolved_from_a_timer(future, seconds)


def _written_late_on_stream(done: Future, seconds: float) -> Any:
    """The callback's stream (current here) is what the future's readers wait for: delay it, then
    write the result on it, so a reader that does not wait reads NaN or garbage."""
    value = done.value()
    tensor = value[0] if isinstance(value, (list, tuple)) else value
    if not isinstance(tensor, torch.Tensor):  # nothing to write late: delay the callback itself
        time.sleep(seconds)
        return value
    late_copy = torch.full_like(tensor, float("nan"))
    _device_sleep(seconds)
    late_copy.copy_(tensor)
    return [late_copy] if isinstance(value, (list, tuple)) else late_copy


def _resolved_from_a_timer(future: Future, seconds: float) -> Future:
    """A future that resolves ``seconds`` after ``future``, set from a timer thread.

    Not a sleep in a callback: a callback attached to a collective that has already finished runs
    at once on the attaching thread, which would stall backward instead of the communication.
    """
    late: Future = Future()

    def arm(done: Future) -> None:
        try:
            timer = threading.Timer(seconds, late.set_result, args=(done.value(),))
            timer.daemon = True
            timer.start()
        except Exception as error:  # noqa: BLE001 - handed on to whoever waits on the late future
            late.set_exception(error)  # a failed collective, or no thread to start: never left unset

    future.add_done_callback(arm)
    return late


class UnfencedFence(Fence):
    """TEST-ONLY: hands out a bucket's buffer without waiting for its collective.

    This is the bug the project exists to prevent; it is here so race tests can prove they fail
    without the fence. Collectives it never waited on are waited by :meth:`drain`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._unwaited: list[Future] = []

    def complete(self, bucket: int) -> object:
        future = self._in_flight.pop(bucket)
        self._unwaited.append(future)
        return self._buffers[bucket]

    def drain(self) -> None:
        """Wait for every collective the unfenced reads skipped, so the process group can shut down."""
        for future in self._unwaited:
            future.wait()
        self._unwaited.clear()


def _rank_of(model: OverlapDDP) -> int:
    return dist.get_rank(model.process_group)


@contextmanager
def delay_communication(model: OverlapDDP, rank: int, seconds: float, stage: str = "launch") -> Iterator[None]:
    """Delay rank ``rank``'s collectives by ``seconds`` at ``stage`` while the block runs (other ranks run normally)."""
    if _rank_of(model) != rank:
        DelayedFence(Fence(), seconds, stage)  # validates the arguments on every rank alike
        yield
        return
    original = model.fence
    model.replace_fence(DelayedFence(original, seconds, stage))
    try:
        yield
    finally:
        model.replace_fence(original)


@contextmanager
def delay_parameter_gathers(sharded: ShardedOptimizer, rank: int, seconds: float) -> Iterator[None]:
    """Delay rank ``rank``'s broadcasts of updated parameters by ``seconds`` while the block runs:
    those it owns are launched late (every other rank receives them late), and those it receives
    land in its parameters late; a ``step()`` that returned before they arrived would be seen."""
    if seconds < 0:
        raise ValueError(f"seconds must not be negative, got {seconds}.")
    if sharded.rank != rank:
        yield
        return
    start = sharded.gather_start

    def late(tensor: torch.Tensor, owner: int) -> Any:
        if owner == rank:
            time.sleep(seconds)
            return start(tensor, owner)
        staging = torch.empty_like(tensor)
        work = start(staging, owner)

        def land() -> None:
            work.wait()
            time.sleep(seconds)
            tensor.copy_(staging)

        arrival = threading.Thread(target=land, daemon=True)
        arrival.start()
        return _Arrival(arrival)

    sharded.gather_start = late
    try:
        yield
    finally:
        sharded.gather_start = start


class _Arrival:
    """A delayed broadcast's work: ``wait()`` returns once its values are in the parameter."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def wait(self) -> bool:
        self._thread.join()
        return True


@contextmanager
def unfenced(model: OverlapDDP) -> Iterator[UnfencedFence]:
    """TEST-ONLY: run the block with the fence removed; gradients may be read mid-collective.

    A delay set by an enclosing :func:`delay_communication` is kept around the unfenced fence.
    """
    original = model.fence
    unsafe = UnfencedFence()
    unsafe.log = original.log
    if isinstance(original, DelayedFence):
        model.replace_fence(DelayedFence(unsafe, original.seconds, original.stage))
    else:
        model.replace_fence(unsafe)
    try:
        yield unsafe
    finally:
        unsafe.drain()
        model.replace_fence(original)


class SynchronousReference(nn.Module):
    """Data parallelism without overlap: buffers from rank 0 before forward, then after backward
    every gradient is scaled by 1/world_size, summed in one all-reduce and waited on, before any step.

    Its arithmetic is DDP's (multiply by the reciprocal, then sum). At world size 2 a sum does not
    depend on the buffer layout, so it is bit-equal to DDP there; at larger sizes the layout changes
    the rounding and only OverlapDDP (which reproduces DDP's layout) is bit-equal to DDP.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        group = process_group or dist.group.WORLD
        if group is None:
            raise RuntimeError("SynchronousReference needs a process group: call dist.init_process_group(...) first.")
        self.process_group: dist.ProcessGroup = group
        broadcast_coalesced([p.detach() for p in module.parameters()] + list(module.buffers()), 0, self.process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            broadcast_coalesced(list(self.module.buffers()), 0, self.process_group)
        return self.module(*inputs, **kwargs)

    def reduce_gradients(self) -> None:
        """Average every gradient across ranks and wait for the result."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        scale = 1.0 / self.process_group.size()
        flat = torch.cat([torch.mul(g, scale).reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.process_group)
        offset = 0
        for g in grads:
            g.copy_(flat.narrow(0, offset, g.numel()).view_as(g))
            offset += g.numel()
