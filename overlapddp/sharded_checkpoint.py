"""The sharded optimizer's checkpoint functions at their public path (they live in ``shard/checkpoint.py``)."""

from overlapddp.shard.checkpoint import load_sharded, save_sharded

__all__ = ["load_sharded", "save_sharded"]
