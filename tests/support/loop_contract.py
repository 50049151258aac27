"""The loop contract: every line of a DDP user's loop keeps its meaning in every mode, or raises there.

A *cell* is one loop line (``LINES``: a small training loop that uses the line, written as a user
writes it) run in one mode (``MODES``: how OverlapDDP is set up) against stock DDP running the same
loop. ``run_cell`` trains the candidate, then the reference, each for all its steps on rank-dependent
batches, recording after every step every parameter, buffer and optimizer state entry, and every
value the line reads or returns. ``judge`` gives the cell's outcome:

- ``equal``: every recorded tensor ``torch.equal`` to the reference's, every step;
- ``raises``: the candidate raised at the loop line ``RAISES`` names, with the message it names (the
  operation, then the fix), and everything recorded before that step was equal;
- ``contract``: the one difference the mode states in its docstring (``CONTRACT``), and only it;
- ``silent``: anything else (different numbers and no error, an error elsewhere): a failure.

``PLANTED`` breaks the library on purpose (in the rank, around one candidate) to show that each kind
of expectation turns ``silent`` when the library stops keeping it.
"""

from __future__ import annotations

import contextlib
import io
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP
from overlapddp.bucket import reduction
from overlapddp.layout import tuner
from overlapddp.optim import overlap
from tests.support import hooks

WORLD_SIZES = (2, 3)
STEPS = 4
TUNED_STEPS = 2 + tuner.TUNING_ITERATIONS  # every candidate layout in turn, then the chosen one
CAP_MB = 0.0005  # several buckets (about 130 floats each)
MAX_NORM = 0.05  # small enough that every step clips
LR = 0.1
PRECISION = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
INF_STEP, INF_RANK = 1, 1  # the GradScaler loop makes this rank's loss infinite at this step


class Net(nn.Module):
    """An MLP with a BatchNorm (buffers) and two square hidden layers (Muon's 2-D weights)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(8, width)
        self.norm = nn.BatchNorm1d(width)
        self.h1 = nn.Linear(width, width)
        self.h2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.h2(torch.tanh(self.h1(x)))))


def batch(rank: int, step: int, micro: int = 0, weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent data; ``weighted`` (count_tokens): 2 to 4 rows by rank, step and micro-batch."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    rows = 2 + (rank + step + micro) % 3 if weighted else 4
    return torch.randn(rows, 8, generator=g) * (1 + rank), torch.randn(rows, 4, generator=g)


def module_of(model: Any) -> nn.Module:
    """The user's module inside a wrapper, itself maybe compiled."""
    return getattr(model, "_orig_mod", model).module


class TokenCounts:
    """count_tokens on both sides: the candidate counts each micro-batch; stock DDP's hook divides by
    the global count of the micro-batches since its last synchronized forward (tests/support/hooks.py)."""

    def __init__(self) -> None:
        self.state = {"batched": False, "total": 0.0}  # divide_by_total_hook's state
        self._pending = 0.0

    def count(self, model: Any, y: torch.Tensor) -> None:
        if isinstance(model, OverlapDDP):
            model.count_tokens(y.numel())
            return
        local = torch.tensor(float(y.numel()))
        dist.all_reduce(local)
        self._pending += local.item()
        if model.require_backward_grad_sync:
            self.state["total"], self._pending = self._pending, 0.0


