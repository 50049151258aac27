"""What the process group's backend cannot reduce, refused when the wrapper is built.

NCCL has no sparse all-reduce: a sparse gradient would reach ``all_reduce`` inside an autograd hook,
deep in backward, and fail there. DDP reduces sparse gradients on gloo only, and so does OverlapDDP.
"""

from __future__ import annotations

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
    if sparse_names and backend == "nccl":
        raise ValueError(
            f"{', '.join(sparse_names)} produce sparse gradients (sparse=True), which NCCL cannot all-reduce. "
            "Reduce them over a gloo process group (as DDP requires), or build those modules with sparse=False."
        )
