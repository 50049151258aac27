"""Reporting a sync flag set too late: DDP decides at the forward whether its backward reduces.

``require_backward_grad_sync`` (and ``no_sync()``, which sets it) is read by the forward; a loop that
changes it between a forward and its backward gets a backward that does what the forward decided,
silently in DDP. Each case is warned once per wrapper, saying what happened to the gradients. The
backward's side of the check is one flag comparison per gradient; the rest runs only when warning.
"""

from __future__ import annotations

import warnings


class SyncFlagCheck:
    """The wrapper's ``require_backward_grad_sync`` (the flag lives here) and the warnings about it."""

    def __init__(self) -> None:
        self.requested = True  # require_backward_grad_sync, as the user last set it
        self.forward_synced = True  # whether the last grad-enabled forward armed a reduction
        self._warned: set[str] = set()

    def unarmed_backward(self, rank: int) -> None:
        """A gradient arrived outside a synchronized backward while the flag asks for synchronization."""
        if self.forward_synced:
            self._warn(
                "unarmed",
                f"OverlapDDP (rank {rank}): a backward ran after this wrapper's reduction had finished (a "
                "second backward of one forward, e.g. with retain_graph=True); its gradients were NOT reduced "
                "across ranks and stay local, added to the next synchronized backward's. As in DDP, only the "
                "first backward after a forward reduces: sum the losses and call backward once, or run a new "
                "forward for each backward.",
            )
        else:
            self._warn(
                "unarmed",
                f"OverlapDDP (rank {rank}): this backward's gradients were NOT reduced across ranks: its forward "
                "ran with require_backward_grad_sync=False (inside no_sync() or after assigning the flag), and, "
                "as in DDP, the forward decides. require_backward_grad_sync is True now, so it was set too late. "
                "The gradients stay local (an optimizer step before the next synchronized backward reads local "
                "gradients). Set require_backward_grad_sync = True (or leave no_sync()) before the forward of "
                "the micro-batch that should synchronize.",
            )

    def synced_under_no_sync(self, rank: int) -> None:
        """A synchronized backward runs while the flag says not to synchronize."""
        self._warn(
            "no_sync",
            f"OverlapDDP (rank {rank}): this backward's gradients ARE being reduced across ranks although "
            "require_backward_grad_sync is False: its forward ran outside no_sync() (or before the flag was "
            "set), and, as in DDP, the forward decides. A no_sync() block must hold the forward as well as "
            "the backward: put both inside it, or set require_backward_grad_sync = False before the forward.",
        )

    def discarded(self, rank: int, action: str) -> None:
        """Gradients accumulated outside synchronization and never reduced are being cleared."""
        self._warn(
            "discarded",
            f"OverlapDDP (rank {rank}): {action} clears gradients accumulated under no_sync() (or with "
            "require_backward_grad_sync=False) that were never reduced across ranks; those micro-batches are "
            "lost to this step. If they were meant to count, run the last micro-batch's forward and backward "
            "with synchronization before stepping and clearing.",
        )

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=3)