@dataclass
class Run:
    """What a loop line sees: the model as the user holds it, its optimizers, this rank's data.

    ``loss`` runs the forward and the mode's loss (with ``count_tokens``: the count, then the summed
    loss); ``record`` stores, after a step, everything the cell compares.
    """

    model: Any
    opts: list[torch.optim.Optimizer]
    rank: int
    steps: int
    tokens: TokenCounts | None = None
    trace: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(self.rank, step, micro, weighted=self.tokens is not None)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.tokens is None:
            return nn.functional.mse_loss(self.model(x).float(), y)
        self.tokens.count(self.model, y)
        return nn.functional.mse_loss(self.model(x).float(), y, reduction="sum")

    def record(self, **reads: Any) -> None:
        """After a step: parameters, buffers, optimizer state and settings, what the line read."""
        seen = {f"module.{n}": v.detach().clone() for n, v in module_of(self.model).state_dict().items()}
        for k, opt in enumerate(self.opts):
            state = opt.state_dict()  # with shard=True: the consolidated state (a collective)
            for index, entry in state["state"].items():
                seen.update({f"opt{k}.state.{index}.{key}": torch.as_tensor(v).clone() for key, v in entry.items()})
            seen.update({f"opt{k}.group{g}.lr": torch.as_tensor(group["lr"])
                         for g, group in enumerate(state["param_groups"])})
        for name, value in reads.items():
            items = value.items() if isinstance(value, dict) else [("", value)]
            seen.update({f"read.{name}" + (f".{key}" if key else ""): torch.as_tensor(v).detach().clone()
                         for key, v in items})
        self.trace.append(seen)


# -- the loop lines ------------------------------------------------------------------------------
# Each loop is what a DDP user writes; the line under test is the one its name says. ``opts`` is a
# list because the Muon mode trains with two optimizers (Muon and AdamW), as such users do.


def clip_grad_norm(run: Run) -> None:
    """``clip_grad_norm_`` before ``step()``; the norm it returns is compared too."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record(norm=norm)


def ema_after_step(run: Run) -> None:
    """An exponential moving average of the parameters, updated right after ``step()``."""
    model, opts = run.model, run.opts
    ema = [p.detach().clone() for p in model.parameters()]
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for average, p in zip(ema, model.parameters(), strict=True):
                average.mul_(0.9).add_(p, alpha=0.1)
        for opt in opts:
            opt.zero_grad()
        run.record(ema=dict(enumerate(ema)))


def save_module_state(run: Run) -> None:
    """``torch.save(model.module.state_dict(), buffer)`` after every step, loaded back and compared."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        buffer = io.BytesIO()
        torch.save(model.module.state_dict(), buffer)
        buffer.seek(0)
        run.record(saved=torch.load(buffer))


def eval_forward(run: Run) -> None:
    """A forward of ``model.module`` under ``torch.no_grad()`` between steps (BatchNorm still counts it)."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            output = model.module(run.batch(step, micro=9)[0])
        run.record(eval=output)


def lr_after_backward(run: Run) -> None:
    """An lr set between ``backward()`` and ``step()``, different at every step."""
    opts = run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = LR / (1 + step)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record()


def grad_scaler(run: Run) -> None:
    """``GradScaler("cpu")``: scale, backward, ``scaler.step``, ``update``; one rank's loss is
    infinite at one step, so every rank skips that step and the scale falls."""
    opts = run.opts
    scaler = torch.amp.GradScaler("cpu")
    for step in range(run.steps):
        x, y = run.batch(step)
        loss = run.loss(x, y)
        if step == INF_STEP and run.rank == INF_RANK:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        run.record(scale=scaler.get_scale())


def accumulate_no_sync(run: Run) -> None:
    """Gradient accumulation: ``with model.no_sync():`` for the first of two micro-batches."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        for micro in range(2):
            x, y = run.batch(step, micro)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                (run.loss(x, y) / 2).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record()


def accumulate_sync_flag(run: Run) -> None:
    """Gradient accumulation by assigning ``model.require_backward_grad_sync`` (nanoGPT)."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        for micro in range(2):
            x, y = run.batch(step, micro)
            model.require_backward_grad_sync = micro == 1
            (run.loss(x, y) / 2).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record()


def grad_norm_logged(run: Run) -> None:
    """The global gradient norm logged after ``backward()``, before ``step()``."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        logged = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None]))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record(grad_norm=logged)


def zero_grad_keep(run: Run) -> None:
    """``opt.zero_grad(set_to_none=False)``: the gradients stay, zeroed in place."""
    opts = run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)
        run.record()


