"""One bucket's pipeline with its shared stages stood in for: the fill before the launch, the error a
failed completion raises, the non-finite check that stops a launch, the hand-over to consumers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.futures import Future

from overlapddp.bucket import pipeline as bucket_pipeline
from overlapddp.bucket.consumer import ReducedBucket
from overlapddp.bucket.pipeline import BucketPipeline, SharedStages
from overlapddp.clock import BucketStamps
from overlapddp.fence import Fence
from tests.support.ticking_clock import DONE, Ticks


def _pipeline(members: list[int], fence: Fence, check_nonfinite: bool = False) -> BucketPipeline:
    shared = SharedStages(
        fence=fence,
        reduction=SimpleNamespace(  # type: ignore[arg-type]
            rank=2, process_group=None, hook_name="allreduce", start=lambda bucket: Future(), copy_in=lambda storage: storage.buffer,
        ),
        write_watch=SimpleNamespace(watchers=0, check=lambda bucket: None),  # type: ignore[arg-type]
        progress=SimpleNamespace(behind=lambda bucket: f" (rank 1 is behind, bucket {bucket})"),  # type: ignore[arg-type]
        names=[f"layer{i}.weight" for i in range(6)],
        gradient_as_bucket_view=False,
        check_nonfinite=check_nonfinite,
    )
    storage = SimpleNamespace(buffer=torch.zeros(3), params=[], offsets=[], lengths=[])
    return BucketPipeline(4, members, storage, shared, is_last=False)  # type: ignore[arg-type]


class FailingFence(Fence):
    def complete(self, bucket: int) -> object:
        raise ConnectionError("peer closed")


@pytest.mark.parametrize(
    ("members", "listed"),
    [([0, 1], "layer0.weight, layer1.weight"), ([5, 4, 3, 2], "layer5.weight, layer4.weight, layer3.weight, layer2.weight"),
     ([0, 1, 2, 3, 4], "layer0.weight, layer1.weight, layer2.weight, layer3.weight, ...")],
)
def test_a_failed_completion_names_the_bucket_its_first_members_the_rank_and_who_is_behind(members: list[int], listed: str) -> None:
    pipeline = _pipeline(members, FailingFence())
    with pytest.raises(RuntimeError) as raised:
        pipeline.write_back([True] * len(members), [])
    assert str(raised.value) == (
        f"The reduction of bucket 4 ({len(members)} parameters: {listed}) failed on rank 2: peer closed. Another rank "
        "may have died or timed out. (rank 1 is behind, bucket 4) This iteration's gradients were not reduced; "
        "the process group may no longer be usable."
    )
    assert isinstance(raised.value.__cause__, ConnectionError)


def test_the_nonfinite_check_stops_the_launch_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[tuple] = []

    def found(index: int, members: list[int], *rest: object) -> FloatingPointError:
        checked.append((index, members))
        return FloatingPointError("layer0.weight is not finite")

    monkeypatch.setattr(bucket_pipeline, "nonfinite_error", found)
    fence = Fence()
    pipeline = _pipeline([0], fence, check_nonfinite=True)
    with pytest.raises(FloatingPointError, match="layer0.weight is not finite"):
        pipeline.launch(filled=False)
    assert checked == [(4, [0])] and fence.in_flight() == [], "nothing launched"
    monkeypatch.setattr(bucket_pipeline, "nonfinite_error", lambda *args: None)
    pipeline.launch(filled=False)
    assert fence.in_flight() == [4]


def test_without_the_check_nothing_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket_pipeline, "nonfinite_error", lambda *args: pytest.fail("checked"))
    fence = Fence()
    _pipeline([0], fence).launch(filled=False)
    assert fence.in_flight() == [4]


class Taking:
    """A consumer that records the buckets it is handed."""

    name = "taking"

    def __init__(self) -> None:
        self.taken: list[tuple[int, list[bool], object]] = []

    def take(self, bucket: ReducedBucket) -> None:
        self.taken.append((bucket.index, list(bucket.write), bucket.value))


def test_while_measuring_the_fence_stamps_each_launchs_bytes_and_each_hand_over() -> None:
    fence = Fence()
    fence.stamps = BucketStamps(Ticks(), 2)
    pipeline = _pipeline([0, 1], fence)
    pipeline.storage.buffer = torch.zeros(5, dtype=torch.float64)  # 40 bytes
    pipeline._shared.reduction.start = lambda bucket: _resolved(bucket.buffer())
    pipeline.launch(filled=False)
    (launch,) = fence.stamps.launches
    assert (launch.bucket, launch.nbytes, launch.launched, launch.done) == (4, 40, 2, DONE)
    pipeline.write_back([True, True], [Taking()])
    assert fence.stamps.completed == {4: 3} and fence.stamps.consumed == {4: 4}


def test_each_consumer_takes_the_completed_bucket_in_order() -> None:
    fence = Fence()
    pipeline = _pipeline([0, 1], fence)
    pipeline._shared.reduction.start = lambda bucket: _resolved(bucket.buffer())
    first, second = Taking(), Taking()
    order: list[str] = []
    first.take = lambda bucket, taken=first.take: (order.append("first"), taken(bucket))  # type: ignore[method-assign]
    second.take = lambda bucket, taken=second.take: (order.append("second"), taken(bucket))  # type: ignore[method-assign]
    pipeline.launch(filled=False)
    pipeline.write_back([True, False], [first, second])
    assert order == ["first", "second"]
    assert first.taken == second.taken == [(4, [True, False], pipeline.storage.buffer)]


def test_without_the_tuner_nothing_is_timed() -> None:
    fence = Fence()
    pipeline = _pipeline([0], fence)
    pipeline._shared.reduction.start = lambda bucket: _resolved(bucket.buffer())
    pipeline.launch(filled=False)
    pipeline.write_back([True], [])
    assert fence.in_flight() == [] and fence.stamps is None


def _resolved(value: torch.Tensor) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_params_is_the_storages_list() -> None:
    pipeline = _pipeline([0], Fence())
    assert pipeline.params is pipeline.storage.params


class Consumed(Fence):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[list[torch.Tensor]] = []

    def consumed(self, bucket: int, consumer: str, written: Any = ()) -> None:
        self.written.append(list(written))


def test_the_fence_hears_which_gradients_the_copy_out_wrote() -> None:
    fence = Consumed()
    pipeline = _pipeline([0, 1], fence)
    with_grad, without = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    with_grad.grad = torch.ones(1)
    pipeline.storage.params = [with_grad, without]
    pipeline.storage.copy_out = lambda result, write, as_view: None
    pipeline._shared.reduction.start = lambda bucket: _resolved(bucket.buffer())
    pipeline.launch(filled=False)
    pipeline.write_back([True, False], [])
    assert len(fence.written) == 1 and len(fence.written[0]) == 1 and fence.written[0][0] is with_grad.grad


def test_the_launch_fills_the_bucket_before_its_collective_starts_and_the_check_reads_after_the_fill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    monkeypatch.setattr(bucket_pipeline, "nonfinite_error", lambda *args: order.append("check"))
    pipeline = _pipeline([0, 1], Fence(), check_nonfinite=True)
    pipeline._shared.reduction.copy_in = lambda storage: order.append("fill") or storage.buffer
    pipeline._shared.reduction.start = lambda bucket: order.append("start") or _resolved(bucket.buffer())
    pipeline.launch(filled=False)
    assert order == ["fill", "check", "start"]


def test_a_bucket_filled_at_its_completion_is_not_filled_again_at_its_launch() -> None:
    order: list[str] = []
    pipeline = _pipeline([0, 1], Fence())
    pipeline._shared.reduction.copy_in = lambda storage: order.append("fill") or storage.buffer
    pipeline._shared.reduction.start = lambda bucket: order.append("start") or _resolved(bucket.buffer())
    pipeline.fill()
    pipeline.launch(filled=True)
    assert order == ["fill", "start"]



def test_a_fill_ahead_of_the_launch_never_runs_the_nonfinite_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check is a collective: a skipped bucket is filled on some ranks only, and must issue none.
    monkeypatch.setattr(bucket_pipeline, "nonfinite_error", lambda *args: pytest.fail("checked"))
    fence = Fence()
    _pipeline([0], fence, check_nonfinite=True).fill()
    assert fence.in_flight() == []
