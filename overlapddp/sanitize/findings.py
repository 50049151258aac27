"""What was found, where, and how it is told: a finding's fields, its line on stderr, its JSON.

A finding names the tensor as the user knows it, the collective (its op, group size and launch
line), the access (its op and line) and the rank. Lines are the user's: the first frame outside
torch, overlapddp and the standard library, so a read inside ``optimizer.step()`` points at the
``step()`` call, and an all-reduce launched inside DDP's hook points at ``loss.backward()``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overlapddp.frames import PACKAGE, STDLIB, TORCH

READ = "read-before-complete"
WRITE = "write-before-complete"
DROPPED = "dropped-before-complete"
NEVER = "never-completed"
KINDS = (READ, WRITE, DROPPED, NEVER)

_SKIPPED = (PACKAGE, TORCH, STDLIB)

_HELP = {
    READ: "the collective may still write it: wait() its work (or its future) first, or read it in the "
          "future's then() callback",
    WRITE: "the collective may still read or write it: wait() its work first, or write in the future's "
           "then() callback",
    DROPPED: "on CUDA the caching allocator may hand this memory to the next allocation while the "
             "collective still uses it; on CPU (gloo) the work holds it, but its result is lost. Keep the "
             "tensor and wait() the work",
    NEVER: "this rank never waited for it: its result may be read unfinished, and its tensors reused. "
           "Keep its work and wait() it",
}


def user_site(depth: int = 1) -> str | None:
    """``"path:line"`` of the first frame outside torch, overlapddp and the standard library, ``depth``
    frames above the caller; None when there is none (a backend's thread)."""
    frame: Any = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIPPED) and not name.startswith("<"):
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies under it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


@dataclass(frozen=True)
class Finding:
    """One unordered access, drop or missing wait of an asynchronous collective's memory."""

    kind: str  # one of KINDS
    tensor: str  # "net.0.weight.grad (float32[16, 8])", or the shape and dtype
    collective: str  # "all_reduce over 2 ranks"
    launched_at: str  # "path:line" of the launch
    accessed_at: str  # "path:line" of the access (of the next launch, or the end, for never-completed)
    access: str  # the op that read or wrote it ("aten.add_"), "free", "launch" or "end"
    rank: int

    def message(self) -> str:
        """The line written to stderr."""
        head = f"overlapddp.sanitize: rank {self.rank}: {self.kind}:"
        if self.kind == NEVER:
            return (f"{head} {self.collective} of {self.tensor}, launched at {self.launched_at}, was still not "
                    f"observed complete at {self.accessed_at} ({self.access}); {_HELP[self.kind]}.")
        what = {READ: f"read by {self.access} at {self.accessed_at}",
                WRITE: f"written by {self.access} at {self.accessed_at}",
                DROPPED: f"freed by {self.accessed_at}"}[self.kind]
        return (f"{head} {self.tensor} {what}, while {self.collective} launched at {self.launched_at} "
                f"was not observed complete; {_HELP[self.kind]}.")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def write_report(findings: list[Finding], directory: str | os.PathLike[str], rank: int) -> Path:
    """``directory/rank{rank}.json``: the findings as a JSON list (empty when nothing was found)."""
    path = Path(directory) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([f.as_json() for f in findings], indent=1) + "\n")
    return path
