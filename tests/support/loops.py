"""Training loops DDP users write that are more than forward-backward-step, run with stock DDP and
OverlapDDP side by side and compared with ``torch.equal`` after every backward and every step.

GAN steps (several forwards of one wrapper before one backward, BatchNorm buffers broadcast at
each forward) and reentrant activation checkpointing with ``find_unused_parameters=True``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from overlapddp import OverlapDDP
from tests.support.parity import ddp_layout, first_difference, first_grad_difference

STEPS = 4


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- GAN steps ---------------------------------------------------------------------------------------


def generator() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6))


def discriminator() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


class Gan(nn.Module):
    """Both networks in one module (one wrapper): ``part`` picks the generator or the discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.g = generator()
        self.d = discriminator()

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.g(x) if part == "g" else self.d(x)


@dataclass(frozen=True)
class GanCase:
    name: str
    joint: bool = False  # one wrapper around both networks (needs find_unused_parameters)
    kwargs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)


GAN_CASES = [
    GanCase("gan-separate"),
    GanCase("gan-separate-no-broadcast", kwargs=(("broadcast_buffers", False),)),
    GanCase("gan-joint", joint=True, kwargs=(("find_unused_parameters", True),)),
]


def _gan_models(wrap: Callable[..., nn.Module], case: GanCase) -> tuple[Callable, Callable, list[nn.Module]]:
    kwargs = dict(case.kwargs)
    if case.joint:
        model = wrap(Gan(), **kwargs)
        return (lambda z: model(z, "g")), (lambda x: model(x, "d")), [model]
    g, d = wrap(generator(), **kwargs), wrap(discriminator(), **kwargs)
    return g, d, [g, d]


def run_gan(rank: int, world_size: int, case: GanCase) -> str | None:
    """The first difference between DDP and OverlapDDP (``None`` if every step was equal): per step the
    discriminator sees the fakes, then real data, with one backward; then the generator's step."""
    pairs = []
    for wrap in (DistributedDataParallel, OverlapDDP):
        g, d, wrappers = _gan_models(wrap, case)
        net = wrappers[0].module
        g_params = net.g.parameters() if case.joint else wrappers[0].module.parameters()
        d_params = net.d.parameters() if case.joint else wrappers[1].module.parameters()
        pairs.append((g, d, wrappers, torch.optim.SGD(g_params, lr=0.1), torch.optim.SGD(d_params, lr=0.1)))
    for step in range(STEPS):
        z, real = _seeded(100 * step + rank, 5, 4), _seeded(100 * step + rank + 50, 5, 6) + 1
        for phase in ("d", "g"):
            for g, d, _, g_opt, d_opt in pairs:
                fake = g(z)
                if phase == "d":
                    loss = (d(fake.detach()) ** 2).mean() + ((d(real) - 1) ** 2).mean()
                    d_opt.zero_grad()
                else:
                    loss = ((d(fake) - 1) ** 2).mean()
                    g_opt.zero_grad()
                loss.backward()
            for a, b in zip(pairs[0][2], pairs[1][2], strict=True):
                difference = first_grad_difference(a.module, b.module)
                if difference is not None:
                    return f"step {step} {phase}: {difference}"
            for _, _, _, g_opt, d_opt in pairs:
                (d_opt if phase == "d" else g_opt).step()
        for a, b in zip(pairs[0][2], pairs[1][2], strict=True):
            difference = first_difference(a.module, b.module)
            if difference is not None:
                return f"step {step}: {difference}"
    return None


# -- reentrant activation checkpointing --------------------------------------------------------------


class Segmented(nn.Module):
    """Two checkpointed segments that share a layer (with ``shared``: its gradient arrives twice in one
    reentrant backward), a layer used on some steps only (rank-dependent), one never used."""

    def __init__(self, reentrant: bool, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.reentrant = reentrant
        self.uses_shared = shared
        self.stem = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def _segment_a(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(self.a(h))))

    def _segment_b(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(self.shared(h) if self.uses_shared else h))

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = self.stem(x)
        h = checkpoint(self._segment_a, h, use_reentrant=self.reentrant)
        h = checkpoint(self._segment_b, h, use_reentrant=self.reentrant)
        if use_sometimes:
            h = checkpoint(self.sometimes, h, use_reentrant=self.reentrant)
        return self.head(h)


@dataclass(frozen=True)
class CheckpointCase:
    name: str
    reference: tuple[tuple[str, Any], ...]  # stock DDP's arguments
    reference_reentrant: bool
    dynamic: bool  # whether ``sometimes`` is used on some steps only (rank-dependent)
    shared: bool = True
    accumulate: int = 1  # micro-steps per step, all but the last under no_sync()
    candidate: tuple[tuple[str, Any], ...] = (("find_unused_parameters", True),)  # OverlapDDP's arguments
    bucket_cap_mb: float | None = None  # both wrappers'
    momentum: float = 0.0


