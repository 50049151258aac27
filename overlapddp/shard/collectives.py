"""How a sharded optimizer's bucket is reduced to this rank's shard and gathered back, per backend.

Both work in the bucket's own padded buffer, so no buffer is added: this rank's reduced shard is its
slice of the buffer, and the updated shards of every rank are gathered into the buffer (free from
the update to the next backward's copy-in). Over NCCL these are the in-place reduce-scatter and an
all-gather. Over gloo both collectives copy through a temporary the size of the whole bucket; what
gloo does instead gives the same bits without it, and takes less time (measured on 2 and 3 ranks):

- gloo's reduce-scatter is an all-reduce of a copy of its input, then this rank's slice of it: the
  bucket is all-reduced in place instead (the same sum, as DDP reduces it);
- gloo's all-gather fills a temporary output and copies it: each rank's shard is broadcast into its
  chunk of the buffer instead (bytes copied, not summed).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.distributed as dist

from overlapddp.torch_compat import all_gather_flat, reduce_scatter_flat

SHARDED_BACKENDS = ("gloo", "nccl")


def reduce_to_shard(buffer: torch.Tensor, rank: int, group: dist.ProcessGroup, backend: str) -> torch.futures.Future:
    """SUM ``buffer`` (padded to a multiple of the group's size) over the group, at least in this
    rank's slice of it (its shard)."""
    if backend == "gloo":
        return dist.all_reduce(buffer, group=group, async_op=True).get_future()
    shard = buffer.chunk(group.size())[rank]
    return reduce_scatter_flat(shard, buffer, group=group, async_op=True).get_future()


class Waitable(Protocol):
    """A started collective: ``wait()`` returns once it is done (raises if it failed)."""

    def wait(self) -> object: ...


class Broadcasts:
    """One all-gather made of one broadcast per rank: waited as one."""

    def __init__(self, works: list[dist.Work | None]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            cast(dist.Work, work).wait()  # async_op=True: never None


def gather_shards(gathered: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, backend: str) -> Waitable:
    """Start gathering every rank's ``shard`` into ``gathered``, rank ``r``'s in its chunk ``r``;
    returns what to ``wait()`` on."""
    if backend != "gloo":
        return cast(dist.Work, all_gather_flat(gathered, shard, group=group, async_op=True))
    chunks = gathered.chunk(group.size())
    chunks[dist.get_rank(group)].copy_(shard)
    return Broadcasts([
        dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True)
        for r, chunk in enumerate(chunks)
    ])
