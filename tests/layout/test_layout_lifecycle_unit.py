"""The bucket layout's lifecycle in one process, with the tuner and rank 0's broadcast stood in for:
the first phase and the last iteration whose buckets change, DDP's one rebuild from rank 0's ready
order, what the reducer's per-step questions record or hand to the tuner, and a checkpoint's layout,
accepted or refused. The multi-process tests reach these branches only through whole runs, where a
wrong answer often still trains; here each answer is checked as a value."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch

from overlapddp.clock import BucketStamps, HostClock
from overlapddp.fence import Fence
from overlapddp.layout import lifecycle as layout_lifecycle
from overlapddp.layout.lifecycle import LayoutLifecycle, LayoutPhase
from overlapddp.layout.plan import BucketCaps, BucketPlan, explicit_plan, initial_plan, rebuilt_plan
from overlapddp.layout.tuner import TUNING_ITERATIONS
from overlapddp.options import ReducerOptions

PARAMS = [torch.zeros(3), torch.zeros(5), torch.zeros(2), torch.zeros(4)]  # 12, 20, 8, 16 bytes
SPARSE = [False] * len(PARAMS)
CAPS = BucketCaps(first_bytes=16, bytes_cap=32)
GROUP: Any = object()
DEVICE = torch.device("cpu")
RANK0_ORDER = [3, 2, 1, 0]
ELSEWHERE = BucketPlan(((0, 1, 2, 3),), (56,))


class StandInTuner:
    """Records the lifecycle's calls; the test sets ``done`` and ``measuring``, and what the next
    ``between_iterations`` adopts and whether it finishes."""

    def __init__(self, params: Sequence[torch.Tensor], sparse_gradient: Sequence[bool]) -> None:
        self.params, self.sparse_gradient = list(params), list(sparse_gradient)
        self.done = False
        self.measuring = False
        self.calls: list[str] = []
        self.between: list[tuple[object, torch.device, list[int], BucketPlan]] = []
        self.switch_to: BucketPlan | None = None
        self.finishes = False

    def start_iteration(self, in_force: BucketPlan) -> BucketStamps | None:
        self.calls.append("start_iteration")
        return BucketStamps(HostClock(), len(self.params)) if self.measuring else None

    def end_iteration(self) -> None:
        self.calls.append("end_iteration")

    def shadow_iteration(self) -> None:
        self.calls.append("shadow_iteration")

    def discard_iteration(self) -> None:
        self.calls.append("discard_iteration")

    def restored(self) -> None:
        self.calls.append("restored")
        self.done = True

    def between_iterations(self, process_group: object, device: torch.device, rebuilt_from: Sequence[int],
                           in_force: BucketPlan, adopt: Callable[[BucketPlan], None]) -> None:
        self.calls.append("between_iterations")
        self.between.append((process_group, device, list(rebuilt_from), in_force))
        if self.switch_to is not None:
            adopt(self.switch_to)
        self.done = self.done or self.finishes


class StandIns:
    """The tuners the lifecycle made, and the broadcasts it issued (each answered with rank 0's order)."""

    def __init__(self) -> None:
        self.tuners: list[StandInTuner] = []
        self.broadcasts: list[tuple[list[int], torch.dtype, torch.device, int, object]] = []
        self.adopted: list[BucketPlan] = []

    def make_tuner(self, params: Sequence[torch.Tensor], sparse_gradient: Sequence[bool]) -> StandInTuner:
        self.tuners.append(StandInTuner(params, sparse_gradient))
        return self.tuners[-1]

    def broadcast_from(self, tensor: torch.Tensor, source: int, process_group: object) -> None:
        self.broadcasts.append((tensor.tolist(), tensor.dtype, tensor.device, source, process_group))
        tensor.copy_(torch.tensor(RANK0_ORDER))

    def forward(self, lifecycle: LayoutLifecycle, in_force: BucketPlan = ELSEWHERE) -> None:
        lifecycle.at_forward(GROUP, DEVICE, in_force, self.adopted.append)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> StandIns:
    stand_ins = StandIns()
    monkeypatch.setattr(layout_lifecycle, "PlanTuner", stand_ins.make_tuner)
    monkeypatch.setattr(layout_lifecycle, "broadcast_from", stand_ins.broadcast_from)
    return stand_ins


def _lifecycle(**options: bool) -> LayoutLifecycle:
    return LayoutLifecycle(PARAMS, SPARSE, CAPS, ReducerOptions(**options))


def _record(lifecycle: LayoutLifecycle, order: Sequence[int]) -> None:
    record = lifecycle.start_iteration(Fence(), ELSEWHERE)
    assert record is not None
    for index in order:
        record(index)


def _rebuild(lifecycle: LayoutLifecycle, stand_ins: StandIns) -> None:
    _record(lifecycle, [0, 1, 2, 3])
    stand_ins.forward(lifecycle)
    stand_ins.broadcasts.clear()
    stand_ins.adopted.clear()


@pytest.mark.parametrize(
    ("options", "expected"),
    [({}, 1), ({"static_graph": True}, 2), ({"tuned_plan": True}, 1 + TUNING_ITERATIONS),
     ({"static_graph": True, "tuned_plan": True}, 2 + TUNING_ITERATIONS)],
    ids=("plain", "static", "tuned", "static-tuned"),
)
def test_the_final_iteration_is_ddps_rebuild_plus_the_tuning_iterations(options: dict[str, bool], expected: int) -> None:
    assert _lifecycle(**options).final_iteration == expected


@pytest.mark.parametrize("tuned_plan", (False, True), ids=("untuned", "tuned"))
def test_a_fresh_lifecycle_awaits_the_rebuild_and_has_changed_nothing(tuned_plan: bool) -> None:
    lifecycle = _lifecycle(tuned_plan=tuned_plan)
    assert lifecycle.phase is LayoutPhase.AWAITING_REBUILD
    assert lifecycle.rebuilt is False
    assert lifecycle.changed is False
    assert lifecycle.tuned is False
    assert lifecycle.bucket_order() is None


def test_the_tuner_is_made_only_with_a_tuned_plan_from_the_params_and_their_sparsity(stand_ins: StandIns) -> None:
    _lifecycle()
    assert stand_ins.tuners == []
    _lifecycle(tuned_plan=True)
    (tuner,) = stand_ins.tuners
    assert tuner.params == PARAMS and tuner.sparse_gradient == SPARSE


@pytest.mark.parametrize(
    ("options", "phase"),
    [({"find_unused_parameters": True}, LayoutPhase.FINAL),
     ({"find_unused_parameters": True, "tuned_plan": True}, LayoutPhase.TUNING),
     ({"find_unused_parameters": True, "static_graph": True}, LayoutPhase.AWAITING_REBUILD)],
    ids=("untuned", "tuned", "static-graph"),
)
def test_searching_unused_parameters_each_forward_skips_the_rebuild(options: dict[str, bool], phase: LayoutPhase) -> None:
    lifecycle = _lifecycle(**options)
    assert lifecycle.phase is phase
    assert lifecycle.rebuilt is (phase is not LayoutPhase.AWAITING_REBUILD)


def test_enabling_the_static_graph_awaits_the_rebuild_again_one_iteration_later() -> None:
    lifecycle = _lifecycle(find_unused_parameters=True)
    assert lifecycle.phase is LayoutPhase.FINAL and lifecycle.final_iteration == 1
    lifecycle.enable_static_graph()
    assert lifecycle.phase is LayoutPhase.AWAITING_REBUILD
    assert lifecycle.final_iteration == 2


@pytest.mark.parametrize(
    ("find_unused_parameters", "buckets"),
    [(False, ((0, 1, 2, 3),)), (True, ((2, 3), (0, 1)))],
    ids=("one-unlimited-bucket", "rebuild-caps"),
)
def test_the_initial_plan_is_ddps_in_reverse_registration_order(find_unused_parameters: bool, buckets: tuple[tuple[int, ...], ...]) -> None:
    plan = _lifecycle(find_unused_parameters=find_unused_parameters).initial_plan()
    assert plan == initial_plan(PARAMS, SPARSE, CAPS, find_unused_parameters)
    assert plan.buckets == buckets


def test_a_forward_before_any_ready_order_broadcasts_and_adopts_nothing(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    stand_ins.forward(lifecycle)
    assert stand_ins.broadcasts == [] and stand_ins.adopted == []
    assert lifecycle.phase is LayoutPhase.AWAITING_REBUILD
    assert stand_ins.tuners[0].calls == []


def test_the_first_forward_with_a_ready_order_adopts_the_plan_rebuilt_from_rank_0s(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle()
    _record(lifecycle, [0, 1, 2, 3])
    stand_ins.forward(lifecycle)
    assert stand_ins.broadcasts == [([0, 1, 2, 3], torch.int64, DEVICE, 0, GROUP)]
    assert stand_ins.adopted == [rebuilt_plan(PARAMS, SPARSE, CAPS, RANK0_ORDER)]
    assert stand_ins.adopted[0].buckets == ((3,), (2, 1, 0))
    assert lifecycle.bucket_order() == RANK0_ORDER
    assert lifecycle.phase is LayoutPhase.FINAL
    assert lifecycle.rebuilt is True
    assert lifecycle.changed is True
    assert lifecycle.tuned is False


def test_the_rebuild_happens_once_and_later_forwards_without_a_tuner_do_nothing(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle()
    _rebuild(lifecycle, stand_ins)
    stand_ins.forward(lifecycle)
    assert stand_ins.broadcasts == [] and stand_ins.adopted == []
    assert lifecycle.phase is LayoutPhase.FINAL


@pytest.mark.parametrize(("done", "phase"), [(False, LayoutPhase.TUNING), (True, LayoutPhase.FINAL)], ids=("tuning", "done"))
def test_with_a_tuner_the_rebuild_starts_tuning_unless_it_is_done(stand_ins: StandIns, done: bool, phase: LayoutPhase) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    stand_ins.tuners[0].done = done
    _rebuild(lifecycle, stand_ins)
    assert lifecycle.phase is phase
    assert stand_ins.tuners[0].calls == []


def test_after_the_rebuild_each_forward_lets_the_tuner_switch_layouts_until_it_is_done(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    tuner = stand_ins.tuners[0]
    _rebuild(lifecycle, stand_ins)
    in_force = rebuilt_plan(PARAMS, SPARSE, CAPS, RANK0_ORDER)
    stand_ins.forward(lifecycle, in_force)
    assert tuner.between == [(GROUP, DEVICE, RANK0_ORDER, in_force)]
    assert lifecycle.phase is LayoutPhase.TUNING and lifecycle.tuned is False
    tuner.switch_to, tuner.finishes = ELSEWHERE, True
    stand_ins.forward(lifecycle, in_force)
    assert stand_ins.adopted == [ELSEWHERE]
    assert lifecycle.phase is LayoutPhase.FINAL
    assert lifecycle.tuned is True
    assert stand_ins.broadcasts == []


def test_a_done_tuner_marks_the_layout_tuned_and_changed_even_without_a_rebuild(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    stand_ins.tuners[0].done = True
    assert lifecycle.tuned is True
    assert lifecycle.changed is True
    assert lifecycle.bucket_order() is None


def test_while_the_rebuild_is_awaited_start_iteration_hands_out_the_recorder_and_no_tuner(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    stand_ins.tuners[0].measuring = True
    fence = Fence()
    record = lifecycle.start_iteration(fence, ELSEWHERE)
    assert callable(record) and fence.stamps is None
    assert stand_ins.tuners[0].calls == []


def test_after_the_rebuild_without_a_tuner_start_iteration_hands_out_nothing(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle()
    _rebuild(lifecycle, stand_ins)
    fence = Fence()
    assert lifecycle.start_iteration(fence, ELSEWHERE) is None and fence.stamps is None


@pytest.mark.parametrize("measuring", (False, True), ids=("idle", "measuring"))
def test_after_the_rebuild_the_fence_stamps_for_the_tuner_only_while_it_measures_until_the_iteration_ends(
    stand_ins: StandIns, measuring: bool
) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    tuner = stand_ins.tuners[0]
    _rebuild(lifecycle, stand_ins)
    tuner.measuring = measuring
    fence = Fence()
    assert lifecycle.start_iteration(fence, ELSEWHERE) is None
    assert (fence.stamps is not None) is measuring
    assert tuner.calls == ["start_iteration"]
    lifecycle.iteration_reduced([])
    assert fence.stamps is None and tuner.calls == ["start_iteration", "end_iteration"]


def test_an_abandoned_measured_iteration_stops_the_stamps(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    _rebuild(lifecycle, stand_ins)
    stand_ins.tuners[0].measuring = True
    fence = Fence()
    lifecycle.start_iteration(fence, ELSEWHERE)
    lifecycle.iteration_abandoned()
    assert fence.stamps is None


@pytest.mark.parametrize(
    ("static_graph", "recorded", "unused", "broadcast"),
    [(True, [3, 1], [0, 2], [[3, 1, 0, 2]]), (False, [3, 1, 0, 2], [0], [[3, 1, 0, 2]]), (True, [], [0, 1, 2, 3], [])],
    ids=("static-appends", "dynamic-does-not", "nothing-recorded"),
)
def test_a_static_graph_appends_the_unused_parameters_to_a_recorded_order(
    stand_ins: StandIns, static_graph: bool, recorded: list[int], unused: list[int], broadcast: list[list[int]]
) -> None:
    lifecycle = _lifecycle(static_graph=static_graph)
    _record(lifecycle, recorded)
    lifecycle.iteration_reduced(unused)
    stand_ins.forward(lifecycle)
    assert [sent for sent, *_ in stand_ins.broadcasts] == broadcast


def test_every_reduced_iteration_is_reported_to_the_tuner(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True, static_graph=True)
    tuner = stand_ins.tuners[0]
    lifecycle.iteration_reduced([])
    _rebuild(lifecycle, stand_ins)
    lifecycle.iteration_reduced([1])
    assert tuner.calls == ["end_iteration", "end_iteration"]


@pytest.mark.parametrize(("recorded", "broadcast"), [([], [0, 1, 2, 3]), ([3, 1, 2, 0], [3, 1, 2, 0])], ids=("empty", "recorded"))
def test_a_shadowed_iteration_counts_every_parameter_ready_in_order_only_if_none_was_recorded(
    stand_ins: StandIns, recorded: list[int], broadcast: list[int]
) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    _record(lifecycle, recorded)
    lifecycle.iteration_shadowed()
    assert stand_ins.tuners[0].calls == []
    stand_ins.forward(lifecycle)
    assert [sent for sent, *_ in stand_ins.broadcasts] == [broadcast]


def test_after_the_rebuild_a_shadowed_iteration_goes_to_the_tuner(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    _rebuild(lifecycle, stand_ins)
    lifecycle.iteration_shadowed()
    assert stand_ins.tuners[0].calls == ["shadow_iteration"]
    untuned = _lifecycle()
    _rebuild(untuned, stand_ins)
    untuned.iteration_shadowed()
    assert untuned.phase is LayoutPhase.FINAL


@pytest.mark.parametrize("tuned_plan", (False, True), ids=("untuned", "tuned"))
def test_an_abandoned_iteration_forgets_its_ready_order_and_the_tuners_partial_timings(
    stand_ins: StandIns, tuned_plan: bool
) -> None:
    lifecycle = _lifecycle(tuned_plan=tuned_plan)
    _record(lifecycle, [0, 1, 2, 3])
    lifecycle.iteration_abandoned()
    stand_ins.forward(lifecycle)
    assert stand_ins.broadcasts == []
    assert lifecycle.phase is LayoutPhase.AWAITING_REBUILD
    assert [t.calls for t in stand_ins.tuners] == ([["discard_iteration"]] if tuned_plan else [])


@pytest.mark.parametrize(("tuned_plan", "phase"), [(False, LayoutPhase.FINAL), (True, LayoutPhase.TUNING)], ids=("untuned", "tuned"))
def test_a_restored_order_is_rebuilt_from_and_replaces_the_recorded_one(
    stand_ins: StandIns, tuned_plan: bool, phase: LayoutPhase
) -> None:
    lifecycle = _lifecycle(tuned_plan=tuned_plan)
    _record(lifecycle, [0, 1, 2])
    plan = lifecycle.restore(RANK0_ORDER, None)
    assert plan == rebuilt_plan(PARAMS, SPARSE, CAPS, RANK0_ORDER)
    assert lifecycle.bucket_order() == RANK0_ORDER
    assert lifecycle._ready_order == []
    assert lifecycle.phase is phase
    assert lifecycle.changed is True
    assert lifecycle.tuned is False
    assert [t.calls for t in stand_ins.tuners] == ([[]] if tuned_plan else [])


def test_a_restored_tuned_layout_is_installed_as_given_and_final(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    tuned = [[3, 0], [1, 2]]
    plan = lifecycle.restore(RANK0_ORDER, tuned)
    assert plan == explicit_plan(PARAMS, tuned)
    assert plan.buckets == ((3, 0), (1, 2))
    assert stand_ins.tuners[0].calls == ["restored"]
    assert lifecycle.phase is LayoutPhase.FINAL
    assert lifecycle.tuned is True
    assert lifecycle.bucket_order() == RANK0_ORDER


def _assert_unchanged_and_rebuilds_on_its_own(lifecycle: LayoutLifecycle, stand_ins: StandIns) -> None:
    assert lifecycle.phase is LayoutPhase.AWAITING_REBUILD
    assert lifecycle.bucket_order() is None
    assert lifecycle.changed is False
    stand_ins.forward(lifecycle)
    assert [sent for sent, *_ in stand_ins.broadcasts] == [[0, 1, 2, 3]]


def test_a_tuned_layout_without_a_tuner_is_refused_and_changes_nothing(stand_ins: StandIns) -> None:
    lifecycle = _lifecycle()
    _record(lifecycle, [0, 1, 2, 3])
    with pytest.raises(ValueError) as raised:
        lifecycle.restore(RANK0_ORDER, [[0, 1], [2, 3]])
    assert str(raised.value) == "This bucket state holds a tuned layout; construct with bucket_plan='tuned'."
    _assert_unchanged_and_rebuilds_on_its_own(lifecycle, stand_ins)


@pytest.mark.parametrize(
    "tuned",
    [[[0, 1], [2]], [[0, 0], [1, 2]], [[0, 1], [1, 3]], [[0, 1], [2, 3], [3]], [[0, 1], [2, 4]], []],
    ids=("missing", "duplicate-for-missing", "duplicate-inside", "extra", "out-of-range", "empty"),
)
def test_a_tuned_layout_without_each_parameter_exactly_once_is_refused_and_changes_nothing(
    stand_ins: StandIns, tuned: list[list[int]]
) -> None:
    lifecycle = _lifecycle(tuned_plan=True)
    _record(lifecycle, [0, 1, 2, 3])
    with pytest.raises(ValueError) as raised:
        lifecycle.restore(RANK0_ORDER, tuned)
    assert str(raised.value) == "The tuned layout must hold each of the 4 parameters once."
    assert stand_ins.tuners[0].calls == []
    _assert_unchanged_and_rebuilds_on_its_own(lifecycle, stand_ins)
