"""Token-weighted reduction equals one process training on all ranks' tokens; rank averaging does not.

Ranks hold different numbers of sequences. The reference computes, in one process, the gradient of
the mean loss over the concatenation of every rank's tokens. Float32 sums in a different order
(per-rank partial sums, then the all-reduce) differ from the single-process sum by a few ulps of
the gradient's magnitude, so the comparison uses rtol=1e-5, atol=1e-7: far below the difference
that plain rank averaging makes (checked below to be > 1e-3).
"""

from __future__ import annotations

import torch

from overlapddp import OverlapDDP
from tests import models
from tests.multiprocess import run_ranks

RTOL, ATOL = 1e-5, 1e-7


def rank_batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r has 1 + 2r sequences per micro-batch (uneven token counts)."""
    g = torch.Generator().manual_seed(100 * rank + micro)
    tokens = torch.randint(0, models.VOCAB, (1 + 2 * rank, models.SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def sum_loss(model: torch.nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")


def _reduced_gradients(rank: int, world_size: int, micro_steps: int) -> dict[str, object]:
    weighted = OverlapDDP(models.build("transformer"))
    averaged = OverlapDDP(models.build("transformer"))
    for micro in range(micro_steps):
        inputs, target = rank_batch(rank, micro)
        last = micro == micro_steps - 1
        weighted.require_backward_grad_sync = averaged.require_backward_grad_sync = last
        weighted.count_tokens(target.numel())
        sum_loss(weighted, inputs, target).backward()
        (sum_loss(averaged, inputs, target) / target.numel() / micro_steps).backward()

    reference = models.build("transformer")
    batches = [rank_batch(r, m) for r in range(world_size) for m in range(micro_steps)]
    total = sum(t.numel() for _, t in batches)
    (sum(sum_loss(reference, i, t) for i, t in batches) / total).backward()

    def close(model: torch.nn.Module) -> bool:
        return all(torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL) for p, q in zip(model.parameters(), reference.parameters()))

    gap = max((p.grad - q.grad).abs().max().item() for p, q in zip(averaged.parameters(), reference.parameters()))
    return {"weighted_matches": close(weighted), "averaged_matches": close(averaged), "averaged_gap": gap}


def test_token_weighted_gradient_is_the_global_per_token_mean_gradient():
    for micro_steps in (1, 2):  # 2: counts summed over a no_sync micro-step
        for facts in run_ranks(3, _reduced_gradients, micro_steps):
            assert facts["weighted_matches"]
            assert not facts["averaged_matches"] and facts["averaged_gap"] > 1e-3
