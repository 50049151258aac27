"""Litmus tests for the stream race detector's model (tests/support/streams/): each rule it assumes, shown on
the hardware by a small CUDA program whose timing a sleep kernel forces.

Each test names the rule it checks (the ids of ``tests/support/streams/backends.py`` and the host-memory
rules of ``tests/support/streams/sim.py``). Where a rule says an ordering is missing, the test shows the
stale value the race gives; where it says an ordering exists, the value is the fresh one although the
producer was delayed. The NCCL rules run on a one-rank NCCL group in this process. Skips without a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from overlapddp.testing import _device_sleep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP_S = 0.2  # long enough that the host (or an unordered stream) acts before the delayed work runs
N = 1 << 16


def _slow_fill(tensor: torch.Tensor, value: float, stream: torch.cuda.Stream) -> None:
    """On ``stream``, after the current stream's work so far: sleep, then fill ``tensor`` with ``value``."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _device_sleep(SLEEP_S)
        tensor.fill_(value)


# -- host memory (tests/support/streams/sim.py) ------------------------------------------------------------------


def test_a_stream_wait_does_not_order_a_host_read_of_pinned_memory_an_event_synchronize_does():
    device = torch.zeros(N, device="cuda")
    pinned = torch.zeros(N, pin_memory=True)
    side = torch.cuda.Stream()
    _slow_fill(device, 1.0, side)
    with torch.cuda.stream(side):
        pinned.copy_(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    torch.cuda.current_stream().wait_event(copied)  # orders the default stream, not the host
    assert pinned[-1].item() == 0.0  # the host read the old value: the copy had not run
    copied.synchronize()
    assert pinned[-1].item() == 1.0


def test_tolist_of_device_memory_reads_on_the_current_stream_and_waits():
    value = torch.zeros(4, device="cuda")
    side = torch.cuda.Stream()
    _slow_fill(value, 1.0, side)
    assert value.tolist() == [0.0] * 4  # the current stream was not ordered after side: a stale read
    torch.cuda.synchronize()
    _slow_fill(value, 2.0, side)
    torch.cuda.current_stream().wait_stream(side)
    assert value.tolist() == [2.0] * 4  # ordered on the stream; the host waited for it (a blocking copy)


def test_a_non_blocking_copy_stages_pageable_memory_at_once_and_reads_pinned_memory_when_it_runs():
    for pinned in (False, True):
        source = torch.ones(N, pin_memory=pinned)
        target = torch.zeros(N, device="cuda")
        _device_sleep(SLEEP_S)  # the copy is queued behind the sleep
        target.copy_(source, non_blocking=True)
        source.fill_(2.0)  # a host write while the copy is queued
        torch.cuda.synchronize()
        assert target[-1].item() == (2.0 if pinned else 1.0), f"pinned={pinned}"


def test_pinned_memory_is_not_reused_while_a_copy_from_it_is_queued():
    _device_sleep(SLEEP_S)
    source = torch.ones(N, pin_memory=True)
    target = torch.zeros(N, device="cuda")
    target.copy_(source, non_blocking=True)
    address = source.data_ptr()
    del source  # torch's host allocator recorded an event on the current stream for the copy
    again = torch.empty(N, pin_memory=True)
    assert again.data_ptr() != address
    torch.cuda.synchronize()


# -- NCCL (tests/support/streams/backends.py, N1 to N5) --------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl():
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _gather_late(async_op: bool, allocated_on: torch.cuda.Stream | None = None, fill_late: bool = True):
    """An all-gather (its output written by NCCL, so ordering shows) of a tensor of ones, launched from
    a current stream that is asleep: with ``fill_late`` the ones are written after the sleep (the
    collective must wait for them), else before it (the collective runs late); returns (input,
    output, work)."""
    with torch.cuda.stream(allocated_on or torch.cuda.current_stream()):
        source = torch.zeros(N, device="cuda")
    output = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()  # what follows on any stream is after these allocations' writes
    current = torch.cuda.current_stream()
    if fill_late:
        _slow_fill(source, 1.0, current)
    else:
        source.fill_(1.0)
        _device_sleep(SLEEP_S)
    work = dist.all_gather_into_tensor(output, source, async_op=async_op)
    return source, output, work


def test_n1_an_async_collective_waits_for_the_launching_stream_and_n2_work_wait_orders_the_reader(nccl):
    _, output, work = _gather_late(async_op=True)
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        unordered = output[-1].item()  # reader was not ordered after the collective
    with torch.cuda.stream(reader):
        work.wait()
        ordered = output[-1].item()
    assert unordered == 0.0 and ordered == 1.0  # and the collective read the launching stream's fill


def test_n1_the_stash_keeps_an_async_collectives_input_and_n2_work_wait_releases_it(nccl):
    side = torch.cuda.Stream()
    results = {}
    for case in ("not waited", "waited"):
        torch.cuda.synchronize()
        source, output, work = _gather_late(async_op=True, allocated_on=side, fill_late=False)
        if case == "waited":
            work.wait()  # the current stream waits on the end event; the stash is released
        address = source.data_ptr()
        del source
        with torch.cuda.stream(side):
            reused = torch.full((N,), 7.0, device="cuda")  # side's pool: the freed block, if free
        same_block = reused.data_ptr() == address
        torch.cuda.synchronize()
        results[case] = (same_block, output[-1].item())
    assert results["not waited"] == (False, 1.0)  # kept by the stash until the collective ran
    assert results["waited"] == (True, 7.0)  # released at wait: the collective read the new owner's 7


def test_n3_a_synchronous_collective_runs_on_the_current_stream_and_keeps_nothing(nccl):
    side = torch.cuda.Stream()
    source, output, work = _gather_late(async_op=False, allocated_on=side, fill_late=False)
    assert work is None
    address = source.data_ptr()
    del source  # no stash: the block goes back to side's pool at once
    with torch.cuda.stream(side):
        reused = torch.full((N,), 7.0, device="cuda")
    assert reused.data_ptr() == address
    torch.cuda.synchronize()
    assert output[-1].item() == 7.0  # the collective ran later, on the current stream, on the reused block


def test_n4_future_wait_orders_the_current_stream_and_value_does_not(nccl):
    _, output, work = _gather_late(async_op=True)
    future = work.get_future()
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        future.value()
        unordered = output[-1].item()
        future.wait()
        ordered = output[-1].item()
    assert unordered == 0.0 and ordered == 1.0


def test_n5_a_child_future_orders_its_waiter_only_when_its_value_holds_cuda_memory(nccl):
    seen = {}
    for case, callback in (("tensor", lambda f: f.value()[0]), ("none", lambda f: None)):
        torch.cuda.synchronize()
        _, output, work = _gather_late(async_op=True)
        child = work.get_future().then(callback)
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            child.wait()
            seen[case] = output[-1].item()
    assert seen == {"tensor": 1.0, "none": 0.0}


# -- the autograd engine (tests/support/streams/backends.py, A1 to A4) ---------------------------------------------------


def test_a1_backward_runs_after_the_callers_stream_and_a2_accumulation_on_its_nodes_creation_stream():
    weight = torch.nn.Parameter(torch.ones(N, device="cuda"))
    created, forward, caller = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (created, forward, caller):
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(created):
        accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]  # made here, and kept
    ran_on = []
    weight.register_post_accumulate_grad_hook(lambda p: ran_on.append(torch.cuda.current_stream()))
    with torch.cuda.stream(forward):
        loss = (weight * 3).sum()
    caller.wait_stream(forward)
    with torch.cuda.stream(caller):
        seed = torch.zeros((), device="cuda")
        _slow_fill(seed, 2.0, caller)  # the caller's work, late
        loss.backward(seed)
    torch.cuda.synchronize()
    assert ran_on == [created]
    assert weight.grad[-1].item() == 6.0  # backward waited for the caller's fill of its seed
    del accumulator


def test_a3_a4_final_callbacks_run_on_the_callers_stream_after_the_leaf_streams():
    weight = torch.nn.Parameter(torch.ones(N, device="cuda"))
    created, caller = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (created, caller):
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(created):
        accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]

    def slow(grad: torch.Tensor) -> torch.Tensor:  # runs on the accumulation's stream, late
        _device_sleep(SLEEP_S)
        return grad * 1

    weight.register_hook(slow)
    seen = []

    def callback() -> None:
        seen.append((torch.cuda.current_stream(), weight.grad.sum().item()))

    def queue(p: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    weight.register_post_accumulate_grad_hook(queue)
    with torch.cuda.stream(caller):
        (weight * 2).sum().backward()
    assert seen == [(caller, 2.0 * N)]  # the caller's stream, ordered after the late accumulation
    del accumulator
