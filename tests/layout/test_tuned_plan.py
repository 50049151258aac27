"""``bucket_plan="tuned"``: the planner alone (optimal against brute force, link fit), then in training.

In training, with the selection's timings injected (they differ per rank): bit-equal to DDP at world
size 2 at every step, through every candidate layout; every rank adopts the layout that is fastest by
the slowest rank's times, at the same step; the layout survives a checkpoint; and runs where each
rank adopts its own modelled plan, or picks its own fastest candidate, are caught. The selection
loop alone is in test_plan_selection.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import random
from typing import Callable, Iterator

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from overlapddp.layout import selection, tuner
from overlapddp.layout.cost_model import (
    BucketTiming,
    FinalizeFit,
    LinkFit,
    fit_finalize,
    fit_link,
    predicted_end,
    tuned_plan,
)
from overlapddp.layout.plan import BucketPlan, explicit_plan
from tests.support import models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks
from tests.support.partitions import all_partitions

TUNED_FROM = 1 + tuner.CALIBRATION_ITERATIONS  # the first step with a selected candidate (the model's plan)
# Step 0: one bucket; from 1: DDP's rebuilt layout, measured; from TUNED_FROM: each candidate in turn;
# then the chosen one (one step later with static_graph), at the latest from 1 + TUNING_ITERATIONS.
STEPS = 2 + tuner.TUNING_ITERATIONS
# (name, model, optimizer, DDP options): the tuned plan also moves gradient_as_bucket_view's views
# and follows static_graph's delayed first iteration (reentrant checkpointing).
CASES = (
    ("transformer", "transformer", "adam", {}),
    ("cnn_bn", "cnn_bn", "sgd", {}),
    ("cnn_bn-bucket_view", "cnn_bn", "sgd", {"gradient_as_bucket_view": True}),
    ("checkpointed-static", "checkpointed", "sgd", {"static_graph": True}),
)
CASE_NAMES = [case for case, _, _, _ in CASES]


# -- the planner alone -------------------------------------------------------------------------


def _tensors(sizes: list[int], dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor]:
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes, strict=False)]


@pytest.mark.parametrize("with_finalize_work", [False, True], ids=["link-only", "with-finalize-work"])
@pytest.mark.parametrize("seed", range(20))
def test_tuned_plan_ends_as_early_as_the_best_split_in_ready_order(seed, with_finalize_work):
    rng = random.Random(seed)
    count = rng.randint(1, 9)
    params = _tensors([rng.randint(1, 5000) for _ in range(count)])
    ready = [rng.uniform(0, 1e-3) for _ in range(count)]
    link = LinkFit(alpha_s=rng.uniform(0, 2e-4), bytes_per_s=rng.uniform(1e7, 1e8))
    # Work after each reduction of the same order as the link time, so that it shapes the plan.
    work = FinalizeFit(rng.uniform(0, 2e-4), rng.uniform(0, 2e-8)) if with_finalize_work else FinalizeFit(0.0, 0.0)
    plan = tuned_plan(params, ready, link, work)
    order = sorted(range(count), key=lambda i: (ready[i], i))
    best = min(predicted_end(p, params, ready, link, work) for p in all_partitions(order))
    assert predicted_end(plan, params, ready, link, work) == pytest.approx(best, rel=1e-12, abs=0)
    assert [i for b in plan.buckets for i in b] == order  # consecutive runs of the ready order


def test_finalize_work_splits_the_last_bucket_so_less_work_follows_the_last_reduction():
    # Twenty small gradients all ready at the end of backward: on the link alone one bucket is
    # best (each extra bucket costs alpha); with work after each reduction, the earlier part's work
    # runs while the rest is on the link, so the plan splits it and ends sooner.
    params = _tensors([1000] * 20)
    ready = [0.0] * 20
    link = LinkFit(alpha_s=1e-5, bytes_per_s=1e7)  # 4 ms per gradient on the link
    work = FinalizeFit(per_tensor_s=1e-3, per_byte_s=0.0)
    assert len(tuned_plan(params, ready, link).buckets) == 1
    split = tuned_plan(params, ready, link, work)
    assert len(split.buckets) > 1
    one_bucket = BucketPlan((tuple(range(20)),), (0,))
    assert predicted_end(split, params, ready, link, work) < predicted_end(one_bucket, params, ready, link, work)


def test_tuned_plan_splits_off_a_late_large_gradient_that_ddp_caps_would_keep_together():
    # Three gradients ready early, one large gradient ready last: on a slow link, the early three
    # should start reducing before the last is ready, instead of waiting in one bucket.
    params = _tensors([1000, 1000, 1000, 250_000])
    plan = tuned_plan(params, [0.0, 1e-4, 2e-4, 5e-3], LinkFit(alpha_s=5e-5, bytes_per_s=1e8))
    assert plan.buckets[-1] == (3,)
    assert predicted_end(plan, params, [0.0, 1e-4, 2e-4, 5e-3], LinkFit(5e-5, 1e8)) < predicted_end(
        BucketPlan(((0, 1, 2, 3),), (0,)), params, [0.0, 1e-4, 2e-4, 5e-3], LinkFit(5e-5, 1e8)
    )


def test_tuned_plan_never_mixes_dtypes_in_a_bucket():
    params = _tensors([10, 10, 10, 10], [torch.float32, torch.float64, torch.float32, torch.float64])
    plan = tuned_plan(params, [0.0, 1.0, 2.0, 3.0], LinkFit(alpha_s=1.0, bytes_per_s=1e9))  # huge overhead
    for members in plan.buckets:
        assert len({params[i].dtype for i in members}) == 1


def test_fit_link_takes_the_launch_cost_as_overhead_and_the_rest_as_throughput():
    host, alpha, rate = 1e-4, 2e-4, 5e7
    timings, free = [], 0.0
    for launched, nbytes in ((0.0, 100_000), (0.001, 400_000), (0.002, 50_000), (0.02, 800_000)):
        finished = max(launched, free) + alpha + nbytes / rate  # the second and third queue
        timings.append(BucketTiming(nbytes, launched, finished, host_s=host + launched))
        free = finished
    fit = fit_link([timings])
    assert fit.alpha_s == host  # the cheapest launch
    # The service times add up to 4 * alpha + bytes / rate; what exceeds the overhead is transfer.
    assert fit.bytes_per_s == pytest.approx(1_350_000 / (4 * (alpha - host) + 1_350_000 / rate), rel=1e-9)


def test_fit_finalize_recovers_per_gradient_and_per_byte_costs():
    per_tensor, per_byte = 3e-5, 2e-10
    timings = [
        BucketTiming(nbytes, 0.0, 0.0, tensors=tensors, finalize_s=per_tensor * tensors + per_byte * nbytes)
        for tensors, nbytes in ((2, 9_000_000), (30, 400_000), (110, 1_200_000))
    ]
    fit = fit_finalize([timings])
    assert fit.per_tensor_s == pytest.approx(per_tensor, rel=1e-6)
    assert fit.per_byte_s == pytest.approx(per_byte, rel=1e-6)


def test_fit_finalize_drops_a_negative_coefficient_and_refits_the_other():
    # Time that falls with the byte count would fit a negative per-byte cost: keep per-gradient only.
    timings = [BucketTiming(nbytes, 0.0, 0.0, tensors=10, finalize_s=1e-3 - nbytes * 1e-10)
               for nbytes in (1_000, 2_000_000, 4_000_000)]
    fit = fit_finalize([timings])
    assert fit.per_byte_s == 0.0 and fit.per_tensor_s > 0
    assert fit_finalize([[BucketTiming(100, 0.0, 0.0)]]) == FinalizeFit(0.0, 0.0)  # nothing measured


def test_fit_link_of_an_idle_fast_link_is_never_degenerate():
    fit = fit_link([[BucketTiming(1000, 0.0, 0.0, host_s=0.0)]])
    assert fit.alpha_s == 0.0 and fit.bytes_per_s > 0


def test_calibration_measures_the_work_after_each_reduction_and_plans_with_it(one_rank, monkeypatch):
    # With an overlapped optimizer the work after a reduction includes that bucket's update; the
    # tuner must time it for every launched bucket and hand the fit to the planner.
    seen = {}

    def spy(params, ready, link, finalize):
        seen["finalize"] = finalize
        return tuned_plan(params, ready, link, finalize)

    def spy_fit(iterations):
        seen["timings"] = [list(buckets) for buckets in iterations]
        return fit_finalize(iterations)

    monkeypatch.setattr(tuner, "tuned_plan", spy)
    monkeypatch.setattr(tuner, "fit_finalize", spy_fit)
    ours = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    opt = models.optimizer("sgd", ours.parameters())
    ours.attach_optimizer(opt, overlap=True)
    for step in range(STEPS):
        inputs, target = models.batch("cnn_bn", 0, step)
        models.loss_of(ours(inputs), target).backward()
        opt.step()
        opt.zero_grad()
    assert len(seen["timings"]) == tuner.CALIBRATION_ITERATIONS
    for buckets in seen["timings"]:  # every gradient counted once, every bucket's work timed
        assert sum(b.tensors for b in buckets) == len(list(ours.parameters()))
        assert all(b.finalize_s > 0 for b in buckets)
    assert seen["finalize"].per_tensor_s > 0 or seen["finalize"].per_byte_s > 0


def test_bucket_plan_keyword_is_checked(one_rank):
    with pytest.raises(ValueError, match="bucket_plan must be one of 'ddp', 'tuned'"):
        OverlapDDP(models.build("mlp"), bucket_plan="fast")
    with pytest.raises(ValueError, match="find_unused_parameters=True never does"):
        OverlapDDP(models.build("mlp"), find_unused_parameters=True, bucket_plan="tuned")


# -- in training -------------------------------------------------------------------------------
# Four spawns: trained(2) (with the ready-times and PowerSGD checks), trained(3), the own-plan fault
# at 2 ranks, and resumed(3) (with the own-pick fault).


def _injected_seconds(rank: int, running: list[int], chosen: int, iterations: int) -> list[list[float]]:
    """Per running candidate, this rank's time of each iteration of a selection phase, such that rank
    r alone would pick ``running[r % len(running)]`` but ``chosen`` is the fastest by the median of
    each iteration's slowest rank; in a phase of 3 or more iterations one iteration of it is an
    outlier (a mean would not pick it)."""
    def seconds(c: int, iteration: int) -> float:
        if c == chosen and rank == 0 and iteration == 0 and iterations > 2:
            return 10.0
        return 1.0 if c == running[rank % len(running)] else 1.5 if c == chosen else 2.0

    return [[seconds(c, i) for i in range(iterations)] for c in running]


def _expected_selection(world_size: int, count: int, chosen: int) -> tuple[list[int], int]:
    """Recomputed from the injected times: the candidates the selection runs, in order, and the winner."""
    def slowest(running: list[int], iterations: int) -> list[list[float]]:
        times = [_injected_seconds(rank, running, chosen, iterations) for rank in range(world_size)]
        return [[max(t[c][i] for t in times) for i in range(iterations)] for c in range(len(running))]

    running, ran = list(range(count)), []
    if count > selection.FINALISTS:
        ran += running * selection.SCREENING_ITERATIONS
        ranked = selection.ranking(slowest(running, selection.SCREENING_ITERATIONS), min)
        running = [running[c] for c in ranked[: selection.FINALISTS]]
    ran += running * selection.FINAL_ITERATIONS
    return ran, running[selection.ranking(slowest(running, selection.FINAL_ITERATIONS))[0]]


@contextlib.contextmanager
def _injected_selection(rank: int, choose: Callable[[int], int], own_pick: bool = False) -> Iterator[list]:
    """This rank's selections time their candidates as ``_injected_seconds`` says, ``choose(count)``
    being the intended winner; yields the list each selection's candidates are appended to. Fault
    ``own_pick``: every rank picks its own winner among the (agreed) finalists."""
    seen: list[list[list[int]]] = []
    agree_on_ranking = selection.agree_on_ranking

    class Injected(selection.PlanSelection):
        def __init__(self, candidates, *args, **kwargs):
            seen.append([[list(members) for members in plan.buckets] for plan in candidates])
            super().__init__(candidates, *args, **kwargs)

        def local_seconds(self):
            return _injected_seconds(rank, self.running, choose(len(self.candidates)), self.iterations)

    def own_final_ranking(local, process_group, device, summary):
        agreed = agree_on_ranking(local, process_group, device, summary)  # every rank still joins
        return selection.ranking(local, summary) if len(local) <= selection.FINALISTS else agreed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuner, "PlanSelection", Injected)
        if own_pick:
            patch.setattr(selection, "agree_on_ranking", own_final_ranking)
        yield seen


@contextlib.contextmanager
def _timing_free_model_plan() -> Iterator[None]:
    """The model's plan is computed, then replaced by the parameters in index order cut in three:
    a layout the timings do not change, and unlike any layout of byte caps over the ready order."""
    planner = tuner.tuned_plan

    def thirds(params, ready, link, finalize):
        planner(params, ready, link, finalize)
        cut = len(params) // 3
        return explicit_plan(params, [range(cut), range(cut, 2 * cut), range(2 * cut, len(params))])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuner, "tuned_plan", thirds)
        yield


def _train_steps(model: OverlapDDP, opt: torch.optim.Optimizer, name: str, rank: int, steps: range) -> None:
    for step in steps:
        inputs, target = models.batch(name, rank, step)
        models.loss_of(model(inputs), target).backward()
        opt.step()
        opt.zero_grad()


def _planned_ready_times(rank: int) -> list[float] | None:
    """Rank 1 reports every gradient ready 5 s into backward; return what rank 0 planned with."""
    seen: dict[str, list[float]] = {}
    planner = tuner.tuned_plan

    def spy(params, ready, link, finalize):
        seen["ready"] = list(ready)
        return planner(params, ready, link, finalize)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuner, "tuned_plan", spy)
        if rank == 1:
            patch.setattr(tuner.PlanTuner, "_median_ready", lambda self: [5.0] * len(self._params))
        ours = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
        _train_steps(ours, models.optimizer("sgd", ours.parameters()), "cnn_bn", rank, range(TUNED_FROM + 1))
    return seen.get("ready")


def _powersgd_over_the_tuned_plan(rank: int) -> str:
    """The error for a PowerSGD start before the layout is final; then a run with a late start."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    model = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    final = 1 + tuner.TUNING_ITERATIONS
    early = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=final - 1)
    try:
        model.register_comm_hook(early, powersgd.powerSGD_hook)
    except ValueError as error:
        refused = str(error)
    else:
        refused = "no error"
    late = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=final)
    model.register_comm_hook(late, powersgd.powerSGD_hook)
    # Compression starts on the final layout and keeps working.
    _train_steps(model, models.optimizer("sgd", model.parameters()), "cnn_bn", rank, range(final + 2))
    return refused


