"""``overlapddp.sanitize``: a race detector for any training loop's asynchronous collectives.

A read of a collective's output, or a write to its input or output, before this rank observed the
collective complete; a tensor freed while it may still use it; a collective never waited for. Run a
script under it unchanged::

    torchrun --nproc-per-node 2 -m overlapddp.sanitize [--report-dir DIR] [--force] train.py [ARGS...]

or watch a block of code::

    with overlapddp.sanitize.detect() as findings:
        train()

What it sees and what it cannot: docs/sanitize.md.
"""

from __future__ import annotations

from overlapddp.sanitize.detector import detect
from overlapddp.sanitize.findings import DROPPED, KINDS, NEVER, READ, WRITE, Finding

__all__ = ["detect", "Finding", "KINDS", "READ", "WRITE", "DROPPED", "NEVER"]
