"""GPU training scenarios, each compared bit for bit with a reference, each built so that one
missing wait of the CUDA path makes it fail (see device_streams.WAITS).

Each runs on two backends: two ranks sharing one GPU over gloo (NCCL needs a GPU per rank), and one
rank over a world-size-1 NCCL group, whose semantics are what users run (its future completes at
enqueue, its callbacks run at once on a pool stream). Every delay is a sleep kernel on the stream
whose ordering is under test, so only a stream wait (not a host wait) can hide it. cuDNN and cuBLAS
run deterministically, so DDP's and OverlapDDP's arithmetic give the same bits.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.device_streams import CudaKit
from overlapddp.fence import CudaFence
from overlapddp.testing import _device_sleep, delay_communication
from tests.support import models

DELAY_S = 0.02
STEPS = 3
MODEL = "cnn_bn"


def deterministic() -> None:
    """Bit-equality with DDP is meaningful only when each kernel gives the same bits every time."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


class SkippingKit(CudaKit):
    """TEST-ONLY: the real kit with one named wait left out (the host still waits for futures)."""

    def __init__(self, device: torch.device, skip: str | None) -> None:
        super().__init__(device)
        self.skip = skip

    def wait_event(self, stream: Any, event: Any, edge: str) -> None:
        if edge != self.skip:
            super().wait_event(stream, event, edge)

    def wait_stream(self, stream: Any, other: Any, edge: str) -> None:
        if edge != self.skip:
            super().wait_stream(stream, other, edge)

    def wait_future(self, future: torch.futures.Future, edge: str) -> Any:
        if edge != self.skip:
            return super().wait_future(future, edge)
        while not future.done():  # the host waits; no stream is ordered after the collective
            time.sleep(0.0005)
        return future.value()


