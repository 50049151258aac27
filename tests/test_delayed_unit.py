"""The delayed all-reduce's own rules on one process (a one-rank group, a recording fence): its
parameters must share a buffer's dtype and device, it hands its written gradients to the fence,
and an abandoned iteration forgets its launch and the buffer a collective may still write."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from overlapddp.delayed_reduction import FENCE_KEY, DelayedReduction, check_delayed_parameters
from overlapddp.fence import Fence


def test_parameters_of_two_dtypes_are_refused_by_name() -> None:
    params = [torch.zeros(2), torch.zeros(2, dtype=torch.float64)]
    with pytest.raises(ValueError, match="must share one dtype and device.*a.w, b.w"):
        check_delayed_parameters(params, ["a.w", "b.w"])
    check_delayed_parameters(params[:1], ["a.w"])
    check_delayed_parameters([torch.zeros(1), torch.zeros(3)], ["a.w", "c.w"])


def test_its_fence_key_is_no_buckets_and_not_backwards_end() -> None:
    assert FENCE_KEY < -1  # buckets are 0, 1, ...; -1 marks backward's end in the fence's log


class _Recording(Fence):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[Any] = []

    def consumed(self, bucket: int, consumer: str, written: Any = ()) -> None:
        self.written.append((bucket, list(written)))
        super().consumed(bucket, consumer, written)


def test_the_written_gradients_go_to_the_fence_and_abandon_forgets_the_launch(one_rank: None) -> None:
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.full((2,), 4.0)
    delayed = DelayedReduction(params, ["a", "b"], dist.group.WORLD)  # type: ignore[arg-type]
    fence = _Recording()
    delayed.finish(fence)  # launches (no hook parameter fired), completes, copies out
    (key, written), = fence.written
    assert key == FENCE_KEY and [t.data_ptr() for t in written] == [p.grad.data_ptr() for p in params]  # type: ignore[union-attr]
    assert torch.equal(params[1].grad, torch.zeros(3)) and not delayed.launched  # type: ignore[arg-type]

    buffer = delayed._storage.buffer
    delayed.abandon()  # nothing launched: the buffer stays
    assert delayed._storage.buffer is buffer
    delayed.launch(Fence())
    delayed.abandon()  # launched: a collective may still write the old buffer
    assert not delayed.launched and delayed._storage.buffer is not buffer
