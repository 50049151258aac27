"""``bucket_plan="tuned"``: the planner alone (optimal against brute force, link fit), then in training.

In training: bit-equal to DDP at world size 2 at every step, before and after the re-plan; every
rank adopts rank 0's layout; the layout survives a checkpoint; and a run where each rank adopts its
own plan (no agreement) is caught.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import random

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP, plan_tuner
from overlapddp.bucket_plan import BucketPlan
from overlapddp.tuned_plan import (
    BucketTiming,
    FinalizeFit,
    LinkFit,
    fit_finalize,
    fit_link,
    predicted_end,
    tuned_plan,
)
from tests import models
from tests.multiprocess import SLOW_TIMEOUT_S, run_ranks

STEPS = 6  # iteration 1: one bucket; 2-3: DDP's rebuilt layout, measured; 4-6: the tuned layout
TUNED_FROM = 1 + plan_tuner.CALIBRATION_ITERATIONS  # index of the first step with the tuned layout
# (name, model, optimizer, DDP options): the tuned plan also moves gradient_as_bucket_view's views
# and follows static_graph's delayed first iteration (reentrant checkpointing).
CASES = (
    ("transformer", "transformer", "adam", {}),
    ("cnn_bn", "cnn_bn", "sgd", {}),
    ("cnn_bn-bucket_view", "cnn_bn", "sgd", {"gradient_as_bucket_view": True}),
    ("checkpointed-static", "checkpointed", "sgd", {"static_graph": True}),
)


# -- the planner alone -------------------------------------------------------------------------


def _tensors(sizes: list[int], dtypes: list[torch.dtype] | None = None) -> list[torch.Tensor]:
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]


def _all_partitions(order: list[int]) -> list[BucketPlan]:
    """Every split of ``order`` into consecutive runs."""
    plans = []
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        buckets, current = [], [order[0]]
        for cut, index in zip(cuts, order[1:]):
            if cut:
                buckets.append(tuple(current))
                current = []
            current.append(index)
        buckets.append(tuple(current))
        plans.append(BucketPlan(tuple(buckets), tuple(0 for _ in buckets)))
    return plans


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
    best = min(predicted_end(p, params, ready, link, work) for p in _all_partitions(order))
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

    monkeypatch.setattr(plan_tuner, "tuned_plan", spy)
    monkeypatch.setattr(plan_tuner, "fit_finalize", spy_fit)
    ours = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    opt = models.optimizer("sgd", ours.parameters())
    ours.attach_optimizer(opt, overlap=True)
    for step in range(STEPS):
        inputs, target = models.batch("cnn_bn", 0, step)
        models.loss_of(ours(inputs), target).backward()
        opt.step()
        opt.zero_grad()
    assert len(seen["timings"]) == plan_tuner.CALIBRATION_ITERATIONS
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


def _planned_ready_times(rank: int, world_size: int) -> list[float] | None:
    """Rank 1 reports every gradient ready 5 s into backward; return what rank 0 planned with."""
    seen: dict[str, list[float]] = {}
    if rank == 1:
        plan_tuner.PlanTuner._median_ready = lambda self: [5.0] * len(self._params)
    planner = plan_tuner.tuned_plan

    def spy(params, ready, link, finalize):
        seen["ready"] = list(ready)
        return planner(params, ready, link, finalize)

    plan_tuner.tuned_plan = spy
    ours = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    opt = models.optimizer("sgd", ours.parameters())
    for step in range(STEPS):
        inputs, target = models.batch("cnn_bn", rank, step)
        models.loss_of(ours(inputs), target).backward()
        opt.step()
        opt.zero_grad()
    return seen.get("ready")


def test_rank_0_plans_with_the_slowest_ranks_ready_times():
    # A bucket's collective proceeds only when every rank launched it, so the plan must use the
    # latest ready time of each gradient over the ranks, not rank 0's own.
    planned = run_ranks(2, _planned_ready_times)[0]
    assert planned is not None and planned == [5.0] * len(planned)


def _own_plan_fault(rank: int) -> None:
    """Fault: rank 1 does not adopt rank 0's layout as sent; it orders each bucket's members its own
    way (same bucket sizes, so the collectives run, but they sum mismatched values)."""
    agree = plan_tuner.PlanTuner.agree

    def own_order(self, process_group, device):
        plan = agree(self, process_group, device)
        if rank == 1 and plan is not None:
            return BucketPlan(tuple(tuple(reversed(b)) for b in plan.buckets), plan.size_limits)
        return plan

    plan_tuner.PlanTuner.agree = own_order


def _train(rank: int, world_size: int, own_plans: bool = False) -> dict[str, object]:
    if own_plans:
        _own_plan_fault(rank)
    results: dict[str, object] = {}
    for case, model_name, opt_name, options in CASES:
        ddp = DistributedDataParallel(models.build(model_name), bucket_cap_mb=0.01, **options)
        ours = OverlapDDP(models.build(model_name), bucket_cap_mb=0.01, bucket_plan="tuned", **options)
        ddp_opt, our_opt = models.optimizer(opt_name, ddp.parameters()), models.optimizer(opt_name, ours.parameters())
        equal, layouts, tuned = [], [], []
        for step in range(STEPS):
            inputs, target = models.batch(model_name, rank, step)
            for wrapper, opt in ((ddp, ddp_opt), (ours, our_opt)):
                models.loss_of(wrapper(inputs), target).backward()
                opt.step()
                # Keeping the gradients keeps gradient_as_bucket_view's views alive across the re-plan.
                opt.zero_grad(set_to_none=not options.get("gradient_as_bucket_view", False))
            equal.append(all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), ours.state_dict().values())))
            layouts.append(ours.bucket_indices())
            tuned.append(ours.bucket_state()["tuned_buckets"] is not None)
        results[case] = {
            "equal": equal,
            "tuned": tuned,
            "layouts": layouts,
            "state": ours.bucket_state(),
            "parameters": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in ours.parameters())).hexdigest(),
        }
    return results


@functools.cache
def trained(world_size: int) -> list[dict[str, object]]:
    return run_ranks(world_size, _train, timeout_s=SLOW_TIMEOUT_S)


def test_tuned_plan_is_bit_equal_to_ddp_at_world_size_2_before_and_after_the_replan():
    for rank, results in enumerate(trained(2)):
        for model_name, result in results.items():
            assert result["equal"] == [True] * STEPS, f"rank {rank} {model_name}: {result['equal']}"
            assert result["state"]["tuned_buckets"] == result["layouts"][-1]


def test_every_rank_adopts_rank_0s_tuned_layout_at_the_same_step():
    for world_size in (2, 3):
        per_rank = trained(world_size)
        for model_name in per_rank[0]:
            layouts = [r[model_name]["layouts"] for r in per_rank]
            assert all(layout == layouts[0] for layout in layouts), model_name
            # The re-plan happened, at the forward the reducer announces, and the layout then stays
            # (the tuned layout may happen to equal DDP's, so the change itself is not required).
            replan = TUNED_FROM + (1 if "static" in model_name else 0)
            assert per_rank[0][model_name]["tuned"] == [False] * replan + [True] * (STEPS - replan), model_name
            assert layouts[0][replan:] == [layouts[0][-1]] * (STEPS - replan)
            assert per_rank[0][model_name]["state"]["tuned_buckets"] is not None


def test_at_world_size_3_replicas_stay_identical_and_follow_ddp_closely():
    # The same reduction in other buckets: gloo may sum in another order at 3 ranks, so DDP is only
    # matched to float32 rounding here, but every replica must hold exactly the same parameters.
    per_rank = trained(3)
    for model_name in per_rank[0]:
        assert len({r[model_name]["parameters"] for r in per_rank}) == 1, model_name
        assert all(per_rank[0][model_name]["equal"][:TUNED_FROM]), model_name  # DDP's layout until the re-plan


def test_ranks_adopting_their_own_plans_are_caught():
    per_rank = run_ranks(2, _train, True, timeout_s=SLOW_TIMEOUT_S)
    for model_name in per_rank[0]:
        assert any(len(b) > 1 for b in per_rank[0][model_name]["layouts"][-1]), "the fault needs a shared bucket"
        assert all(r[model_name]["equal"][:TUNED_FROM] for r in per_rank)
        assert not any(r[model_name]["equal"][-1] for r in per_rank), model_name


def _resume(rank: int, world_size: int) -> bool:
    """A run that restores a tuned checkpoint continues bit-equal to the uninterrupted run."""
    def run(steps: range, model: OverlapDDP, opt) -> None:
        for step in steps:
            inputs, target = models.batch("cnn_bn", rank, step)
            models.loss_of(model(inputs), target).backward()
            opt.step()
            opt.zero_grad()

    whole = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    whole_opt = models.optimizer("sgd", whole.parameters())
    run(range(TUNED_FROM + 1), whole, whole_opt)
    # As torch.save would: a copy, not the live tensors that the run goes on updating.
    checkpoint = copy.deepcopy((whole.state_dict(), whole_opt.state_dict(), whole.bucket_state()))
    run(range(TUNED_FROM + 1, STEPS + 2), whole, whole_opt)

    resumed = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    resumed_opt = models.optimizer("sgd", resumed.parameters())
    resumed.load_state_dict(checkpoint[0])
    resumed_opt.load_state_dict(checkpoint[1])
    resumed.load_bucket_state(checkpoint[2])
    same_layout = resumed.bucket_indices() == checkpoint[2]["tuned_buckets"]
    run(range(TUNED_FROM + 1, STEPS + 2), resumed, resumed_opt)
    return same_layout and all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_a_tuned_checkpoint_resumes_with_the_same_layout_and_bits():
    assert run_ranks(3, _resume, timeout_s=SLOW_TIMEOUT_S) == [True] * 3


def _powersgd_over_the_tuned_plan(rank: int, world_size: int) -> str:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    model = OverlapDDP(models.build("cnn_bn"), bucket_cap_mb=0.01, bucket_plan="tuned")
    early = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    try:
        model.register_comm_hook(early, powersgd.powerSGD_hook)
    except ValueError as error:
        refused = str(error)
    else:
        refused = "no error"
    late = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=TUNED_FROM)
    model.register_comm_hook(late, powersgd.powerSGD_hook)
    opt = models.optimizer("sgd", model.parameters())
    for step in range(STEPS):  # compression starts on the tuned layout and keeps working
        inputs, target = models.batch("cnn_bn", rank, step)
        models.loss_of(model(inputs), target).backward()
        opt.step()
        opt.zero_grad()
    return refused


def test_powersgd_must_start_after_the_tuned_layout_is_final():
    for refused in run_ranks(2, _powersgd_over_the_tuned_plan):
        assert f"set start_powerSGD_iter >= {TUNED_FROM}" in refused
