"""Token-weighted reduction: the reduced gradient of the global per-token mean loss.

When ranks process different numbers of tokens, averaging each rank's mean-loss gradient over ranks
weights a token on a short-batch rank more than one on a long-batch rank. With token weighting each
rank backpropagates the SUM of its token losses and the reducer divides by the total token count
over all ranks, so the result is ``sum_i n_i g_i / sum_i n_i`` (``g_i`` the per-token mean gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from overlapddp.device_streams import CudaKit


class TokenCount:
    """Tokens counted on this rank since the last reduction, and their sum over ranks.

    ``add`` is called per micro-batch (no_sync micro-steps accumulate); ``launch`` starts the
    all-reduce of the count when a synchronized forward ends, so it overlaps backward; ``total``
    reads it when the first bucket is filled.

    On CUDA the count never drains the compute stream: it is made on the device from a Python
    value (no copy from pageable memory), reduced and copied to pinned host memory on a side
    stream, and ``total`` waits for that copy only (not for the backward kernels queued so far).
    """

    def __init__(self, device: torch.device, kit: CudaKit | None = None) -> None:
        self._device = device
        self._kit = CudaKit(device) if kit is None and device.type == "cuda" else kit
        # CUDA: the stream the count is reduced and copied on, created at the first launch.
        self._stream: Any | None = None
        self.local = 0
        # CPU: future of the count's all-reduce, produced by ``launch`` (end of forward), waited
        # by ``total`` (first bucket fill during backward).
        self._future: Future[list[torch.Tensor]] | None = None
        # CUDA: the reduced count in host memory, written by a copy on ``_stream``, and the event
        # recorded after that copy; ``total`` waits on the event, then reads the host copy.
        self._on_host: torch.Tensor | None = None
        self._copied: Any | None = None

    def add(self, tokens: int) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"count_tokens expects a non-negative int, got {tokens!r}.")
        self.local += tokens

    def launch(self, process_group: dist.ProcessGroup) -> None:
        if self._kit is None:
            count = torch.full((1,), float(self.local), dtype=torch.float64, device=self._device)
            self._future = dist.all_reduce(count, group=process_group, async_op=True).get_future()
        else:
            if self._stream is None:
                self._stream = self._kit.new_stream()
            with self._kit.use(self._stream):
                count = torch.full((1,), float(self.local), dtype=torch.float64, device=self._device)
                future = dist.all_reduce(count, group=process_group, async_op=True).get_future()
                reduced = self._kit.wait_future(future, "collective")[0]
                self._on_host = torch.empty(1, dtype=torch.float64, pin_memory=reduced.is_cuda)
                self._on_host.copy_(reduced, non_blocking=True)
                self._copied = self._kit.new_event()
                self._copied.record(self._stream)
        self.local = 0

    def total(self, rank: int) -> float:
        if self._copied is not None and self._on_host is not None:
            copied, self._copied = self._copied, None
            copied.synchronize()
            total = float(self._on_host[0])
        elif self._future is not None:
            future, self._future = self._future, None
            total = float(future.wait()[0].item())
        else:
            raise RuntimeError("The token count was not launched for this backward; call count_tokens before forward.")
        if total <= 0:
            raise RuntimeError(
                f"Token-weighted reduction on rank {rank}: no rank counted any tokens for this backward; "
                "call model.count_tokens(n) for every micro-batch before its forward."
            )
        return total
