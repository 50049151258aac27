"""Making every rank start from, and keep, rank 0's model: shape checks and coalesced broadcasts."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from overlapddp.device_streams import device_context
from overlapddp.torch_compat import foreach_copy_, preserving_versions

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def verify_same_parameters(
    names: Sequence[str], params: Sequence[torch.Tensor], process_group: dist.ProcessGroup
) -> None:
    """Raise on every rank when any rank's parameters differ in count, name, shape, stride or dtype.

    Stock DDP raises only on the mismatching rank and lets the others go on into a hang; here every
    rank sees every rank's description, so every rank raises the same message.
    """
    mine = [(name, tuple(p.shape), tuple(p.stride()), str(p.dtype)) for name, p in zip(names, params, strict=True)]
    everyone = gather_objects(mine, process_group, params[0].device)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if len(theirs) != len(reference):
            raise RuntimeError(
                f"OverlapDDP expects the same model on every rank, but rank {rank} has {len(theirs)} "
                f"parameters that require grad while rank 0 has {len(reference)}. Build the same model "
                "on every rank before wrapping it."
            )
        for index, (ours, other) in enumerate(zip(reference, theirs, strict=True)):
            if ours != other:
                raise RuntimeError(
                    f"OverlapDDP expects the same model on every rank, but parameter {index} differs: "
                    f"rank 0 has {_describe(ours)}, rank {rank} has {_describe(other)}."
                )


def gather_objects(obj: Any, process_group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order, with the collective on ``device`` (the module's), not on
    whatever CUDA device happens to be current (cuda:0 on every rank unless the script set it)."""
    everyone: list[Any] = [None] * process_group.size()
    with device_context(device):
        dist.all_gather_object(everyone, obj, group=process_group)
    return everyone


def _describe(entry: tuple) -> str:
    name, shape, stride, dtype = entry
    return f"{name} with shape {list(shape)}, strides {list(stride)}, dtype {dtype}"


def broadcast_from(tensor: torch.Tensor, source: int, process_group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` with rank ``source``'s (a rank of ``process_group``, not a global rank)."""
    dist.broadcast(tensor, src=dist.get_global_rank(process_group, source), group=process_group)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int, process_group: dist.ProcessGroup
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, one broadcast per dtype/device chunk."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for members in groups.values():
            for chunk in _chunks(members):
                flat = torch.cat([t.reshape(-1) for t in chunk])
                broadcast_from(flat, src, process_group)
                pieces = flat.split([t.numel() for t in chunk])
                foreach_copy_(chunk, [piece.view_as(t) for piece, t in zip(pieces, chunk, strict=True)])


def broadcast_state(
    parameters: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], src: int, process_group: dist.ProcessGroup
) -> None:
    """Rank ``src``'s parameters and buffers on every rank: DDP's init sync, and Join's final agreement."""
    broadcast_coalesced([p.detach() for p in parameters] + list(buffers), src, process_group)


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int, process_group: dist.ProcessGroup) -> None:
    """The forward's buffer broadcast: as :func:`broadcast_coalesced`, version counters kept as DDP keeps
    them, so that a buffer saved for a backward still pending (an earlier forward's) stays usable."""
    with preserving_versions(buffers):
        broadcast_coalesced(buffers, src, process_group)


def _chunks(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > BROADCAST_BUCKET_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += nbytes
    return chunks
