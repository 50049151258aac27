"""Optimizer state sharded across ranks by whole parameters (``attach_optimizer(optimizer, shard=True)``).
Private, but for the checkpoint functions, which users import as ``overlapddp.sharded_checkpoint``.

- ``ownership.py``: which rank updates which parameter (pure planning, balanced by cost);
- ``checks.py``: what sharding refuses, before any collective;
- ``optimizer.py``: the step: owners update, then broadcast; ``step_record.py``: which ranks reached it;
- ``state.py``: the state dict in the plain optimizer's format; ``checkpoint.py``: through DCP.
"""
