"""Optimizer state sharded across ranks (``attach_optimizer(optimizer, shard=True)``). Private, but for
the checkpoint functions, which users import as ``overlapddp.sharded_checkpoint``.

- ``optimizer.py``: the sharded optimizer; ``checks.py``: what it refuses, before any collective.
- ``layout.py``: each rank's pieces of each bucket; ``relayout.py``: state moved when buckets change.
- ``collectives.py``: reduce a bucket to this rank's shard, gather the updated shards.
- ``checkpoint.py``: save and load the sharded state through ``torch.distributed.checkpoint``.
"""