@contextlib.contextmanager
def _own_plan_fault(rank: int) -> Iterator[None]:
    """Fault: rank 1 does not adopt rank 0's modelled layout as sent; it orders each bucket's members
    its own way (same bucket sizes, so the collectives run, but they sum mismatched values)."""
    agree = tuner.PlanTuner.agree

    def own_order(self, process_group, device):
        plan = agree(self, process_group, device)
        if rank == 1 and plan is not None:
            return BucketPlan(tuple(tuple(reversed(b)) for b in plan.buckets), plan.size_limits)
        return plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuner.PlanTuner, "agree", own_order)
        yield


def _train(rank: int, world_size: int, fault: str | None = None) -> dict[str, object]:
    """Every case side by side with DDP, the selection's timings injected: the last candidate wins,
    or under the fault ``"own-plan"`` the model's plan (the fault needs it to win)."""
    results: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        if fault == "own-plan":
            stack.enter_context(_own_plan_fault(rank))
        choose = (lambda count: 0) if fault == "own-plan" else (lambda count: count - 1)
        seen = stack.enter_context(_injected_selection(rank, choose))
        stack.enter_context(_timing_free_model_plan())
        for case, model_name, opt_name, options in CASES:
            seen.clear()
            ddp = DistributedDataParallel(models.build(model_name), bucket_cap_mb=0.01, **options)
            ours = OverlapDDP(models.build(model_name), bucket_cap_mb=0.01, bucket_plan="tuned", **options)
            ddp_opt = models.optimizer(opt_name, ddp.parameters())
            our_opt = models.optimizer(opt_name, ours.parameters())
            equal, layouts, tuned = [], [], []
            for step in range(STEPS):
                inputs, target = models.batch(model_name, rank, step)
                for wrapper, opt in ((ddp, ddp_opt), (ours, our_opt)):
                    models.loss_of(wrapper(inputs), target).backward()
                    opt.step()
                    # Keeping the gradients keeps gradient_as_bucket_view's views alive across re-plans.
                    opt.zero_grad(set_to_none=not options.get("gradient_as_bucket_view", False))
                states = zip(ddp.state_dict().values(), ours.state_dict().values(), strict=False)
                equal.append(all(torch.equal(a, b) for a, b in states))
                layouts.append(ours.bucket_indices())
                tuned.append(ours.bucket_state()["tuned_buckets"] is not None)
            parameters = b"".join(p.detach().numpy().tobytes() for p in ours.parameters())
            results[case] = {
                "equal": equal,
                "tuned": tuned,
                "layouts": layouts,
                "candidates": seen[0] if seen else None,
                "state": ours.bucket_state(),
                "parameters": hashlib.sha256(parameters).hexdigest(),
            }
    if world_size == 2 and fault is None:
        results["planned_ready"] = _planned_ready_times(rank)
        results["powersgd_refusal"] = _powersgd_over_the_tuned_plan(rank)
    return results


