"""Communication hooks: bit-equal to stock DDP with torch's own hooks, at world sizes 2, 3 and 4.

Every hook in ``tests.support.hooks.HOOKS`` is registered on both wrappers (equal but separate states) and
every parameter and buffer is compared with ``torch.equal`` after every step, as in test_parity.py.
Stock DDP is the reference throughout; where it cannot run a stock hook as is on CPU/gloo, the
entry in ``tests.support.hooks`` says what DDP runs instead, and the tests below show that the unmodified
hook fails in DDP and OverlapDDP alike:

* PowerSGD and quantization with several buckets: stock DDP starts each bucket's hook as soon as
  the bucket is ready, and the hooks issue their later collectives from completion callbacks, so
  the issue order can differ between ranks and gloo mismatches, aborts or hangs. A one-bucket run
  would not help: PowerSGD's state (error feedback, P/Q memories, random seeds) is per bucket and
  gloo's sum depends on the buffer length at world size 3 and 4, so a different layout changes
  the bits. The reference is therefore DDP with ``synchronous(hook)``: the same hook on the same
  buckets, returning only when its chain is done, i.e. the order OverlapDDP enforces (each bucket's
  hook starts after the previous bucket's future). One-bucket models use the unmodified hook.
* The quantization hooks index gloo's all-gather result as NCCL's stacked tensor; both wrappers run
  them with only that result format adapted (``tests.support.hooks._StackedAllGather``).
* ``batched_powerSGD_hook`` in torch 2.14 fails its own shape assertion on every backend; both
  wrappers run it with a 2-D ``_orthogonalize`` (``tests.support.hooks._orthogonalize_one``).
* ``bf16_compress_hook`` / ``bf16_compress_wrapper``: DDP's name-based check may refuse them on a
  CPU-only torch build; DDP runs the same code under another name.
* post-localSGD: ``subgroup=None`` builds intra-node groups from the accelerator count and raises
  on CPU in both wrappers (tested below); the parity runs use explicit pair subgroups.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests.support import faults, hooks, models
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks
from tests.support.parity import Outcome, Scenario, outcomes_by_scenario, run_scenario

TINY = 0.001  # ~1 KiB bucket caps: after the rebuild, a bucket per parameter or two
BUCKET_VIEW = (("gradient_as_bucket_view", True),)

SCENARIOS = [
    Scenario("mlp", "sgd", None, hook="allreduce"),
    Scenario("cnn_bn", "adam", TINY, hook="allreduce(group)"),
    Scenario("transformer", "sgd", TINY, hook="fp16_compress"),
    Scenario("mlp", "adam", None, hook="fp16_wrapper(allreduce)"),
    Scenario("cnn_bn", "sgd", TINY, hook="bf16_wrapper(allreduce)"),
    Scenario("transformer", "adam", None, hook="bf16_compress"),
    Scenario("cnn_bn", "sgd", None, hook="noop"),
    Scenario("mlp", "sgd", TINY, hook="builtin_ALLREDUCE"),
    Scenario("transformer", "sgd", TINY, hook="builtin_FP16_COMPRESS"),
    Scenario("mlp", "sgd", None, steps=6, hook="post_localSGD"),
    Scenario("cnn_bn", "sgd", TINY, steps=6, hook="post_localSGD"),
    Scenario("mlp", "sgd", None, hook="quantization_pertensor"),
    Scenario("cnn_bn", "sgd", TINY, hook="quantization_pertensor/sync"),
    Scenario("transformer", "sgd", None, hook="quantization_perchannel"),
    Scenario("mlp", "adam", TINY, hook="quantization_perchannel/sync"),
    Scenario("transformer", "sgd", None, hook="powerSGD"),
    Scenario("transformer", "adam", TINY, hook="powerSGD/sync"),
    Scenario("cnn_bn", "sgd", TINY, accumulate=2, hook="powerSGD/sync"),
    Scenario("mlp", "sgd", None, hook="batched_powerSGD"),
    Scenario("transformer", "sgd", TINY, hook="batched_powerSGD/sync"),
    # gradient_as_bucket_view with the gradients kept (zero_grad(set_to_none=False)): from the second
    # step backward accumulates into the bucket views, which a hook (not the reducer) must average;
    # the fp16 wrapper hands back another tensor than the bucket's (its set_buffer), copied into the views.
    Scenario("cnn_bn", "sgd", TINY, ddp_kwargs=BUCKET_VIEW, set_to_none=False, hook="allreduce"),
    Scenario("mlp", "sgd", None, ddp_kwargs=BUCKET_VIEW, set_to_none=False, hook="fp16_wrapper(allreduce)"),
]

WORLD_SIZES = (2, 3, 4)


# -- hook chaining first: in one process, so a lost chaining fails in seconds ------------------


def _hook_order(rank: int, fault: str | None) -> list[str]:
    """Start and end of each bucket's hook in a many-bucket backward; each hook takes 50 ms."""
    events: list[str] = []

    def slow_hook(state, bucket):
        events.append(f"start {bucket.index()}")
        future = torch.futures.Future()
        buffer = bucket.buffer()

        def finish() -> None:
            time.sleep(0.05)
            events.append(f"done {bucket.index()}")
            future.set_result(buffer)

        threading.Thread(target=finish, daemon=True).start()
        return future

    with faults.injected(fault):
        wrapper = OverlapDDP(models.build("transformer"), bucket_cap_mb=TINY)
        wrapper.register_comm_hook(None, slow_hook)
        for step in range(2):  # the second backward runs with the rebuilt, many-bucket layout
            events.clear()
            inputs, target = models.batch("transformer", rank, step)
            models.loss_of(wrapper(inputs), target).backward()
    return list(events)


