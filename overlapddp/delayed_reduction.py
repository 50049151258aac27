"""The delayed all-reduce (DDP's ``delay_all_reduce_named_params``), fenced.

DDP takes the named parameters out of its buckets and, when ``param_to_hook_all_reduce``'s gradient is
ready, divides their flat gradient buffer by the world size (true division) and starts one SUM
all-reduce of it with ``async_op=True``. It never waits for that work: an ``optimizer.step()`` right
after ``backward()`` can read the gradients while the collective is still writing them (measured:
2 ranks, a 4 MiB delayed layer, Adam; the parameters differed from DDP without the delay).

Here the same collective, with the same arithmetic, is one more edge set in the reducer's fence,
under the key :data:`FENCE_KEY`: it is produced and launched when the hook parameter's gradient is
ready, and completed, then copied into ``param.grad``, before backward returns (in the reducer's
finalize, before an overlapped optimizer's last updates). The gradients accumulate in ``param.grad``
as usual and are copied into a flat buffer at launch, so nothing the collective writes is visible
before it completes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from overlapddp.bucket.storage import BucketStorage
from overlapddp.fence import Fence

# The fence key of the delayed all-reduce: buckets are 0, 1, ...; -1 marks backward's end in logs.
FENCE_KEY = -2


def check_delayed_parameters(params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """They are reduced in one flat buffer: one dtype and one device (checked before any collective)."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(
            "delay_all_reduce_named_params must share one dtype and device (they are reduced in one flat "
            f"buffer), got {sorted(map(str, kinds))} for {', '.join(names)}."
        )


class DelayedReduction:
    """One flat all-reduce of the delayed parameters' gradients per synchronized backward."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], process_group: dist.ProcessGroup) -> None:
        self.params = list(params)
        self.names = list(names)
        self._process_group = process_group
        self._storage = BucketStorage(FENCE_KEY, self.params)
        self._launched = False  # in this synchronized backward; reset by finish and abandon
        self._late: list[str] = []  # delayed gradients that arrived after the launch

    @property
    def launched(self) -> bool:
        return self._launched

    def launch(self, fence: Fence) -> None:
        """Copy the gradients in (zeros for ``None``), divide by the world size and start the SUM."""
        storage, group = self._storage, self._process_group

        def fill() -> torch.Tensor:
            storage.copy_in([p.grad for p in self.params], None, group.size())
            return storage.buffer

        fence.launch(FENCE_KEY, fill, lambda: dist.all_reduce(storage.buffer, group=group, async_op=True).get_future())
        self._launched = True

    def gradient_ready(self, index: int, fence: Fence) -> None:
        """Delayed parameter ``index`` received a gradient (on the current stream, which the launch's
        copy-in then waits for); after the launch it would be lost."""
        fence.gradient_ready(FENCE_KEY)
        if self._launched:
            self._late.append(self.names[index])

    def finish(self, fence: Fence) -> None:
        """Complete the all-reduce (launching it first if the hook parameter got no gradient) and
        write the reduced values into every delayed parameter's ``.grad``."""
        if not self._launched:
            self.launch(fence)
        fence.complete(FENCE_KEY)
        late, self._late, self._launched = self._late, [], False
        if late:
            raise RuntimeError(
                f"The gradients of {', '.join(late)} arrived after param_to_hook_all_reduce's, when their "
                f"delayed all-reduce had already started on rank {dist.get_rank(self._process_group)}; "
                "choose as param_to_hook_all_reduce a parameter whose gradient is computed after all of theirs."
            )
        self._storage.copy_out(self._storage.buffer, [True] * len(self.params), as_view=False)
        fence.consumed(FENCE_KEY, "copy to param.grad", [p.grad for p in self.params if p.grad is not None])

    def abandon(self) -> None:
        """Forget an unfinished iteration; the buffer a collective may still write is replaced."""
        if self._launched:
            self._storage = BucketStorage(FENCE_KEY, self.params)
        self._launched = False
        self._late = []