@functools.cache
def trained(world_size: int, fault: str | None = None) -> list[dict[str, object]]:
    return run_ranks(world_size, _train, fault, timeout_s=SLOW_TIMEOUT_S)


def _settled_at(case: str, candidates: int) -> int:
    """The step whose forward installs the final layout: after DDP's rebuild (step 1, 2 with a
    static graph), the calibration, and the selection's iterations (none for a single candidate)."""
    rebuilt = 2 if "static" in case else 1
    selected = len(_expected_selection(2, candidates, candidates - 1)[0]) if candidates > 1 else 0
    return rebuilt + tuner.CALIBRATION_ITERATIONS + selected


def _same_on_every_rank(layouts: list[object], what: str) -> None:
    assert all(layout == layouts[0] for layout in layouts), f"{what}: the ranks' layouts differ: {layouts}"


def test_tuned_plan_is_bit_equal_to_ddp_at_world_size_2_through_every_layout():
    for rank, results in enumerate(trained(2)):
        for case in CASE_NAMES:
            result = results[case]
            assert result["equal"] == [True] * STEPS, f"rank {rank} {case}: {result['equal']}"
            assert result["state"]["tuned_buckets"] == result["layouts"][-1]


def test_every_rank_adopts_the_fastest_layout_by_the_slowest_ranks_times_at_the_same_step():
    # The injected timings differ per rank: each rank alone would pick another candidate.
    for world_size in (2, 3):
        per_rank = trained(world_size)
        for case in CASE_NAMES:
            _same_on_every_rank([r[case]["layouts"] for r in per_rank], case)
            layouts, candidates = per_rank[0][case]["layouts"], per_rank[0][case]["candidates"]
            count = len(candidates)
            settled = _settled_at(case, count)
            assert settled < STEPS and per_rank[0][case]["tuned"] == [False] * settled + [True] * (STEPS - settled)
            # The winner, recomputed: each iteration's slowest rank, then the lowest median, in the
            # screen and again among the finalists.
            expected_ran, winner = _expected_selection(world_size, count, count - 1)
            assert winner == count - 1 and layouts[-1] == candidates[winner], case
            assert layouts[settled:] == [layouts[-1]] * (STEPS - settled), case
            # The candidates took turns, each for its iterations, before the winner was installed.
            assert layouts[settled - len(expected_ran): settled] == [candidates[c] for c in expected_ran], case
            assert count > 1, f"{case}: the model's plan and the user's caps differ, so there is a selection"


