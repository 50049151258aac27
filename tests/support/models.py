"""Small models and rank-dependent batches for parity tests; dropout is off so both copies see the same math."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 50
SEQ = 8


class TinyLM(nn.Module):
    """A small transformer LM: embedding, two encoder layers, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True),
            num_layers=2,
            enable_nested_tensor=False,
        )
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class Branchy(nn.Module):
    """Chooses a head from its input, so ranks leave different parameters unused; one layer is never used.

    ``fixed`` always takes ``head_a``: then every rank leaves the same parameters unused.
    """

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.trunk = nn.Linear(16, 32)
        self.head_a = nn.Linear(32, 10)
        self.head_b = nn.Linear(32, 10)
        self.never = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        return self.head_a(hidden) if self.fixed or x[0, 0] > 0 else self.head_b(hidden)


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing (which needs static_graph) and a layer that is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 10)
        self.never = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


class RankOrdered(nn.Module):
    """Two square layers whose order depends on the rank: rank 0 computes ``b(a(x))``, the others
    ``a(b(x))``, so their gradients become ready in different orders (b's first on rank 0, a's first
    elsewhere). DDP builds every rank's buckets from rank 0's order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if dist.get_rank() == 0 else (self.b, self.a)
        return second(torch.tanh(first(x)))


class DeepMLP(nn.Module):
    """Wide layers (2.4 MiB in all) in a user-defined forward, so that ``torch.compile`` traces it as one
    frame and DDP's splitter cuts it at ``bucket_cap_mb=1``; ``tangle`` adds a non-reentrant
    checkpoint and a graph break."""

    def __init__(self, width: int = 384, tangle: bool = False) -> None:
        super().__init__()
        self.tangle = tangle
        self.stem = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Unrolled: Dynamo gives up on a whole frame whose loop holds a graph break.
        x = torch.relu(self.layers[0](torch.relu(self.stem(x))))
        if self.tangle:
            x = checkpoint(_tanh_layer, self.layers[1], x, use_reentrant=False)
        else:
            x = torch.relu(self.layers[1](x))
        x = torch.relu(self.layers[2](x))
        if self.tangle:
            torch._dynamo.graph_break()
        return self.head(torch.relu(self.layers[3](x)))


class WithEmptyParameters(nn.Module):
    """Parameters of 0 elements, used (so DDP's optimizer steps them), of shapes (0,), (0, 4) and
    (4, 0). Before the rebuild (one bucket, 2796 elements, registration order) they lie at its start,
    in its middle and at its end; after it (``bucket_cap_mb=0.01``, ready order) at the start and in
    the middle of the first bucket, and ``alone``, ready last, in a bucket of 0 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.zeros(0))
        self.alone = nn.Parameter(torch.zeros(0))
        self.hidden = nn.Linear(16, 96)
        self.middle = nn.ParameterList([nn.Parameter(torch.zeros(0, 4))])  # registered after hidden
        self.out = nn.Linear(96, 12)
        self.last = nn.ParameterList([nn.Parameter(torch.zeros(4, 0))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(x * (1 + self.alone.sum())) + self.middle[0].sum())
        return self.out(hidden) + self.first.sum() + self.last[0].sum()


class ScaledMLP(nn.Module):
    """An MLP whose output is scaled by a learned scalar: with tiny buckets the scalar is a bucket of
    1 element, which at 2 or 3 ranks leaves all but one rank only padding of that bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _tanh_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(x))


# The models that are classes of their own, by name.
_CLASSES: dict[str, Callable[[], nn.Module]] = {
    "transformer": TinyLM,
    "branchy": Branchy,
    "branchy_fixed": lambda: Branchy(fixed=True),
    "checkpointed": Checkpointed,
    "rank_ordered": RankOrdered,
    "deep_mlp": DeepMLP,
    "tangled_mlp": lambda: DeepMLP(tangle=True),
    "empty_parameters": WithEmptyParameters,
    "scaled_mlp": ScaledMLP,
}


def build(name: str) -> nn.Module:
    """The model called ``name``, initialized from a fixed seed (identical on every call)."""
    torch.manual_seed(0)
    if name in _CLASSES:
        return _CLASSES[name]()
    if name == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "cnn_bn":
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )
    if name == "resnet18":
        import torchvision  # only here: a torch release can come before its torchvision

        return torchvision.models.resnet18(num_classes=10)
    if name == "cnn_frozen":  # a parameter that needs no gradient (still broadcast at construction)
        model = build("cnn_bn")
        model[0].weight.requires_grad_(False)
        return model
    if name == "cnn_channels_last":  # parameters with channels_last strides, kept inside the buckets
        return build("cnn_bn").to(memory_format=torch.channels_last)
    if name == "tied_lm":  # one parameter shared by the embedding and the head
        model = TinyLM()
        model.head.weight = model.embed.weight
        return model
    raise ValueError(f"unknown test model {name!r}")


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets that differ per rank and per step, the same for every wrapper."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("mlp", "branchy", "branchy_fixed", "checkpointed", "rank_ordered", "deep_mlp", "tangled_mlp",
                "empty_parameters", "scaled_mlp"):
        return torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    if name in ("cnn_bn", "cnn_frozen", "cnn_channels_last"):
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    if name == "resnet18":
        return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    if name in ("transformer", "tied_lm"):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    raise ValueError(f"unknown test model {name!r}")


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}")


def train_side_by_side(name: str, rank: int, steps: int, reference: nn.Module, candidate: nn.Module) -> list[bool]:
    """Train both wrappers on the same batches with SGD-momentum; per step, whether every parameter
    and buffer is bit-equal (``torch.equal``)."""
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (reference, candidate)]
    equal = []
    for step in range(steps):
        inputs, target = batch(name, rank, step)
        for wrapper, opt in pairs:
            loss_of(wrapper(inputs), target).backward()
            opt.step()
            opt.zero_grad()
        equal.append(all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), candidate.state_dict().values(), strict=False)))
    return equal