def test_hook_chains_run_one_bucket_at_a_time(one_rank):
    """Bucket b's hook starts only after bucket b-1's future is done; without that, it can fail.

    In the test process, on one rank: the order needs no peer, and a lost chaining fails here in
    seconds, before the multi-rank hook tests it would make hang."""
    order = _hook_order(0, None)
    buckets = len(order) // 2
    assert buckets >= 3
    assert order == [f"{what} {b}" for b in range(buckets) for what in ("start", "done")]
    unchained = _hook_order(0, "unchained_hooks")
    assert sorted(unchained) == sorted(order) and unchained != order


@functools.cache
def outcomes(world_size: int) -> dict[Scenario, list[Outcome]]:
    """Every scenario for one world size in one process group, keyed for the tests below."""
    return outcomes_by_scenario(world_size, SCENARIOS, SLOW_TIMEOUT_S)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_hook_parameters_and_buffers_equal_ddp_after_every_step(world_size, scenario):
    for rank, outcome in enumerate(outcomes(world_size)[scenario]):
        assert len(outcome.equal) == scenario.steps
        assert all(outcome.equal), f"rank {rank}: first difference at {outcome.first_difference}"
        assert all(outcome.layouts_equal), f"rank {rank}: layouts per step {outcome.ddp_layouts}"


def test_tiny_caps_give_many_buckets_after_the_rebuild():
    """The "/sync" scenarios really have several hook chains per backward."""
    for scenario in SCENARIOS:
        if scenario.bucket_cap_mb == TINY:
            layouts = outcomes(3)[scenario][0].ddp_layouts
            assert len(layouts[0]) == 1 and all(len(b) >= 2 for b in layouts[1:]), (scenario.name, layouts)


# -- the comparisons can fail, and what fails in DDP fails alike -------------------------------

FAULT_SCENARIOS = [
    Scenario("mlp", "sgd", None, hook="fp16_wrapper(allreduce)", fault="ignore_set_buffer"),
    Scenario("cnn_bn", "sgd", TINY, hook="bf16_wrapper(allreduce)", fault="ignore_set_buffer"),
    Scenario("mlp", "sgd", TINY, hook="fp16_wrapper(allreduce)", fault="ignore_hook_result"),
    Scenario("cnn_bn", "sgd", TINY, hook="quantization_pertensor/sync", fault="ignore_hook_result"),
    Scenario("mlp", "sgd", None, hook="allreduce", fault="hook_not_registered"),
    Scenario("transformer", "sgd", None, hook="builtin_FP16_COMPRESS", fault="hook_not_registered"),
    Scenario("transformer", "sgd", TINY, hook="powerSGD/sync", fault="is_last_never"),
    Scenario("mlp", "sgd", None, steps=6, hook="post_localSGD", fault="is_last_never"),
]


def _two_tensors_hook(state, bucket):
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda f: [bucket.buffer(), bucket.buffer()])


