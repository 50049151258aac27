"""A zoo of training loops: racy ones the detector must find, clean ones it must leave alone.

Each loop runs on every rank of a real gloo group (``run_zoo``), three steps or more, with
rank-dependent data, and returns the parameters it ends with. A line the detector must name carries
a marker comment ``# zoo: <loop> launch`` or ``# zoo: <loop> access``; the tests read the line
numbers from this file (``marked_line``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.sanitize import detect

STEPS = 3
LR = 0.1


def marked_line(loop: str, what: str) -> str:
    """``"tests/sanitize/zoo.py:N"``-style ``path:line`` suffix of the line marked ``# zoo: loop what``."""
    for number, line in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# zoo: {loop} {what}"):
            return f"zoo.py:{number}"
    raise KeyError(f"no line marked '# zoo: {loop} {what}'")


def _net() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank; every parameter's size divides by 2 and 3
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 6))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 6, generator=generator)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    inputs, target = _batch(rank, step)
    return nn.functional.mse_loss(model(inputs), target)  # zoo: forward access


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- racy loops -----------------------------------------------------------------------------------------


def manual_step(rank: int, world_size: int) -> list[torch.Tensor]:
    """``opt.step()`` before the all-reduces of the gradients were waited for."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]  # zoo: manual_step launch
        opt.step()  # zoo: manual_step access
        for work in works:
            work.wait()
        opt.zero_grad()
    return _params(net)


def manual_zero_grad(rank: int, world_size: int) -> list[torch.Tensor]:
    """``zero_grad(set_to_none=False)`` writes the gradients an all-reduce may still be writing."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]  # zoo: manual_zero_grad launch
        opt.step()
        opt.zero_grad(set_to_none=False)  # zoo: manual_zero_grad access
        for work in works:
            work.wait()
    return _params(net)


def manual_clip(rank: int, world_size: int) -> list[torch.Tensor]:
    """``clip_grad_norm_`` reads the gradients before their all-reduces were waited for."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]  # zoo: manual_clip launch
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # zoo: manual_clip access
        for work in works:
            work.wait()
        opt.step()
        opt.zero_grad()
    return _params(net)


def _late_division_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
    tensor = bucket.buffer()
    future = dist.all_reduce(tensor, async_op=True).get_future()  # zoo: late_hook launch
    tensor.div_(dist.get_world_size())  # zoo: late_hook access
    return future.then(lambda fut: fut.value()[0])


def late_hook(rank: int, world_size: int) -> list[torch.Tensor]:
    """A comm hook that divides its bucket after launching the all-reduce, not in ``.then()``."""
    model = DistributedDataParallel(_net())
    model.register_comm_hook(None, _late_division_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return _params(model.module)


def ddp_delayed(rank: int, world_size: int) -> list[torch.Tensor]:
    """Stock DDP's ``delay_all_reduce_named_params``: it never waits for that all-reduce."""
    net = _net()
    delayed = [(name, p) for name, p in net.named_parameters() if name.startswith("0.")]
    model = DistributedDataParallel(net, delay_all_reduce_named_params=delayed,
                                    param_to_hook_all_reduce=net[0].weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, rank, step).backward()  # zoo: ddp_delayed launch
        opt.step()  # zoo: ddp_delayed access
        opt.zero_grad(set_to_none=False)  # DDP's delayed gradients are views of its buffer only this way
    return _params(net)


def _gather(net: nn.Module, rank: int, world_size: int) -> list[Any]:
    """Each rank's slice of every parameter, gathered back into the parameter, asynchronously."""
    works = []
    for p in net.parameters():
        flat = p.data.view(-1)
        mine = flat.chunk(world_size)[rank].clone()
        works.append(dist.all_gather_into_tensor(flat, mine, async_op=True))  # zoo: gather launch
    return works


def gather(rank: int, world_size: int) -> list[torch.Tensor]:
    """Updated parameters all-gathered asynchronously and read by the next forward before the wait."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    works: list[Any] = []
    for step in range(STEPS):
        loss = _loss(net, rank, step)  # zoo: gather access
        for work in works:
            work.wait()
        loss.backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        works = _gather(net, rank, world_size)
    for work in works:
        work.wait()
    return _params(net)


def dropped(rank: int, world_size: int) -> list[torch.Tensor]:
    """A hand-written sharded update whose all-gather input and ``Work`` are dropped before any wait."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        for p in net.parameters():
            flat = p.data.view(-1)
            dist.all_gather_into_tensor(flat, flat.chunk(world_size)[rank].clone(), async_op=True)  # zoo: dropped launch
        dist.barrier()
    return _params(net)


