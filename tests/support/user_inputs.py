"""The inputs and outputs DDP users feed and return, run with stock DDP and OverlapDDP side by side.

One model, ``Tagger``, in several calling conventions (``FORMS``): flat tensors; keyword arguments;
nested lists, tuples, named tuples and dicts; dataclasses. Each form takes int64 indices (into an
``nn.Embedding``), a bool mask and floating features, and returns, next to the logits the loss is
computed from, int64 predictions, bool masks, ``None`` and, in the ``partial`` form, a second
differentiable output the loss never reaches. Each scenario (a form, a mode, the wrapper's
arguments) trains both wrappers for ``STEPS`` SGD-momentum steps on rank-dependent batches; after
every step each gradient and parameter is compared with ``torch.equal``, and every output leaf,
its container type and its dtype, with DDP's. A scenario DDP refuses must be refused here too.

The modes are the ones that touch inputs or outputs: unused-parameter search (walks the outputs),
the static graph's first iteration and reentrant checkpointing with ``find_unused_parameters``
(both route the outputs through the end-of-backward trigger), mixed precision (casts the inputs)
and ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from overlapddp import OverlapDDP
from tests.support.parity import ddp_layout, first_difference, first_grad_difference

STEPS = 3
VOCAB, WIDTH, SEQ = 12, 8, 5


@dataclass
class Batch:
    feats: torch.Tensor  # float32 [batch, SEQ, 6]
    ids: torch.Tensor  # int64 [batch, SEQ]
    mask: torch.Tensor  # bool [batch, SEQ]


@dataclass
class Prediction:
    logits: torch.Tensor
    labels: torch.Tensor  # int64, no gradient
    aux: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Pair(NamedTuple):
    logits: torch.Tensor
    seen: torch.Tensor  # bool


class Tagger(nn.Module):
    """Embedding of int64 ids plus a projection of float features, a bool mask, a head; ``form``
    picks the calling convention, ``checkpointed`` runs the encoder under a reentrant checkpoint."""

    def __init__(self, form: str, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.form = form
        self.checkpointed = checkpointed
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(6, WIDTH)
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        if form == "partial":  # reaches an output, never the loss
            self.aux_head = nn.Linear(WIDTH, 2)

    def _encode(self, projected: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = (self.emb(ids) + projected).masked_fill(~mask.unsqueeze(-1), 0.0)
        return torch.tanh(self.trunk(h)).mean(dim=1)

    def encode(self, feats: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A reentrant checkpoint needs an input that requires grad (else nothing inside gets a
        gradient): the projection; the int64 ids and the bool mask go in next to it."""
        projected = self.proj(feats)
        if self.checkpointed:
            return checkpoint(self._encode, projected, ids, mask, use_reentrant=True)
        return self._encode(projected, ids, mask)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return FORMS[self.form].forward(self, *args, **kwargs)


@dataclass(frozen=True)
class Form:
    """How a batch is passed in (``call``) and what comes out (``forward``), and the logits in it."""

    call: Callable[[Batch], tuple[tuple[Any, ...], dict[str, Any]]]
    forward: Callable[..., Any]
    logits: Callable[[Any], torch.Tensor]