def _short_tensor_hook(state, bucket):
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda f: f.value()[0][:-1])


def _string_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result("reduced")
    return future


def _tensor_not_future_hook(state, bucket):
    return bucket.buffer()


BAD_RESULT_HOOKS = [_two_tensors_hook, _short_tensor_hook, _string_hook, _tensor_not_future_hook]


def _first_error(wrapper: torch.nn.Module, rank: int, steps: int) -> tuple[int, str, str] | None:
    """(step, exception type, message) of the first failing step, or None."""
    opt = models.optimizer("sgd", wrapper.parameters())
    for step in range(steps):
        inputs, target = models.batch("mlp", rank, step)
        try:
            models.loss_of(wrapper(inputs), target).backward()
        except Exception as error:  # noqa: BLE001 - the error itself is what is compared
            return step, type(error).__name__, str(error)
        opt.step()
        opt.zero_grad()
    return None


def _register_and_fail(rank: int, hook) -> tuple[int, str, str] | None:
    wrapper = OverlapDDP(models.build("mlp"))
    wrapper.register_comm_hook(None, hook)
    return _first_error(wrapper, rank, 2)


def _both_fail(rank: int, make_state, hook, steps: int) -> dict[str, tuple[int, str, str] | None]:
    """The first error of stock DDP and of OverlapDDP, each running ``hook`` unmodified."""
    errors = {}
    for name, cls in (("ddp", DistributedDataParallel), ("ours", OverlapDDP)):
        wrapper = cls(models.build("mlp"))
        wrapper.register_comm_hook(make_state(), hook)
        errors[name] = _first_error(wrapper, rank, steps)
    return errors


def _faults_and_errors(rank: int, world_size: int) -> dict[str, object]:
    facts: dict[str, object] = {"faults": [run_scenario(rank, s) for s in FAULT_SCENARIOS]}
    facts["bad_results"] = {hook.__name__: _register_and_fail(rank, hook) for hook in BAD_RESULT_HOOKS}
    facts["quantization"] = _both_fail(rank, lambda: None, quantization_hooks.quantization_pertensor_hook, 2)
    facts["batched_powersgd"] = _both_fail(rank, hooks.HOOKS["powerSGD"].state, power_sgd.batched_powerSGD_hook, 4)
    local_sgd_state = functools.partial(
        post_local_sgd.PostLocalSGDState, process_group=None, subgroup=None, start_localSGD_iter=2
    )
    facts["post_localsgd_no_subgroup"] = _both_fail(rank, local_sgd_state, post_local_sgd.post_localSGD_hook, 4)
    return facts


@functools.cache
def facts_at_world_size_3() -> list[dict[str, object]]:
    return run_ranks(3, _faults_and_errors, timeout_s=SLOW_TIMEOUT_S)


@pytest.mark.parametrize("scenario", FAULT_SCENARIOS, ids=lambda s: s.name)
def test_hook_parity_check_catches_injected_fault(scenario):
    """Each deliberate bug in OverlapDDP's hook path makes the value comparison fail at ws=3."""
    index = FAULT_SCENARIOS.index(scenario)
    outcome = facts_at_world_size_3()[0]["faults"][index]
    assert not all(outcome.equal), f"{scenario.fault} went unnoticed with hook {scenario.hook}"


@pytest.mark.parametrize("hook", BAD_RESULT_HOOKS, ids=lambda h: h.__name__)
def test_bad_hook_result_raises_naming_hook_and_bucket_on_every_rank(hook):
    """All ranks register the same bad hook: each raises in its first backward, none hangs."""
    for rank, facts in enumerate(facts_at_world_size_3()):
        failure = facts["bad_results"][hook.__name__]
        assert failure is not None, f"rank {rank}: {hook.__name__} was accepted"
        step, _, message = failure
        assert step == 0 and hook.__name__ in message and "bucket 0" in message, (rank, failure)


def test_stock_quantization_hooks_fail_alike_on_gloo():
    """gloo's all-gather future holds a list, not NCCL's stacked tensor: the same error, same step.
    (torch 2.15's hook runs on gloo: then neither fails, and the parity scenarios compare values.)"""
    for facts in facts_at_world_size_3():
        ddp, ours = facts["quantization"]["ddp"], facts["quantization"]["ours"]
        if ddp is None:
            assert ours is None, ours
            continue
        assert ours is not None
        assert ddp[0] == ours[0] == 0
        inner = ddp[2].split("IndexError: ")[1].splitlines()[0]
        assert f"IndexError: {inner}" in ours[2]