def skipped_step(run: Run) -> None:
    """A step skipped on purpose (``if step != 1: opt.step()``), then ``zero_grad()``."""
    opts = run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            if step != 1:
                opt.step()
        for opt in opts:
            opt.zero_grad()
        run.record()


def read_params(run: Run) -> None:
    """Parameters read between ``backward()`` and ``step()``: what was read is compared."""
    model, opts = run.model, run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        before = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.record(params=before)


def lr_scheduler(run: Run) -> None:
    """An LR scheduler's ``step()`` after every ``opt.step()``."""
    opts = run.opts
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        run.record()


def optimizer_checkpoint(run: Run) -> None:
    """``optimizer.state_dict()`` saved after every step and loaded back, as a resume does."""
    opts = run.opts
    for step in range(run.steps):
        x, y = run.batch(step)
        run.loss(x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        saved = []
        for opt in opts:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            saved.append(torch.load(buffer))
            opt.load_state_dict(saved[-1])
        run.record(saved={f"{k}.{i}.{key}": v for k, s in enumerate(saved)
                          for i, entry in s["state"].items() for key, v in entry.items()})


@dataclass(frozen=True)
class Line:
    loop: Callable[[Run], None]
    optimizer: str  # "sgd" (plain: a missing division shows), "momentum" or "adamw" (state)


LINES: dict[str, Line] = {
    "clip_grad_norm": Line(clip_grad_norm, "sgd"),
    "ema_after_step": Line(ema_after_step, "sgd"),
    "save_module_state": Line(save_module_state, "momentum"),
    "eval_forward": Line(eval_forward, "sgd"),
    "lr_after_backward": Line(lr_after_backward, "momentum"),
    "grad_scaler": Line(grad_scaler, "sgd"),
    "accumulate_no_sync": Line(accumulate_no_sync, "sgd"),
    "accumulate_sync_flag": Line(accumulate_sync_flag, "sgd"),
    "grad_norm_logged": Line(grad_norm_logged, "sgd"),
    "zero_grad_keep": Line(zero_grad_keep, "momentum"),
    "skipped_step": Line(skipped_step, "adamw"),
    "read_params": Line(read_params, "sgd"),
    "lr_scheduler": Line(lr_scheduler, "momentum"),
    "optimizer_checkpoint": Line(optimizer_checkpoint, "adamw"),
}


# -- the modes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """How OverlapDDP is set up; its reference is stock DDP with the same loop unless said otherwise."""

    attach: dict[str, bool] | None = None  # attach_optimizer's switches; None: no optimizer attached
    muon: bool = False  # Muon on the hidden 2-D weights and AdamW on the rest, instead of the line's optimizer
    tokens: bool = False  # count_tokens; the reference divides by the global count in a hook
    tuned: bool = False  # bucket_plan="tuned"; the reference reduces by hand in the layouts it used
    precision: bool = False  # mixed_precision=PRECISION; the reference casts and reduces by hand likewise
    compile_width: int | None = None  # torch.compile(wrapper) over Net(width); None: not compiled
    world_sizes: tuple[int, ...] = WORLD_SIZES
    lines: tuple[str, ...] = tuple(LINES)


# The modes (docs/loop_contract.md describes each with its reference).
MODES: dict[str, Mode] = {
    "default": Mode(),  # OverlapDDP(net)
    "guard": Mode(attach={}),  # model.attach_optimizer(opt)
    "overlap": Mode(attach={"overlap": True}),
    "shard": Mode(attach={"shard": True}),
    "shard_muon": Mode(attach={"shard": True}, muon=True),  # Muon and AdamW, each attached with shard=True
    "count_tokens": Mode(tokens=True),
    "tuned": Mode(tuned=True, world_sizes=(3,)),  # at 2 ranks gloo's sums do not depend on the layout
    # model.module alone cannot run on float32 inputs with bfloat16 buffers (nor under DDP).
    "mixed_precision": Mode(precision=True, lines=tuple(line for line in LINES if line != "eval_forward")),
    # Compiling takes seconds per model: one line each, at one world size.
    "compile": Mode(compile_width=16, world_sizes=(2,), lines=("clip_grad_norm",)),  # one bucket
    "compile_buckets": Mode(compile_width=400, world_sizes=(2,), lines=("accumulate_no_sync",)),  # cap 1 MiB: two
}


@dataclass(frozen=True)
class Raise:
    """A cell that must raise: at which loop line (its text), with what message start and fix."""

    at: str
    message: str  # the message's start; ``{rank}`` stands for the rank
    fix: str  # a part of the message that says what to do


OVERLAP_CONTRACT = "parameters read between backward and step() already hold their updated values"

# Every cell that raises, in one table (docs/loop_contract.md is generated from it).
RAISES: dict[tuple[str, str], Raise] = {
    ("clip_grad_norm", "overlap"): Raise(
        "opt.step()", "Gradients were changed in place after the overlapped updates had already run on rank {rank}",
        "Pass max_grad_norm to attach_optimizer(..., overlap=True) to clip"),
    ("grad_scaler", "overlap"): Raise(
        "scaler.step(opt)", "GradScaler.step(optimizer) on rank {rank}: with attach_optimizer(overlap=True) the updates "
        "already ran during backward", "Pass it as attach_optimizer(optimizer, overlap=True, scaler=scaler)"),
    ("lr_after_backward", "overlap"): Raise(
        "opt.step()", "optimizer.step() on rank {rank}: param_groups[0]['lr'] is",
        "set hyperparameters (an lr, an LR scheduler's step()) before backward"),
    ("skipped_step", "overlap"): Raise(
        "opt.zero_grad()", "optimizer.zero_grad() on rank {rank}: the last backward already updated the parameters",
        "Call step() after every synchronized backward"),
}

# Cells whose difference is the mode's stated contract: (line, mode) -> the sentence in the mode's docstring.
CONTRACT: dict[tuple[str, str], str] = {("read_params", "overlap"): OVERLAP_CONTRACT}


@dataclass(frozen=True)
class Cell:
    """One loop line in one mode at one world size (its name is its test's id)."""

    line: str
    mode: str
    world_size: int
    planted: str | None = None  # a PLANTED fault applied around the candidate

    @property
    def name(self) -> str:
        return f"ws{self.world_size}-{self.mode}-{self.line}" + (f"-PLANTED:{self.planted}" if self.planted else "")


def cells(world_size: int) -> list[Cell]:
    """Every cell at ``world_size``: each mode's lines, then the planted faults (at 2 ranks)."""
    found = [Cell(line, name, world_size) for name, mode in MODES.items() if world_size in mode.world_sizes
             for line in mode.lines]
    if world_size == min(WORLD_SIZES):
        found += [Cell(line, mode, world_size, planted) for planted, (line, mode, _) in PLANTED.items()]
    return found


def expected(cell: Cell) -> str:
    """The outcome a cell must have: ``raises``, ``contract`` or ``equal`` (a planted one: ``silent``)."""
    if cell.planted is not None:
        return "silent"
    key = (cell.line, cell.mode)
    return "raises" if key in RAISES else "contract" if key in CONTRACT else "equal"


# -- building and training one side of a cell ------------------------------------------------------


def _optimizers(line: Line, mode: Mode, module: nn.Module) -> list[torch.optim.Optimizer]:
    if mode.muon:
        hidden = [module.h1.weight, module.h2.weight]
        rest = [p for p in module.parameters() if all(p is not h for h in hidden)]
        return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-3)]
    params = module.parameters()
    if line.optimizer == "sgd":
        return [torch.optim.SGD(params, lr=LR)]
    if line.optimizer == "momentum":
        return [torch.optim.SGD(params, lr=LR, momentum=0.9)]
    return [torch.optim.AdamW(params, lr=1e-2)]