def test_at_world_size_3_replicas_stay_identical_and_follow_ddp_closely():
    # The same reduction in other buckets: gloo may sum in another order at 3 ranks, so DDP is only
    # matched to float32 rounding here, but every replica must hold exactly the same parameters.
    per_rank = trained(3)
    for case in CASE_NAMES:
        assert len({r[case]["parameters"] for r in per_rank}) == 1, case
        assert all(per_rank[0][case]["equal"][:TUNED_FROM]), case  # DDP's layout until the model's plan


def test_ranks_adopting_their_own_modelled_plans_are_caught():
    per_rank = trained(2, "own-plan")
    for case in CASE_NAMES:
        assert per_rank[0][case]["layouts"][-1] == per_rank[0][case]["candidates"][0]  # the model's plan won
        assert any(len(b) > 1 for b in per_rank[0][case]["layouts"][-1]), "the fault needs a shared bucket"
        assert all(r[case]["equal"][:TUNED_FROM] for r in per_rank)
        assert not any(r[case]["equal"][-1] for r in per_rank), case


def test_rank_0_plans_with_the_slowest_ranks_ready_times():
    # A bucket's collective proceeds only when every rank launched it, so the plan must use the
    # latest ready time of each gradient over the ranks, not rank 0's own.
    planned = trained(2)[0]["planned_ready"]
    assert planned is not None and planned == [5.0] * len(planned)


