"""overlapddp: data-parallel training that overlaps communication with backward, bit-equal to DDP.

Vocabulary, used with one meaning everywhere in this package:

- **bucket**: a group of parameters whose gradients are reduced together by one collective
  over one flat buffer. Bucket 0 is launched first.
- **ready**: a parameter is ready when autograd has accumulated its gradient for this backward;
  a bucket is ready when all its parameters are.
- **launch**: starting a bucket's collective (asynchronously). Buckets launch strictly in
  index order, as in DDP.
- **fence**: the happens-before edge between a collective's completion and any reader of its
  result (work handles and futures on CPU; events and stream waits on CUDA).
- **finalize**: the end-of-backward step that waits on every bucket's fence and writes the
  reduced values into ``param.grad``, before ``loss.backward()`` returns.

Public surface (what users import; kept working across versions):

- ``overlapddp``: :class:`OverlapDDP`;
- ``overlapddp.testing``: force the race (delay a rank, remove the fence, a synchronous reference);
- ``overlapddp.timeline``: per-bucket spans and a Chrome trace from ``record_fences()``;
- ``overlapddp.fence``: the fences (``Fence``, ``FenceLog``) that ``testing`` wraps;
- ``overlapddp.sharded_checkpoint``: ``save_sharded``/``load_sharded`` for ``attach_optimizer(shard=True)``;
- ``overlapddp.sanitize``: the race detector for any loop's asynchronous collectives;
- ``overlapddp.integrations``: the frameworks (Lightning, Accelerate, transformers, Ray, torchft).

Everything else is private and may move: ``bucket/`` (one bucket's life), ``layout/`` (which
gradients go together), ``shard/`` and ``optim/`` (the optimizers ``attach_optimizer`` attaches), and
the hall (``reducer``, ``wrapper``, ``construction``, ``refusals``, ...): docs/how_it_works.md maps them.
"""

from __future__ import annotations

from overlapddp.wrapper import OverlapDDP

__all__ = ["OverlapDDP"]
