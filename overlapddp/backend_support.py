"""What the process group's backend cannot do safely, refused when the wrapper is built.

NCCL has no sparse all-reduce: a sparse gradient would reach ``all_reduce`` inside an autograd hook,
deep in backward, and fail there. DDP reduces sparse gradients on gloo only, and so does OverlapDDP.

Under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` a failed or timed-out collective is aborted by the
watchdog without any error raised: the aborted kernel exits, the streams waiting on it go on, and the
copy into ``param.grad`` and the step run on partial sums. OverlapDDP promises an error instead of a
wrong step, so it refuses that mode (the default, 3, and 1 end the process with the failure logged).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist


def backend_for(process_group: dist.ProcessGroup, device: torch.device) -> str:
    """The backend ``process_group`` uses for tensors on ``device`` ("nccl", "gloo", ...)."""
    name = str(dist.get_backend(process_group))
    if ":" not in name:
        return name
    for part in name.split(","):
        device_type, _, backend = part.partition(":")
        if device_type.strip() == device.type:
            return backend.strip()
    return name


def refuse_unsupported(process_group: dist.ProcessGroup, device: torch.device, sparse_names: Sequence[str]) -> None:
    """Raise ``ValueError`` before the first collective for what the backend cannot reduce."""
    backend = backend_for(process_group, device)
    if backend == "nccl" and _async_error_handling() == "2":
        raise ValueError(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=2 aborts a failed NCCL collective without raising: the reduced "
            "gradients and the optimizer step would then silently use partial sums. Use the default (3) or 1, "
            "which end the process with the failed collective logged (see docs/cuda.md, NCCL errors)."
        )
    if sparse_names and backend == "nccl":
        raise ValueError(
            f"{', '.join(sparse_names)} produce sparse gradients (sparse=True), which NCCL cannot all-reduce. "
            "Reduce them over a gloo process group (as DDP requires), or build those modules with sparse=False."
        )


def _async_error_handling() -> str | None:
    """The NCCL error handling mode the process group reads (the old name still counts)."""
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip()
    return None