CHECKPOINT_CASES = [
    # The same graph every step: DDP runs reentrant checkpointing with static_graph=True (not under
    # no_sync, where it fails an internal assert).
    CheckpointCase("ckpt-static", (("static_graph", True),), True, dynamic=False),
    # A graph that changes: DDP needs use_reentrant=False (the same arithmetic without no_sync; with
    # no_sync the shared layer would accumulate in another order there, so it is left out).
    CheckpointCase("ckpt-dynamic", (("find_unused_parameters", True),), False, dynamic=True),
    CheckpointCase("ckpt-dynamic-no_sync", (("find_unused_parameters", True),), False, dynamic=True, shared=False,
                   accumulate=2),
    # Small buckets (two of about 1 KB), momentum, the same graph every step, compared at every step
    # at 3 ranks too. Each mode against DDP in the same mode: find_unused_parameters=True keeps the
    # constructor's cap-sized buckets for good (DDP where it runs the graph: without reentrancy);
    # static_graph=True starts from one bucket and rebuilds it in ready order after iteration 2.
    # (Across the modes the layouts differ, so from 3 ranks on the sums differ, in DDP too.)
    CheckpointCase("ckpt-find_unused-small-buckets", (("find_unused_parameters", True),), False, dynamic=False,
                   bucket_cap_mb=0.001, momentum=0.9),
    CheckpointCase("ckpt-static-small-buckets", (("static_graph", True),), True, dynamic=False,
                   candidate=(("static_graph", True),), bucket_cap_mb=0.001, momentum=0.9),
]


def run_checkpointed(rank: int, world_size: int, case: CheckpointCase) -> str | None:
    """OverlapDDP (``case.candidate``, reentrant checkpoints) against ``case``'s stock DDP: the first
    difference in values or bucket layout, or ``None``.

    DDP with static_graph=True rebuilds its buckets in gradient-ready order after iteration 2, which
    find_unused_parameters=True never does (in DDP either). From 3 ranks on gloo's sum of an element
    depends on its offset in the bucket, so where the two wrappers run different modes only the steps
    before that rebuild are compared (and only with buckets large enough to hold every parameter,
    where the modes start from the same layout); wrappers in the same mode are compared at every
    step, their layouts too."""
    cap = case.bucket_cap_mb
    reference = DistributedDataParallel(Segmented(case.reference_reentrant, case.shared), bucket_cap_mb=cap,
                                        **dict(case.reference))
    candidate = OverlapDDP(Segmented(True, case.shared), bucket_cap_mb=cap, **dict(case.candidate))
    pairs = [(w, torch.optim.SGD(w.parameters(), lr=0.1, momentum=case.momentum)) for w in (reference, candidate)]
    same_mode = dict(case.reference).get("static_graph", False) == dict(case.candidate).get("static_graph", False)
    rebuilds = not same_mode and world_size > 2
    for step in range(2 if rebuilds else STEPS):
        for wrapper, _ in pairs:
            for micro in range(case.accumulate):
                seed = 1000 * step + 10 * micro + rank
                x, target = _seeded(seed, 4, 8), _seeded(seed + 5, 4, 3)
                use = case.dynamic and (step + micro + rank) % 2 == 1
                if micro < case.accumulate - 1:
                    with wrapper.no_sync():
                        ((wrapper(x, use) - target) ** 2).mean().backward()
                else:
                    ((wrapper(x, use) - target) ** 2).mean().backward()
        difference = first_grad_difference(reference.module, candidate.module)
        for _, opt in pairs:
            opt.step()
            opt.zero_grad()
        difference = difference or first_difference(reference.module, candidate.module)
        if difference is None and same_mode and ddp_layout(reference) != candidate.bucket_indices():
            difference = f"buckets {candidate.bucket_indices()}, DDP's {ddp_layout(reference)}"
        if difference is not None:
            return f"step {step}: {difference}"
    return None


def run_every_loop(rank: int, world_size: int) -> dict[str, str | None]:
    """Every case in one spawn: per case, the first difference or the error it raised."""
    found: dict[str, str | None] = {}
    for case in GAN_CASES:
        found[case.name] = _outcome(run_gan, rank, world_size, case)
    for case in CHECKPOINT_CASES:
        found[case.name] = _outcome(run_checkpointed, rank, world_size, case)
    return found


def _outcome(run: Callable[[int, int, Any], str | None], rank: int, world_size: int, case: Any) -> str | None:
    try:
        return run(rank, world_size, case)
    except RuntimeError as error:
        return f"raised: {str(error)[:300]}"
