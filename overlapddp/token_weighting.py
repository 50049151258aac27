"""Token-weighted reduction: the reduced gradient of the global per-token mean loss.

When ranks process different numbers of tokens, averaging each rank's mean-loss gradient over ranks
weights a token on a short-batch rank more than one on a long-batch rank. With token weighting each
rank backpropagates the SUM of its token losses and the reducer divides by the total token count
over all ranks, so the result is ``sum_i n_i g_i / sum_i n_i`` (``g_i`` the per-token mean gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.futures import Future


class TokenCount:
    """Tokens counted on this rank since the last reduction, and their sum over ranks.

    ``add`` is called per micro-batch (no_sync micro-steps accumulate); ``launch`` starts the
    all-reduce of the count when a synchronized forward ends, so it overlaps backward; ``total``
    waits for it when the first bucket is filled.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.local = 0
        # Future of the count's all-reduce: produced by ``launch`` (end of forward), waited by
        # ``total`` (first bucket fill during backward).
        self._future: Future | None = None

    def add(self, tokens: int) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"count_tokens expects a non-negative int, got {tokens!r}.")
        self.local += tokens

    def launch(self, process_group: dist.ProcessGroup) -> None:
        count = torch.tensor([float(self.local)], dtype=torch.float64, device=self._device)
        self._future = dist.all_reduce(count, group=process_group, async_op=True).get_future()
        self.local = 0

    def total(self, rank: int) -> float:
        if self._future is None:
            raise RuntimeError("The token count was not launched for this backward; call count_tokens before forward.")
        future, self._future = self._future, None
        total = float(future.wait()[0].item())
        if total <= 0:
            raise RuntimeError(
                f"Token-weighted reduction on rank {rank}: no rank counted any tokens for this backward; "
                "call model.count_tokens(n) for every micro-batch before its forward."
            )
        return total