class ByHand(nn.Module):
    """Stock DDP's arithmetic written out, reducing in given layouts (stock DDP takes no layout, and
    runs ``mixed_precision`` only on CUDA): buffers broadcast from rank 0 at each forward after a
    synchronized one; at the end of a synchronized backward, bucket by bucket in the next layout of
    ``layouts`` (the last one repeats), each gradient times ``1 / world_size`` (DDP's ``mul_out``)
    SUM-all-reduced. With ``precision``, DDP's casts instead (as tests/support/precision_reference.py): each
    forward runs on ``param_dtype`` copies of the parameters (and their accumulated gradients) and
    inputs; each bucket is cast to ``reduce_dtype``, summed and divided by the world size in it."""

    def __init__(self, net: nn.Module, layouts: list[list[list[int]]], precision: _MixedPrecision | None) -> None:
        super().__init__()
        self.module = net
        self.layouts = layouts
        self.precision = precision
        self.require_backward_grad_sync = True
        self._sync_buffers = True  # DDP's require_forward_param_sync
        self._reductions = 0
        self._full: dict[nn.Parameter, torch.Tensor] = {}  # full-precision values while the copies are in use
        for b in net.buffers() if precision is not None else ():
            b.data = b.to(precision.buffer_dtype)
        for p in net.parameters():
            dist.broadcast(p.detach(), 0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._sync_buffers:
            for b in self.module.buffers():
                dist.broadcast(b, 0)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers = sync
        if self.precision is not None and torch.is_grad_enabled():
            dtype = self.precision.param_dtype
            for p in self.module.parameters():
                full = self._full.setdefault(p, p.data)
                if p.grad is not None:
                    p.grad.data = p.grad.to(dtype)
                p.data = full.to(dtype)
            x = x.to(dtype)
        output = self.module(x)
        return _AtEndOfBackward.apply(self._reduce, output) if sync else output

    def _reduce(self) -> None:
        layout = self.layouts[min(self._reductions, len(self.layouts) - 1)]
        self._reductions += 1
        params = [p for p in self.module.parameters() if p.requires_grad]
        reduced: dict[int, torch.Tensor] = {}
        for members in layout:
            grads = [params[i].grad for i in members]
            if self.precision is None:
                flat = torch.empty(sum(g.numel() for g in grads))
                for g, view in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                    torch.mul(g, 1.0 / dist.get_world_size(), out=view.view_as(g))
            else:
                flat = torch.cat([g.reshape(-1) for g in grads]).to(self.precision.reduce_dtype)
            dist.all_reduce(flat)
            if self.precision is not None:
                flat.div_(dist.get_world_size())
            reduced.update(zip(members, flat.split([g.numel() for g in grads]), strict=True))
        for p, full in self._full.items():  # full precision again, before the gradients take its dtype
            p.data = full
        self._full = {}
        for i, flat_grad in reduced.items():
            params[i].grad = flat_grad.view_as(params[i]).to(params[i].dtype)


class _AtEndOfBackward(torch.autograd.Function):
    """Identity whose backward queues ``callback`` to run when the whole backward has finished."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], x: torch.Tensor) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        torch.autograd.Variable._execution_engine.queue_callback(ctx.callback)
        return None, grad


def _wrap(mode: Mode, candidate: bool, layouts: list[list[list[int]]]) -> Any:
    """The model as the user holds it: OverlapDDP (the candidate) or the mode's reference."""
    net = Net(mode.compile_width or 16)
    if mode.compile_width is not None:
        torch._dynamo.reset()  # each side traces its own frames (OverlapDDP cuts them at its buckets)
        cap = 1.0 if mode.compile_width > 16 else None  # stock DDP's compiled splitter needs cap >= 1 MiB
        wrapper = OverlapDDP if candidate else DistributedDataParallel
        return torch.compile(wrapper(net, bucket_cap_mb=cap), backend="aot_eager")
    if candidate:
        return OverlapDDP(net, bucket_cap_mb=CAP_MB, bucket_plan="tuned" if mode.tuned else "ddp",
                          mixed_precision=PRECISION if mode.precision else None)
    if mode.tuned or mode.precision:
        return ByHand(net, layouts, PRECISION if mode.precision else None)
    return DistributedDataParallel(net, bucket_cap_mb=CAP_MB)


@dataclass
class Side:
    """One side of a cell after training: what it recorded, where it raised, the layouts it used."""

    trace: list[dict[str, torch.Tensor]]
    error: dict[str, Any] | None
    layouts: list[list[list[int]]]


def _record_layout(used: list[list[list[int]]]) -> Callable[..., None]:
    """A forward hook that appends the layout a synchronized forward installed for its backward."""
    def hook(model: OverlapDDP, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            used.append(model.bucket_indices())
    return hook


def train(cell: Cell, rank: int, candidate: bool, layouts: list[list[list[int]]]) -> Side:
    """Build one side of ``cell`` and run its loop; an error stops it and is kept with the loop line it
    surfaced at (the innermost frame of the loop's own function)."""
    line, mode = LINES[cell.line], MODES[cell.mode]
    model = _wrap(mode, candidate, layouts)
    opts = _optimizers(line, mode, module_of(model))
    used: list[list[list[int]]] = []
    if candidate:
        ours = getattr(model, "_orig_mod", model)
        ours.register_forward_hook(_record_layout(used))
        for opt in opts if mode.attach is not None else ():
            ours.attach_optimizer(opt, **mode.attach)
    tokens = TokenCounts() if mode.tokens else None
    if tokens is not None and not candidate:
        model.register_comm_hook(tokens.state, hooks.divide_by_total_hook)
    run = Run(model, opts, rank, TUNED_STEPS if mode.tuned else STEPS, tokens)
    error = None
    with PLANTED[cell.planted][2]() if candidate and cell.planted else contextlib.nullcontext():
        try:
            line.loop(run)
        except Exception as raised:
            frames = [f for f in traceback.extract_tb(raised.__traceback__)
                      if f.filename == __file__ and f.name == line.loop.__name__]
            error = {"type": type(raised).__name__, "message": str(raised), "step": len(run.trace),
                     "at": frames[-1].line if frames else None, "where": traceback.format_exc()[-3000:]}
    return Side(run.trace, error, used)


def compare(ours: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]) -> list[str]:
    """Every (step, key) that differs over the steps both recorded: a missing key or a tensor not ``torch.equal``."""
    found = []
    for step, (a, b) in enumerate(zip(ours, reference, strict=False)):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b or a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
                found.append(f"step {step}: {key}")
    return found


def reads_hold_new_values(ours: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]) -> bool:
    """Whether every parameter ours read before a step equals the reference's parameter after that step."""
    pairs = [(a[key], b["module." + key.removeprefix("read.params.")])
             for a, b in zip(ours, reference, strict=False) for key in a if key.startswith("read.params.")]
    return bool(pairs) and all(torch.equal(x, y) for x, y in pairs)


