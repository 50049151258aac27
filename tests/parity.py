"""Train stock DDP and OverlapDDP side by side on each rank and compare them after every step.

Both wrap identical copies of one model, see the same rank-dependent batches and use the same
optimizer; after every step every parameter and buffer is compared with ``torch.equal`` and the
bucket layouts are compared index by index.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests import faults, models


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

    @property
    def name(self) -> str:
        cap = "default" if self.bucket_cap_mb is None else f"cap{self.bucket_cap_mb}"
        extra = "".join(f"-{k}={v}" for k, v in self.ddp_kwargs)
        if self.accumulate > 1:
            extra += f"-accumulate{self.accumulate}-{self.skip_sync_by}"
        return f"{self.model}-{self.optimizer}-{cap}{extra}" + (f"-FAULT:{self.fault}" if self.fault else "")


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
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        if not torch.equal(x, y):
            return name
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


def run_scenario(rank: int, scenario: Scenario) -> Outcome:
    kwargs = dict(scenario.ddp_kwargs)
    reference = DistributedDataParallel(models.build(scenario.model), bucket_cap_mb=scenario.bucket_cap_mb, **kwargs)
    with faults.injected(scenario.fault):
        candidate = OverlapDDP(models.build(scenario.model), bucket_cap_mb=scenario.bucket_cap_mb, **kwargs)
        ref_opt = models.optimizer(scenario.optimizer, reference.parameters())
        cand_opt = models.optimizer(scenario.optimizer, candidate.parameters())
        outcome = Outcome([], [], None, [])
        for step in range(scenario.steps):
            for wrapper, opt in ((reference, ref_opt), (candidate, cand_opt)):
                for micro in range(scenario.accumulate):
                    inputs, target = models.batch(scenario.model, rank, step * scenario.accumulate + micro)
                    with skipping_sync(wrapper, scenario.skip_sync_by, micro < scenario.accumulate - 1):
                        models.loss_of(wrapper(inputs), target).backward()
                opt.step()
                opt.zero_grad()
            layout = ddp_layout(reference)
            outcome.ddp_layouts.append(layout)
            outcome.layouts_equal.append(layout == [list(b) for b in candidate._reducer.plan.buckets])
            difference = first_difference(reference, candidate)
            outcome.equal.append(difference is None)
            if difference is not None and outcome.first_difference is None:
                outcome.first_difference = f"step {step}: {difference}"
    return outcome
