"""Train stock DDP and OverlapDDP side by side on each rank and compare them after every step.

Both wrap identical copies of one model, see the same rank-dependent batches and use the same
optimizer; after every step every parameter and buffer is compared with ``torch.equal`` and the
bucket layouts are compared index by index.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.torch_compat import ddp_accepts
from tests.support import faults, hooks, models
from tests.support.multiprocess import DEFAULT_TIMEOUT_S, run_ranks


@dataclass(frozen=True)
class Scenario:
    model: str
    optimizer: str = "sgd"
    bucket_cap_mb: float | None = None
    steps: int = 5
    fault: str | None = None
    # Micro-steps per optimizer step; all but the last skip the reduction, through ``no_sync()`` or
    # by assigning ``require_backward_grad_sync`` (as nanoGPT does).
    accumulate: int = 1
    skip_sync_by: str = "no_sync"
    ddp_kwargs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    # A communication hook from ``tests.support.hooks.HOOKS``, registered on both wrappers.
    hook: str | None = None
    # ``optimizer.zero_grad(set_to_none=...)``: False keeps gradient tensors (and bucket views) alive.
    set_to_none: bool = True

    @property
    def name(self) -> str:
        cap = "default" if self.bucket_cap_mb is None else f"cap{self.bucket_cap_mb}"
        extra = "".join(f"-{k}={v}" for k, v in self.ddp_kwargs)
        if self.hook is not None:
            extra += f"-hook={self.hook}"
        if self.accumulate > 1:
            extra += f"-accumulate{self.accumulate}-{self.skip_sync_by}"
        if not self.set_to_none:
            extra += "-keep_grads"
        return f"{self.model}-{self.optimizer}-{cap}{extra}" + (f"-FAULT:{self.fault}" if self.fault else "")


def missing_for(scenario: Scenario) -> list[str]:
    """What the installed torch lacks for ``scenario``: DDP arguments (older releases lack some), or
    torchvision (a new torch release can come before its torchvision)."""
    missing = [name for name, _ in scenario.ddp_kwargs if not ddp_accepts(name)]
    if scenario.model == "resnet18" and importlib.util.find_spec("torchvision") is None:
        missing.append("torchvision")
    return missing


@dataclass
class Outcome:
    """What one rank saw: per step, whether all state was equal and whether the layouts matched."""

    equal: list[bool]
    layouts_equal: list[bool]
    first_difference: str | None
    ddp_layouts: list[list[list[int]]]


def ddp_layout(ddp: DistributedDataParallel) -> list[list[int]]:
    """DDP's current buckets as lists of parameter indices, read from its reducer."""
    index = {id(p): i for i, p in enumerate(p for p in ddp.module.parameters() if p.requires_grad)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def first_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=False):
        if not torch.equal(x, y):
            return name
    return None


def first_grad_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """The first parameter whose reduced gradient differs (a missing gradient counts as a difference)."""
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=False):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
            return f"{name}.grad"
    return None


@contextmanager
def skipping_sync(wrapper: torch.nn.Module, how: str, skip: bool) -> Iterator[None]:
    """Run one micro-step without gradient reduction when ``skip``, the way a user would."""
    if not skip:
        yield
    elif how == "no_sync":
        with wrapper.no_sync():
            yield
    else:
        wrapper.require_backward_grad_sync = False
        yield
        wrapper.require_backward_grad_sync = True


def run_scenarios(rank: int, world_size: int, scenarios: list[Scenario]) -> list[Outcome]:
    return [run_scenario(rank, s) for s in scenarios]


def outcomes_by_scenario(
    world_size: int, scenarios: list[Scenario], timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[Scenario, list[Outcome]]:
    """Every scenario in one process group of ``world_size`` ranks: per scenario, each rank's outcome."""
    per_rank = run_ranks(world_size, run_scenarios, scenarios, timeout_s=timeout_s)
    return {s: [rank[i] for rank in per_rank] for i, s in enumerate(scenarios)}


def run_scenario(rank: int, scenario: Scenario) -> Outcome:
    kwargs = dict(scenario.ddp_kwargs)
    spec = hooks.HOOKS[scenario.hook] if scenario.hook is not None else None
    reference = DistributedDataParallel(models.build(scenario.model), bucket_cap_mb=scenario.bucket_cap_mb, **kwargs)
    ref_averager = hooks.register(reference, spec, is_reference=True) if spec is not None else None
    with faults.injected(scenario.fault):
        candidate = OverlapDDP(models.build(scenario.model), bucket_cap_mb=scenario.bucket_cap_mb, **kwargs)
        cand_averager = hooks.register(candidate, spec, is_reference=False) if spec is not None else None
        ref_opt = models.optimizer(scenario.optimizer, reference.parameters())
        cand_opt = models.optimizer(scenario.optimizer, candidate.parameters())
        outcome = Outcome([], [], None, [])
        pairs = ((reference, ref_opt, ref_averager), (candidate, cand_opt, cand_averager))
        for step in range(scenario.steps):
            for wrapper, _, _ in pairs:
                for micro in range(scenario.accumulate):
                    inputs, target = models.batch(scenario.model, rank, step * scenario.accumulate + micro)
                    with skipping_sync(wrapper, scenario.skip_sync_by, micro < scenario.accumulate - 1):
                        models.loss_of(wrapper(inputs), target).backward()
            grad_difference = first_grad_difference(reference, candidate)
            for wrapper, opt, averager in pairs:
                opt.step()
                if averager is not None:  # before zero_grad: it averages the parameters that have grads
                    averager.average_parameters(wrapper.parameters())
                opt.zero_grad(set_to_none=scenario.set_to_none)
            layout = ddp_layout(reference)
            outcome.ddp_layouts.append(layout)
            outcome.layouts_equal.append(layout == candidate.bucket_indices())
            difference = grad_difference or first_difference(reference, candidate)
            outcome.equal.append(difference is None)
            if difference is not None and outcome.first_difference is None:
                outcome.first_difference = f"step {step}: {difference}"
    return outcome