def run_cell(rank: int, cell: Cell) -> dict[str, Any]:
    """Train the candidate, then the reference (in the layouts the candidate used), and say what differs."""
    ours = train(cell, rank, candidate=True, layouts=[])
    reference = train(cell, rank, candidate=False, layouts=ours.layouts)
    return {
        "error": ours.error,
        "reference_error": reference.error,
        "steps": (len(ours.trace), len(reference.trace)),
        "differences": compare(ours.trace, reference.trace),
        "reads_hold_new_values": reads_hold_new_values(ours.trace, reference.trace),
    }


def run_cells(rank: int, world_size: int, chosen: list[Cell]) -> dict[str, dict[str, Any]]:
    """Every chosen cell at this world size, in one spawn."""
    found: dict[str, dict[str, Any]] = {}
    for cell in chosen:
        started = time.perf_counter()
        try:
            found[cell.name] = run_cell(rank, cell)
        except Exception:  # the harness itself (a planted fault that no longer applies, a reference)
            found[cell.name] = {"crash": traceback.format_exc()[-3000:]}
        found[cell.name]["seconds"] = time.perf_counter() - started
    return found


# -- judging ---------------------------------------------------------------------------------------


def judge(cell: Cell, rank: int, found: dict[str, Any]) -> tuple[str, str]:
    """The cell's outcome on one rank (``equal``, ``raises``, ``contract`` or ``silent``; ``crash``
    when the harness failed) and why."""
    key = (cell.line, cell.mode)
    if "crash" in found:
        return "crash", f"the harness failed: {found['crash']}"
    if found["reference_error"] is not None:
        return "silent", f"the reference raised (a harness fault): {found['reference_error']['where']}"
    error, differences = found["error"], found["differences"]
    if error is not None:
        expect = RAISES.get(key)
        said = f"{error['type']} at {error['at']!r} (step {error['step']}): {error['message'][:400]}"
        if expect is None:
            return "silent", f"raised where nothing should: {said}\n{error['where']}"
        if error["at"] != expect.at:
            return "silent", f"raised at {error['at']!r}, not at {expect.at!r}: {said}"
        if not error["message"].startswith(expect.message.format(rank=rank)) or expect.fix not in error["message"]:
            return "silent", f"the message does not start with {expect.message!r} or lacks {expect.fix!r}: {said}"
        if differences:
            return "silent", f"raised, but already differed before: {differences[:5]}"
        return "raises", said
    if found["steps"][0] != found["steps"][1]:
        return "silent", f"recorded {found['steps'][0]} steps, the reference {found['steps'][1]}"
    if not differences:
        return "equal", ""
    if key in CONTRACT and all(d.split(": ", 1)[1].startswith("read.") for d in differences) \
            and found["reads_hold_new_values"]:
        return "contract", f"the reads hold the new values: {differences[:3]}"
    return "silent", f"different numbers, no error: {differences[:8]} ({len(differences)} in all)"


