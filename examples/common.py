"""What every example does first: join the process group that torchrun describes."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup(timeout_s: float | None = None) -> torch.device:
    """Join the process group torchrun describes; one thread and (with CUDA) one GPU per rank."""
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"Local rank {local_rank} needs its own GPU, but {torch.cuda.device_count()} are visible; "
                "launch at most that many processes per node, or set CUDA_VISIBLE_DEVICES= to train on CPU."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **timeout)
    return device