def test_stock_batched_powersgd_fails_alike():
    """torch 2.14's batched_powerSGD_hook passes 2-D matrices to a 3-D assertion, from its first
    compressed iteration (start_powerSGD_iter=2), in DDP and OverlapDDP alike."""
    for facts in facts_at_world_size_3():
        ddp, ours = facts["batched_powersgd"]["ddp"], facts["batched_powersgd"]["ours"]
        assert ddp is not None and ours is not None
        assert ddp[:2] == ours[:2] == (2, "AssertionError")


def test_post_localsgd_without_subgroup_fails_alike_on_cpu():
    for facts in facts_at_world_size_3():
        ddp, ours = facts["post_localsgd_no_subgroup"]["ddp"], facts["post_localsgd_no_subgroup"]["ours"]
        assert ddp is not None and ours is not None
        assert ddp == ours and ddp[:2] == (2, "ValueError"), (ddp, ours)


# -- registration checks, in one process ----------------------------------------------------


def _annotated(bucket=inspect.Parameter.empty, returns=inspect.Signature.empty):
    """A hook annotated with these objects (built by hand: this module's annotations are strings)."""

    def hook(state, bucket):
        return default_hooks.allreduce_hook(state, bucket)

    if bucket is not inspect.Parameter.empty:
        hook.__annotations__["bucket"] = bucket
    if returns is not inspect.Signature.empty:
        hook.__annotations__["return"] = returns
    return hook


def _no_bucket_parameter(state, grads):
    return default_hooks.allreduce_hook(state, grads)


BAD_REGISTRATIONS = {
    "not callable": (42, TypeError),
    "no bucket parameter": (_no_bucket_parameter, KeyError),
    "bucket annotation": (_annotated(bucket=torch.Tensor), ValueError),
    "return annotation": (_annotated(returns=torch.Tensor), ValueError),
}


@pytest.mark.parametrize("case", list(BAD_REGISTRATIONS))
def test_register_rejects_what_ddp_rejects_with_the_same_exception_type(one_rank, case):
    hook, expected = BAD_REGISTRATIONS[case]
    with pytest.raises(expected):
        DistributedDataParallel(models.build("mlp")).register_comm_hook(None, hook)
    with pytest.raises(expected):
        OverlapDDP(models.build("mlp")).register_comm_hook(None, hook)


def test_hook_without_bucket_parameter_error_is_also_a_type_error(one_rank):
    with pytest.raises(TypeError, match="bucket"):
        OverlapDDP(models.build("mlp")).register_comm_hook(None, _no_bucket_parameter)


def test_correctly_annotated_hook_is_accepted(one_rank):
    hook = _annotated(bucket=dist.GradBucket, returns=torch.futures.Future[torch.Tensor])
    DistributedDataParallel(models.build("mlp")).register_comm_hook(None, hook)
    OverlapDDP(models.build("mlp")).register_comm_hook(None, hook)


def _register(wrapper: torch.nn.Module, how: str) -> None:
    if how == "hook":
        wrapper.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        wrapper._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)


@pytest.mark.parametrize("first", ["hook", "builtin"])
@pytest.mark.parametrize("second", ["hook", "builtin"])
def test_registering_twice_raises_like_ddp(one_rank, first, second):
    for cls in (DistributedDataParallel, OverlapDDP):
        wrapper = cls(models.build("mlp"))
        _register(wrapper, first)
        with pytest.raises(RuntimeError, match="can only be called once"):
            _register(wrapper, second)


def test_bf16_compress_hook_is_accepted_on_gloo(one_rank):
    OverlapDDP(models.build("mlp")).register_comm_hook(None, default_hooks.bf16_compress_hook)
    wrapped = default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)
    OverlapDDP(models.build("mlp")).register_comm_hook(None, wrapped)


def test_a_hook_can_declare_that_it_needs_no_chaining():
    from overlapddp.bucket.comm_hook import is_unchained

    def custom(state, bucket):
        return default_hooks.allreduce_hook(state, bucket)

    assert is_unchained(default_hooks.allreduce_hook) and not is_unchained(custom)
    custom.issues_one_collective = True
    assert is_unchained(custom)