# -- planted faults: each kind of expectation turns silent when the library stops keeping it -------


@contextlib.contextmanager
def _no_division() -> Iterator[None]:
    """The reduction sums without dividing by the world size."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reduction.BucketReduction, "_divisor", lambda self: 1)
        yield


@contextlib.contextmanager
def _in_place_changes_unchecked() -> Iterator[None]:
    """The overlapped optimizer forgets the gradients' versions, so a later clip goes unnoticed."""
    all_taken = overlap.OverlappedOptimizer.all_taken

    def forgetting(self: overlap.OverlappedOptimizer) -> None:
        all_taken(self)
        self._versions = []

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(overlap.OverlappedOptimizer, "all_taken", forgetting)
        yield


# name -> (line, mode, fault): an equal cell, a raising cell and a contract cell, each broken.
PLANTED: dict[str, tuple[str, str, Callable[[], contextlib.AbstractContextManager[None]]]] = {
    "no_division": ("eval_forward", "default", _no_division),
    "clip_unchecked": ("clip_grad_norm", "overlap", _in_place_changes_unchecked),
    "no_division_under_contract": ("read_params", "overlap", _no_division),
}


# -- the docs table ------------------------------------------------------------------------------


def doc_table() -> str:
    """The table of docs/loop_contract.md: every cell that raises or differs by contract, and what it says."""
    rows = ["| line | mode | raises at | message starts with | and says |", "| --- | --- | --- | --- | --- |"]
    for (line, mode), r in RAISES.items():
        message = r.message.replace("{rank}", "R")
        rows.append(f"| `{line}` | `{mode}` | `{r.at}` | {message} ... | ... {r.fix} ... |")
    for (line, mode), sentence in CONTRACT.items():
        rows.append(f"| `{line}` | `{mode}` | (no error: the mode's contract) | {sentence} | |")
    return "\n".join(rows)