def numpy_read(rank: int, world_size: int) -> list[torch.Tensor]:
    """Gradients averaged through numpy before the wait: no op the detector sees (``--force`` shows it)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]
        averaged = [torch.from_numpy(p.grad.numpy() / world_size) for p in net.parameters()]
        for work in works:
            work.wait()
        for p, grad in zip(net.parameters(), averaged, strict=True):
            p.grad = grad
        opt.step()
        opt.zero_grad()
    return _params(net)


RACY: dict[str, Callable[[int, int], list[torch.Tensor]]] = {
    "manual_step": manual_step, "manual_zero_grad": manual_zero_grad, "manual_clip": manual_clip,
    "late_hook": late_hook, "ddp_delayed": ddp_delayed, "gather": gather, "dropped": dropped,
}


# -- clean loops ------------------------------------------------------------------------------------------


def manual_waits(rank: int, world_size: int) -> list[torch.Tensor]:
    """The manual loop done right: wait, then divide, then step."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        _loss(net, rank, step).backward()
        works = [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]
        for work in works:
            work.wait()
        for p in net.parameters():
            p.grad.div_(world_size)
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _params(net)


def _ddp_loop(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = STEPS,
              accumulate: bool = False) -> list[torch.Tensor]:
    for step in range(steps):
        if accumulate:
            with model.no_sync():  # type: ignore[operator]
                _loss(model, rank, 100 + step).backward()
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    inner = model.module if hasattr(model, "module") else model
    return _params(inner)  # type: ignore[arg-type]


def ddp_plain(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank)


def ddp_no_sync(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net())
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank, accumulate=True)


def ddp_static_graph(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net(), static_graph=True)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank)


def ddp_allreduce_hook(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net(), bucket_cap_mb=0.0005)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank)


def ddp_powersgd(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank, steps=5)


def overlap_default(rank: int, world_size: int) -> list[torch.Tensor]:
    model = OverlapDDP(_net(), bucket_cap_mb=0.0005)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank, accumulate=True)


def overlap_guarded(rank: int, world_size: int) -> list[torch.Tensor]:
    model = OverlapDDP(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.attach_optimizer(opt)
    return _ddp_loop(model, opt, rank)


def overlap_optimizer(rank: int, world_size: int) -> list[torch.Tensor]:
    model = OverlapDDP(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.attach_optimizer(opt, overlap=True)
    return _ddp_loop(model, opt, rank)


def overlap_sharded(rank: int, world_size: int) -> list[torch.Tensor]:
    model = OverlapDDP(_net(), bucket_cap_mb=0.0005)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.attach_optimizer(opt, shard=True)
    return _ddp_loop(model, opt, rank)


def overlap_powersgd(rank: int, world_size: int) -> list[torch.Tensor]:
    model = OverlapDDP(_net())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return _ddp_loop(model, torch.optim.SGD(model.parameters(), lr=LR), rank, steps=5)


def zero(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_net())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    return _ddp_loop(model, opt, rank)


CLEAN: dict[str, Callable[[int, int], list[torch.Tensor]]] = {
    "manual_waits": manual_waits, "ddp_plain": ddp_plain, "ddp_no_sync": ddp_no_sync,
    "ddp_static_graph": ddp_static_graph, "ddp_allreduce_hook": ddp_allreduce_hook, "ddp_powersgd": ddp_powersgd,
    "overlap_default": overlap_default, "overlap_guarded": overlap_guarded, "overlap_optimizer": overlap_optimizer,
    "overlap_sharded": overlap_sharded, "overlap_powersgd": overlap_powersgd, "zero": zero,
}
LOOPS = {**RACY, **CLEAN, "numpy_read": numpy_read}


Params = list[tuple[list[int], bytes]]  # each parameter's shape and bytes (tensors do not survive a rank's exit)


def run_zoo(rank: int, world_size: int, names: list[str], force: bool = False,
            bare: bool = False) -> dict[str, tuple[list[dict[str, Any]], Params]]:
    """Each named loop under the detector (``bare``: without it): its findings and final parameters."""
    results = {}
    for name in names:
        if bare:
            results[name] = ([], _raw(LOOPS[name](rank, world_size)))
            continue
        with detect(force=force, echo=False) as findings:
            params = LOOPS[name](rank, world_size)
        results[name] = ([f.as_json() for f in findings], _raw(params))
        dist.barrier()
    return results


def _raw(params: list[torch.Tensor]) -> Params:
    return [(list(p.shape), p.numpy().tobytes()) for p in params]


def has_nan(params: Params) -> bool:
    """Whether any parameter holds a NaN (``--force`` made a race show in the numbers)."""
    return any(torch.frombuffer(bytearray(raw), dtype=torch.float32).isnan().any().item() for _, raw in params)


def bare_and_forced(rank: int, world_size: int, names: list[str]) -> dict[str, tuple[Params, Params, int]]:
    """Each named loop without the detector, then under ``--force``: both final parameters, and how many
    findings the forced run had."""
    bare = run_zoo(rank, world_size, names, bare=True)
    forced = run_zoo(rank, world_size, names, force=True)
    return {name: (bare[name][1], forced[name][1], len(forced[name][0])) for name in names}
