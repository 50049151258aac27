"""``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` on CPU.

Stock DDP runs it only on CUDA, so on CPU the reference is written by hand with DDP's casts: buffers
to ``buffer_dtype`` once; per step parameters (and accumulated gradients) to ``param_dtype`` copies,
inputs to ``param_dtype``, forward and backward; per bucket (OverlapDDP's layout, which the parity
tests hold equal to DDP's) the ``param_dtype`` gradients are flattened, cast to the reduce dtype,
SUM-all-reduced and divided by the world size in it; then full-precision parameters and gradients.
Every parameter, gradient and buffer must be bit-equal every step at world sizes 2 and 3; reducing
in ``param_dtype`` instead (a planted bug) must not be.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP, mixed_precision
from tests.support.multiprocess import run_ranks
from tests.support.precision_reference import HandWrittenCasts

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(12, 16)
        self.norm = nn.BatchNorm1d(16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.last = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.frozen(self.norm(self.first(x)))))


class Tagger(nn.Module):
    """Integer and bool inputs next to a floating one, as a token model takes them: indices into an
    ``nn.Embedding`` (int64), a padding mask (bool), per-token weights (floating). Only the floating
    input may be cast to ``param_dtype``; ``seen`` records the dtypes each forward received."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.last = nn.Linear(8, 3)
        self.seen: set[str] = set()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.seen |= {f"{name}:{t.dtype}" for name, t in (("ids", ids), ("mask", mask), ("weights", weights))}
        h = self.emb(ids).masked_fill(~mask.unsqueeze(-1), 0) * weights.unsqueeze(-1)
        return self.last(h).mean(dim=1)


NETS = {"net": Net, "tagger": Tagger}


def _batch(rank: int, step: int, net: str = "net") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(7 * step + rank)
    if net == "tagger":
        ids = torch.randint(0, 10, (6, 5), generator=g)
        return (ids, ids % 3 != 0, torch.rand(6, 5, generator=g) + rank), torch.randn(6, 3, generator=g)
    return (torch.randn(6, 12, generator=g) * (1 + rank),), torch.randn(6, 3, generator=g)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def _differences(reference: nn.Module, candidate: nn.Module) -> list[str]:
    found = [f"{n}.grad" for (n, p), (_, q) in zip(reference.named_parameters(), candidate.named_parameters(), strict=False)
             if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad))]
    pairs = zip(reference.state_dict().items(), candidate.state_dict().items(), strict=False)
    return found + [n for (n, x), (_, y) in pairs if x.dtype != y.dtype or not torch.equal(x, y)]


@contextmanager
def _reduce_in_param_dtype() -> Iterator[None]:
    """Planted bug: reduce in param_dtype whatever reduce_dtype says."""
    original = mixed_precision.MixedPrecision.__init__

    def init(self, config):
        original(self, config)
        self.reduce_dtype = self.param_dtype

    mixed_precision.MixedPrecision.__init__ = init
    try:
        yield
    finally:
        mixed_precision.MixedPrecision.__init__ = original


CONFIGS = {
    "bf16 params, fp32 reduce, bf16 buffers": (_MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16), {}),
    "fp16 params and reduce, no_sync, grads kept": (_MixedPrecision(torch.float16, None, torch.float16),
                                                    {"accumulate": 2, "set_to_none": False}),
    "bf16 params, int64 and bool inputs": (_MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
                                           {"net": "tagger"}),
    "planted bug": (_MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16), {"fault": _reduce_in_param_dtype}),
}


def _scenario(rank: int, name: str) -> dict[str, object]:
    config, options = CONFIGS[name]
    accumulate, set_to_none = options.get("accumulate", 1), options.get("set_to_none", True)
    net = options.get("net", "net")
    reference = HandWrittenCasts(NETS[net](), config)
    with (options["fault"] if "fault" in options else nullcontext)():
        candidate = OverlapDDP(NETS[net](), mixed_precision=config)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (reference.net, candidate.module)]
    per_step = []
    dtypes = set()
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = _batch(rank, step * accumulate + micro, net)
            with candidate.no_sync() if micro < accumulate - 1 else nullcontext():
                _loss(candidate(*x), y).backward()
            reference.forward_backward(x, y, _loss, sync_buffers=micro == 0)
        reference.reduce(candidate.bucket_indices())
        differences = _differences(reference.net, candidate.module)
        dtypes |= {str(p.dtype) for p in candidate.parameters()} | {str(p.grad.dtype) for p in candidate.parameters() if p.grad is not None}
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        per_step.append(differences + _differences(reference.net, candidate.module))
    with torch.no_grad():
        candidate(*_batch(rank, 99, net)[0])
    return {"per_step": per_step, "dtypes": sorted(dtypes),
            "after_no_grad_forward": str(next(candidate.module.parameters()).dtype),
            "buffers": sorted({str(b.dtype) for b in candidate.buffers()}),
            "inputs_seen": sorted(getattr(candidate.module, "seen", ()))}


def _all(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {name: _scenario(rank, name) for name in CONFIGS}
    try:
        OverlapDDP(Net(), mixed_precision=CONFIGS["planted bug"][0], gradient_as_bucket_view=True)
        results["gabv"] = "accepted"
    except ValueError as error:
        results["gabv"] = str(error)
    return results


@pytest.fixture(scope="module", params=[2, 3])
def results(request) -> list[dict[str, object]]:
    return run_ranks(request.param, _all)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "planted bug"])
def test_bit_equal_to_the_hand_written_casts_every_step(results, name):
    for rank, per_rank in enumerate(results):
        outcome = per_rank[name]
        assert outcome["per_step"] == [[]] * STEPS, f"rank {rank}: {outcome['per_step']}"
        # The optimizer saw full-precision parameters and gradients; buffers stay in buffer_dtype.
        assert outcome["dtypes"] == ["torch.float32"]
        assert outcome["after_no_grad_forward"] == "torch.float32"
    assert results[0]["bf16 params, fp32 reduce, bf16 buffers"]["buffers"] == ["torch.bfloat16"]


def test_integer_and_bool_inputs_keep_their_dtype(results):
    """Only floating inputs are cast to param_dtype, as in DDP: int64 indices reach the embedding and
    the bool mask stays bool (cast, the embedding raises and masked_fill refuses the mask)."""
    for per_rank in results:
        seen = per_rank["bf16 params, int64 and bool inputs"]["inputs_seen"]
        assert seen == ["ids:torch.int64", "mask:torch.bool", "weights:torch.bfloat16"], seen


def test_reducing_in_param_dtype_fails_the_comparison(results):
    for per_rank in results:
        planted = per_rank["planted bug"]["per_step"]
        assert all(any(name.endswith(".grad") for name in step) for step in planted), planted


def test_gradient_as_bucket_view_is_refused_with_mixed_precision(results):
    assert "gradient_as_bucket_view" in results[0]["gabv"]