def test_powersgd_must_start_after_the_tuned_layout_is_final():
    for result in trained(2):
        assert f"set start_powerSGD_iter >= {1 + tuner.TUNING_ITERATIONS}" in result["powersgd_refusal"]


def _final_layout(rank: int, own_pick: bool) -> list[list[int]]:
    """The layout each rank installs when the selection ends (taken after that forward, before a
    backward whose collectives would not match if the ranks disagree)."""
    with _injected_selection(rank, lambda count: count - 1, own_pick), _timing_free_model_plan():
        model = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.001, bucket_plan="tuned")
        opt = models.optimizer("sgd", model.parameters())
        for step in range(STEPS):
            inputs, target = models.batch("cnn_bn", rank, step)
            output = model(inputs)
            if model.bucket_state()["tuned_buckets"] is not None:
                return model.bucket_indices()
            models.loss_of(output, target).backward()
            opt.step()
            opt.zero_grad()
    raise AssertionError("the selection did not end")


def _resume(rank: int, world_size: int) -> dict[str, object]:
    """A run that restores a checkpoint of the selected layout continues bit-equal to the
    uninterrupted run. The injected timings select DDP's default layout (one bucket here), which
    is neither the model's plan nor the layout of the user's caps (0.001 MiB: two buckets). Then the layouts
    the ranks pick when each picks its own fastest, and when they agree."""
    def run(steps: range, model: OverlapDDP, opt: torch.optim.Optimizer) -> bool:
        """Train ``steps``; whether the layout is final after them."""
        _train_steps(model, opt, "cnn_bn", rank, steps)
        return model.bucket_state()["tuned_buckets"] is not None

    with _injected_selection(rank, lambda count: count - 1) as seen, _timing_free_model_plan():
        whole = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.001, bucket_plan="tuned")
        whole_opt = models.optimizer("sgd", whole.parameters())
        settled = next(step for step in range(STEPS) if run(range(step, step + 1), whole, whole_opt))
    # As torch.save would: a copy, not the live tensors that the run goes on updating.
    checkpoint = copy.deepcopy((whole.state_dict(), whole_opt.state_dict(), whole.bucket_state()))
    run(range(settled + 1, settled + 4), whole, whole_opt)

    resumed = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.001, bucket_plan="tuned")
    resumed_opt = models.optimizer("sgd", resumed.parameters())
    resumed.load_state_dict(checkpoint[0])
    resumed_opt.load_state_dict(checkpoint[1])
    resumed.load_bucket_state(checkpoint[2])
    restored = resumed.bucket_indices()
    run(range(settled + 1, settled + 4), resumed, resumed_opt)
    states = zip(whole.state_dict().values(), resumed.state_dict().values(), strict=False)
    return {
        "candidates": seen[0],
        "saved": checkpoint[2]["tuned_buckets"],
        "restored": restored,
        "equal": all(torch.equal(a, b) for a, b in states),
        "agreed": _final_layout(rank, own_pick=False),
        "own_pick": _final_layout(rank, own_pick=True),
    }


@functools.cache
def resumed() -> list[dict[str, object]]:
    return run_ranks(3, _resume, timeout_s=SLOW_TIMEOUT_S)


def test_a_checkpoint_of_the_selected_layout_resumes_with_the_same_layout_and_bits():
    for result in resumed():
        assert len(result["candidates"]) == 3  # the model's plan, the user's caps, one bucket (DDP's default)
        assert result["saved"] == result["restored"] == result["candidates"][-1]
        assert result["equal"]


def test_ranks_that_pick_their_own_fastest_layout_are_caught():
    per_rank = resumed()
    _same_on_every_rank([r["agreed"] for r in per_rank], "agreed")
    with pytest.raises(AssertionError, match="the ranks' layouts differ"):
        _same_on_every_rank([r["own_pick"] for r in per_rank], "own pick")