def _flat_forward(m: Tagger, feats: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    return m.head(m.encode(feats, ids, mask))


def _kwargs_forward(m: Tagger, feats: torch.Tensor, *, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    logits = m.head(m.encode(feats, ids, mask))
    return logits, None, logits.argmax(dim=-1)


def _nested_forward(m: Tagger, inputs: dict[str, Any]) -> Any:
    feats, (ids,) = inputs["x"]
    mask = inputs["m"]["mask"]
    logits = m.head(m.encode(feats, ids, mask))
    return {"out": Pair(logits, mask.any(dim=1)), "rest": [logits.argmax(dim=-1), None, (mask.sum(dim=1),)]}


def _dataclass_forward(m: Tagger, batch: Batch) -> Any:
    logits = m.head(m.encode(batch.feats, batch.ids, batch.mask))
    return Prediction(logits, logits.argmax(dim=-1), None, {"tokens": batch.mask.sum(), "none": None})


def _partial_forward(m: Tagger, feats: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    h = m.encode(feats, ids, mask)
    return m.head(h), m.aux_head(h)  # the loss reads only the first


FORMS: dict[str, Form] = {
    "flat": Form(lambda b: ((b.feats, b.ids, b.mask), {}), _flat_forward, lambda out: out),
    "kwargs": Form(lambda b: ((b.feats,), {"ids": b.ids, "mask": b.mask}), _kwargs_forward, lambda out: out[0]),
    "nested": Form(lambda b: (({"x": [b.feats, (b.ids,)], "m": {"mask": b.mask}},), {}), _nested_forward,
                   lambda out: out["out"].logits),
    "dataclass": Form(lambda b: ((b,), {}), _dataclass_forward, lambda out: out.logits),
    "partial": Form(lambda b: ((b.feats, b.ids, b.mask), {}), _partial_forward, lambda out: out[0]),
}


def batch(rank: int, step: int) -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    size = 3 + rank
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    mask = torch.rand(size, SEQ, generator=g) > 0.3
    feats = torch.randn(size, SEQ, 6, generator=g) * (1 + rank)
    return Batch(feats, ids, mask), torch.randn(size, 3, generator=g)


@dataclass(frozen=True)
class Scenario:
    form: str
    kwargs: tuple[tuple[str, Any], ...] = ()  # both wrappers'
    checkpointed: bool = False  # the candidate's encoder under a reentrant checkpoint
    reference_checkpointed: bool = False  # the same for DDP (DDP cannot with find_unused_parameters)
    reference_form: str | None = None  # where DDP mishandles the form: the same values in another form
    compiled: bool = False  # both modules under torch.compile(backend="aot_eager")
    refused: bool = False  # DDP refuses it (an error at the second iteration): so must OverlapDDP

    @property
    def name(self) -> str:
        mode = ",".join(f"{k}={v}" for k, v in self.kwargs) or "plain"
        extra = ("-reentrant" if self.checkpointed else "") + ("-compiled" if self.compiled else "")
        return f"{self.form}-{mode}{extra}"


UNUSED = (("find_unused_parameters", True),)
STATIC = (("static_graph", True),)
SMALL = (("bucket_cap_mb", 0.0005),)  # several buckets

SCENARIOS = [
    *(Scenario(form) for form in ("flat", "kwargs", "nested", "dataclass")),
    *(Scenario(form, UNUSED + SMALL) for form in ("kwargs", "nested", "dataclass")),
    Scenario("flat", STATIC + SMALL),
    Scenario("kwargs", STATIC),
    Scenario("nested", STATIC + SMALL),
    # DDP's static graph finds the outputs to route through its first-iteration trigger with pytree,
    # which does not look into dataclasses: its first iteration is then never reduced. Reference:
    # DDP on the same values returned in dicts and named tuples.
    Scenario("dataclass", STATIC, reference_form="nested"),
    # An output the loss never reaches: with find_unused_parameters DDP routes every output through
    # its sink, so aux_head's hooks fire with an undefined gradient and its gradient stays None. The
    # static graph does that in its first iteration only: from the second on aux_head's hooks never
    # fire, and DDP raises at the third forward; so does DDP without either flag at the second.
    Scenario("partial", UNUSED + SMALL),
    Scenario("partial", STATIC, refused=True),
    Scenario("partial", (), refused=True),
    # Reentrant checkpoints: with find_unused_parameters (the end-of-backward trigger; DDP runs it
    # only without reentrancy) and with the static graph (DDP runs it reentrant).
    *(Scenario(form, UNUSED + SMALL, checkpointed=True) for form in ("flat", "nested", "dataclass")),
    *(Scenario(form, STATIC + SMALL, checkpointed=True, reference_checkpointed=True) for form in ("kwargs", "nested")),
    Scenario("nested", (), compiled=True),
    Scenario("dataclass", UNUSED, compiled=True),
]


def describe(tree: Any) -> Any:
    """The structure of an output with each tensor's dtype and values (to compare with torch.equal)."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", str(tree.dtype), tree.requires_grad, tree.detach().clone())
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [describe(item) for item in tree])
    if isinstance(tree, dict):
        return ("dict", [(k, describe(v)) for k, v in tree.items()])
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return (type(tree).__name__, [(f.name, describe(getattr(tree, f.name))) for f in dataclasses.fields(tree)])
    return (type(tree).__name__, tree)


def same(a: Any, b: Any) -> bool:
    """Whether two ``describe`` results are equal, tensors compared with ``torch.equal``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _build(wrap: type, scenario: Scenario, form: str, checkpointed: bool) -> nn.Module:
    module: nn.Module = Tagger(form, checkpointed)
    if scenario.compiled:
        module = torch.compile(module, backend="aot_eager")
    return wrap(module, **dict(scenario.kwargs))


def run_scenario(rank: int, scenario: Scenario) -> str | None:
    """The first difference from DDP (values, outputs, layout), a refusal that differs, or None."""
    reference_form = scenario.reference_form or scenario.form
    reference = _build(DistributedDataParallel, scenario, reference_form, scenario.reference_checkpointed)
    candidate = _build(OverlapDDP, scenario, scenario.form, scenario.checkpointed)
    pairs = [(reference, reference_form), (candidate, scenario.form)]
    optimizers = [torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for w, _ in pairs]
    for step in range(STEPS):
        data, target = batch(rank, step)
        outputs, errors = [], []
        for wrapper, form in pairs:
            try:
                args, kwargs = FORMS[form].call(data)
                out = wrapper(*args, **kwargs)
                ((FORMS[form].logits(out) - target) ** 2).mean().backward()
                outputs.append(out)
            except RuntimeError as error:
                errors.append(str(error).split("\n")[0][:200])
        if scenario.refused and len(errors) == 2:
            return None if step > 0 else f"step {step}: both refused at the first iteration: {errors}"
        if errors:
            return f"step {step}: {'only one refused' if scenario.refused else 'raised'}: {errors}"
        if scenario.reference_form is None and not same(describe(outputs[0]), describe(outputs[1])):
            return f"step {step}: outputs differ: {describe(outputs[1])!r:.300}"
        difference = first_grad_difference(reference.module, candidate.module)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        difference = difference or first_difference(reference.module, candidate.module)
        if difference is None and not scenario.compiled and ddp_layout(reference) != candidate.bucket_indices():
            difference = f"buckets {candidate.bucket_indices()}, DDP's {ddp_layout(reference)}"
        if difference is not None:
            return f"step {step}: {difference}"
    return "never refused" if scenario.refused else None


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """The scenarios called ``names`` in one spawn: per scenario, the first difference or None."""
    chosen = {s.name: s for s in SCENARIOS}
    return {name: run_scenario(rank, chosen[name]) for name in names}
