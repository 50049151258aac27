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
"""

from __future__ import annotations

from overlapddp.wrapper import OverlapDDP

__all__ = ["OverlapDDP"]
