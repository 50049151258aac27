"""Token-weighted reduction equals one process training on all ranks' tokens; rank averaging does not.

Ranks hold different numbers of sequences. The reference computes, in one process, the gradient of
the mean loss over the concatenation of every rank's tokens. Float32 sums in a different order
(per-rank partial sums, then the all-reduce) differ from the single-process sum by a few ulps of
the gradient's magnitude, so the comparison uses rtol=1e-5, atol=1e-7: far below the difference
that plain rank averaging makes (checked below to be > 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from overlapddp import OverlapDDP
from tests.support import hooks, models
from tests.support.multiprocess import run_ranks

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
        return all(torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL) for p, q in zip(model.parameters(), reference.parameters(), strict=False))

    gap = max((p.grad - q.grad).abs().max().item() for p, q in zip(averaged.parameters(), reference.parameters(), strict=False))
    return {"weighted_matches": close(weighted), "averaged_matches": close(averaged), "averaged_gap": gap}


def test_token_weighted_gradient_is_the_global_per_token_mean_gradient():
    for micro_steps in (1, 2):  # 2: counts summed over a no_sync micro-step
        for facts in run_ranks(3, _reduced_gradients, micro_steps):
            assert facts["weighted_matches"]
            assert not facts["averaged_matches"] and facts["averaged_gap"] > 1e-3


# -- bit for bit, over several synchronized steps -------------------------------------------------

STEPS = 4
CAP_MB = 0.05  # several buckets


def _tokens(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch whose size changes with the rank, the step and the micro-step."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    tokens = torch.randint(0, models.VOCAB, (1 + (rank + step + micro) % 3, models.SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _against_ddp_with_a_dividing_hook(rank: int, world_size: int, batched: bool, accumulate: int) -> list[str | None]:
    """Per step, the first parameter (or gradient) of ``OverlapDDP.count_tokens`` that differs from
    stock DDP dividing each bucket by the global token count in a hook (None: all equal)."""
    from torch.nn.parallel import DistributedDataParallel

    from tests.support.parity import first_difference, first_grad_difference

    state = {"batched": batched, "total": 0.0}
    reference = DistributedDataParallel(models.build("transformer"), bucket_cap_mb=CAP_MB)
    reference.register_comm_hook(state, hooks.divide_by_total_hook)
    candidate = OverlapDDP(models.build("transformer"), bucket_cap_mb=CAP_MB, batched_grad_copy=batched)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (reference, candidate)]
    found: list[str | None] = []
    for step in range(STEPS):
        state["total"] = float(sum(_tokens(r, step, m)[1].numel() for r in range(world_size) for m in range(accumulate)))
        for micro in range(accumulate):
            inputs, target = _tokens(rank, step, micro)
            last = micro == accumulate - 1
            reference.require_backward_grad_sync = candidate.require_backward_grad_sync = last
            candidate.count_tokens(target.numel())
            sum_loss(candidate, inputs, target).backward()
            sum_loss(reference, inputs, target).backward()
        difference = first_grad_difference(reference.module, candidate.module)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        found.append(difference or first_difference(reference.module, candidate.module))
    return found


def _token_cases(rank: int, world_size: int) -> dict[str, list[str | None]]:
    return {
        f"batched_grad_copy={batched}-accumulate{accumulate}": _against_ddp_with_a_dividing_hook(
            rank, world_size, batched, accumulate)
        for batched, accumulate in ((False, 1), (True, 1), (False, 2), (True, 2))
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_token_weighting_is_bit_equal_to_ddp_dividing_by_the_global_count_every_step(world_size):
    """Every synchronized step divides by that step's count (the count starts again after each
    reduction), and batched_grad_copy divides once: both against stock DDP with a hook that divides
    each bucket by the global count, torch.equal on every gradient and parameter after every step."""
    for rank, cases in enumerate(run_ranks(world_size, _token_cases)):
        for name, per_step in cases.items():
            assert per_step == [None] * STEPS, f"rank {rank}, {name}: {per_step}"