def _sleepy_allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """DDP's allreduce_hook, whose ``.then`` callback sleeps on its own stream, then writes there."""

    def late(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        written = torch.full_like(reduced, float("nan"))
        _device_sleep(DELAY_S)
        written.copy_(reduced)
        return written

    return default_hooks.allreduce_hook(state, bucket).then(late)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps on the stream it runs on (the stream its forward ran on)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _device_sleep(DELAY_S)
        return grad


class _SideBranch(nn.Module):
    """The test model plus a linear branch from its input. Given a stream, forward runs the branch there,
    so backward accumulates the branch's gradients there, late (after a sleep); they share one bucket
    with the trunk's, which the trunk's first layer (ready last, on the caller's stream) fills."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        super().__init__()
        self.trunk = models.build(MODEL)
        torch.manual_seed(1)
        self.side = nn.Linear(3 * 8 * 8, 10)
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        if self.stream is None:
            return out + self.side(x.flatten(1))
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        x.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            side = _SlowBackward.apply(self.side(x.flatten(1)))
        current.wait_stream(self.stream)
        side.record_stream(current)
        return out + side


# Scenario name -> (wrapper kwargs, comm hook, delay stage on the delayed rank or None, training loop).
SCENARIOS: dict[str, tuple[dict, Callable | None, str | None, str]] = {
    "copy-in delayed on the producer stream": ({}, None, "production", "plain"),
    "result written late on the hook callback's stream": ({}, "sleepy", None, "plain"),
    "collective delayed on the comm stream": ({}, None, "launch", "plain"),
    "step on a second stream with the guard": ({}, None, "consumption", "side step"),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, None, "completion", "plain"),
    "fp16_compress_hook": ({}, default_hooks.fp16_compress_hook, "completion", "plain"),
    "bf16_compress_hook": ({}, default_hooks.bf16_compress_hook, "completion", "plain"),
    "forward and backward on different streams": ({}, None, "consumption", "two streams"),
    "gradients of one bucket accumulated on two streams": ({"bucket_cap_mb": 25}, None, None, "side branch"),
}
# The scenario that fails when each wait is left out.
EXPOSES = {
    "gradient": "gradients of one bucket accumulated on two streams",
    "produced": "copy-in delayed on the producer stream",
    "collective": "result written late on the hook callback's stream",
    "completed": "result written late on the hook callback's stream",
    "released": "forward and backward on different streams",
    "reader": "step on a second stream with the guard",
}
# With one rank a sum changes nothing: a collective that reads its bucket early, or a reader that reads
# param.grad before the copy-out, still sees the right values. These waits still show on one NCCL rank.
EXPOSED_ON_ONE_RANK = ("gradient", "collective", "completed", "released")


BACKENDS = ("gloo", "nccl")


def world_size_of(backend: str) -> int:
    """Two ranks share the GPU over gloo; NCCL needs a GPU per rank, so it runs one."""
    return 2 if backend == "gloo" else 1


def group_for(backend: str) -> tuple[dist.ProcessGroup | None, int]:
    """The process group the wrappers use on ``backend`` (None: the default gloo group) and the rank
    that is delayed (the last one)."""
    if backend == "gloo":
        return None, 1
    if backend == "nccl":
        return dist.new_group([0], backend="nccl"), 0
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _hook(spec: Any) -> Callable | None:
    return _sleepy_allreduce_hook if spec == "sleepy" else spec


def run_scenario(
    rank: int, name: str, skip: str | None = None, group: dist.ProcessGroup | None = None, delayed_rank: int = 1
) -> list[bool]:
    """Train DDP and OverlapDDP side by side on ``group``; per step, whether every parameter, buffer
    and gradient is bit-equal."""
    kwargs, hook_spec, stage, loop = SCENARIOS[name]
    kwargs = dict(kwargs)
    cap = kwargs.pop("bucket_cap_mb", 0.001)
    device = torch.device("cuda", 0)
    hook = _hook(hook_spec)
    if loop == "side branch":
        modules = [_SideBranch(None).to(device), _SideBranch(torch.cuda.Stream(device)).to(device)]
    else:
        modules = [models.build(MODEL).to(device), models.build(MODEL).to(device)]
    reference = DistributedDataParallel(modules[0], device_ids=[0], bucket_cap_mb=cap, process_group=group, **kwargs)
    ours = OverlapDDP(modules[1], device_ids=[0], bucket_cap_mb=cap, process_group=group, **kwargs)
    if skip is not None:
        ours._reducer.replace_fence(CudaFence(device, kit=SkippingKit(device, skip)))
    if hook is not None:  # the hooks' state is the process group they reduce over
        reference.register_comm_hook(group, hook)
        ours.register_comm_hook(group, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, ours)]
    ours.attach_optimizer(opts[1])
    delay = delay_communication(ours, rank=delayed_rank, seconds=DELAY_S, stage=stage) if stage else _nothing()
    with delay:
        if loop == "two streams":
            return _grads_with_forward_and_backward_on_two_streams(rank, reference, ours, device)
        return _train(rank, reference, ours, opts, device, side_step=loop == "side step")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    state = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=False))
    grads = all(
        (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
        for p, q in zip(a.parameters(), b.parameters(), strict=False)
    )
    return state and grads


def _train(rank: int, reference: Any, ours: Any, opts: list, device: torch.device, side_step: bool) -> list[bool]:
    """Forward, backward and step on a user stream; with ``side_step`` the steps run on another
    stream, which DDP's user orders by hand and OverlapDDP's guard orders itself."""
    user, side = torch.cuda.Stream(), torch.cuda.Stream()
    equal = []
    with torch.cuda.stream(user):
        for step in range(STEPS):
            inputs, target = (t.to(device) for t in models.batch(MODEL, rank, step))
            for wrapper, opt in zip((reference, ours), opts, strict=False):
                opt.zero_grad()
                models.loss_of(wrapper(inputs), target).backward()
                if side_step:
                    if wrapper is reference:
                        side.wait_stream(user)
                    with torch.cuda.stream(side):
                        opt.step()
                    user.wait_stream(side)  # the next forward reads the updated parameters
                else:
                    torch.cuda._sleep(1_000_000)  # the consumer is slow: its readers must still wait
                    opt.step()
            torch.cuda.synchronize()
            equal.append(_equal(reference, ours))
    return equal


def _grads_with_forward_and_backward_on_two_streams(
    rank: int, reference: Any, ours: Any, device: torch.device
) -> list[bool]:
    """Forward (and so the gradient hooks and copy-in) on one stream, backward called on one of two
    others in turn (the copy-out's stream), no step: each iteration's gradients, cloned on the backward
    stream, must not be overwritten by the next iteration's copy-in. The backward stream alternates
    because the autograd engine makes forward's stream wait for the caller's at each backward: with
    one backward stream that wait alone would order the copy-in after the last copy-out, hiding a
    missing ``released`` wait. The reference runs on one stream."""
    forward, backwards = torch.cuda.Stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    expected, got = [], []
    for step in range(STEPS):
        inputs, target = (t.to(device) for t in models.batch(MODEL, rank, step))
        reference.zero_grad(set_to_none=True)
        models.loss_of(reference(inputs), target).backward()
        expected.append([p.grad.clone() for p in reference.parameters()])
    for step in range(STEPS):
        backward = backwards[step % 2]
        ours.zero_grad(set_to_none=True)
        with torch.cuda.stream(forward):
            inputs, target = (t.to(device) for t in models.batch(MODEL, rank, step))
            loss = models.loss_of(ours(inputs), target)
        backward.wait_stream(forward)
        with torch.cuda.stream(backward):
            loss.backward()
            got.append([p.grad.clone() for p in ours.parameters()])
    torch.cuda.synchronize()
    return [all(torch.equal(a, b) for a, b in zip(e, g, strict=False)) for e, g in zip(expected, got, strict=False)]


def all_scenarios(rank: int, world_size: int, backend: str = "gloo") -> dict[str, list[bool]]:
    """Every scenario once, and every wait's exposing scenario with that wait left out (one spawn), on
    ``backend`` (two gloo ranks, or one NCCL rank with only the waits one rank can show)."""
    deterministic()
    torch.cuda.set_device(0)
    group, delayed_rank = group_for(backend)
    results = {name: run_scenario(rank, name, group=group, delayed_rank=delayed_rank) for name in SCENARIOS}
    for wait, name in EXPOSES.items():
        if backend == "gloo" or wait in EXPOSED_ON_ONE_RANK:
            results[f"without {wait}"] = run_scenario(rank, name, skip=wait, group=group, delayed_rank=delayed_rank)
        dist.barrier()
    return results


def no_host_syncs(rank: int, world_size: int) -> dict[str, str]:
    """On one NCCL rank, after warm-up (the one-time bucket rebuild syncs, as DDP's does), a
    training step with find_unused_parameters, or with token weighting, must not sync the host."""
    deterministic()
    device = torch.device("cuda", 0)
    group = dist.new_group([0], backend="nccl")
    outcomes = {}
    for mode in ("find_unused_parameters", "token weighting", "default"):
        model = OverlapDDP(
            models.build(MODEL).to(device), device_ids=[0], process_group=group,
            find_unused_parameters=mode == "find_unused_parameters",
        )
        inputs, target = (t.to(device) for t in models.batch(MODEL, rank, 0))
        outcomes[mode] = "ok"
        for step in range(5):
            if step >= 3:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                if mode == "token weighting":
                    model.count_tokens(int(target.numel()))
                models.loss_of(model(inputs), target).backward()
            except RuntimeError as error:
                outcomes[mode] = str(error).splitlines()[0]
                break
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return outcomes


def without_set_device(rank: int, world_size: int) -> list[bool]:
    """Two GPUs over NCCL, only ``device_ids=[rank]`` (no torch.cuda.set_device): construction and
    the non-finite check's object gather must use each rank's own GPU."""
    deterministic()
    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world_size)), backend="nccl")
    reference = DistributedDataParallel(models.build(MODEL).to(device), device_ids=[rank], process_group=group)
    ours = OverlapDDP(models.build(MODEL).to(device), device_ids=[rank], process_group=group)
    ours.check_nonfinite_gradients()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, ours)]
    equal = []
    for step in range(STEPS):
        inputs, target = (t.to(device) for t in models.batch(MODEL, rank, step))
        for wrapper, opt in zip((reference, ours), opts, strict=False):
            opt.zero_grad()
            models.loss_of(wrapper(inputs), target).backward()
            opt.step()
        torch.cuda.synchronize(device)
        equal.append(_equal(reference, ours))
    return equal
