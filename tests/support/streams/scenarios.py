"""Every CUDA path of OverlapDDP, driven through its public API under the stream model.

Each scenario trains a small model for a few iterations on fake streams (the library's CUDA branch:
``CudaFence`` with the package's ``CudaKit`` on the fake ``torch.cuda``, the CUDA token count and
clock, the pinned copies of the parameter-usage map) and returns
the detector's findings; an empty list means every read, write and free was ordered. The user's own
code in a scenario orders what a careful user orders (its forward waits for its last step), never
what the library promises to order.

Run one by hand::

    PYTHONPATH=$PWD python3 -m tests.support.streams.scenarios "default all-reduce"
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from overlapddp import OverlapDDP
from overlapddp.clock import CudaClock
from overlapddp.device_streams import CudaKit
from overlapddp.fence import CudaFence
from tests.support.streams.backends import TorchftWork, simulate
from tests.support.streams.sim import Sim

CPU = torch.device("cpu")
BUCKET_MB = 0.0002  # about 200 bytes: a bucket or two per layer of the small model
Scenario = Callable[[Sim], None]
SCENARIOS: dict[str, tuple[Scenario, str]] = {}


def scenario(name: str, backend: str = "nccl") -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = (fn, backend)
        return fn

    return register


# Findings inside torch's own PowerSGD hook, stock DDP's too: its last callback frees the bucket's copy
# (made on the stream that called the hook) after reading it on the callback's pool stream, and the
# error feedback it replaced there; nothing of this library is involved.
UPSTREAM = ("from aten.clone.default on comm1) was freed (reusable on comm1) while aten.sub.Tensor on pool",
            "from aten.sub.Tensor on pool")


def _ours(finding: str) -> bool:
    return not any(marker in finding for marker in UPSTREAM)


def run(name: str, sim: Sim | None = None) -> list[str]:
    """Run one scenario under the model; its findings (an exception is one too)."""
    sim = sim or Sim()
    fn, backend = SCENARIOS[name]
    with simulate(sim, backend):
        try:
            fn(sim)
        except Exception as error:  # noqa: BLE001 - an error is a result of the scenario, reported as such
            sim.findings.append(f"{sim.context}: raised {type(error).__name__}: {error}")
        sim.context = "teardown"
        import gc

        gc.collect()
    return [f for f in sim.findings if _ours(f)]


# -- building blocks -----------------------------------------------------------------------------------


def net(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def cuda(sim: Sim, model: OverlapDDP) -> OverlapDDP:
    """Put ``model`` on its CUDA branch: the CUDA fence (and, where used, clock and token count)."""
    model._reducer.replace_fence(CudaFence(CPU))
    tuner = getattr(model._reducer.layouts, "_tuner", None)
    if tuner is not None:
        tuner._clock = CudaClock(CPU)
    return model


def wrap(sim: Sim, module: nn.Module | None = None, on_cuda: bool = True, **kwargs: Any) -> OverlapDDP:
    kwargs.setdefault("bucket_cap_mb", BUCKET_MB)
    model = OverlapDDP(module if module is not None else net(), **kwargs)
    return cuda(sim, model) if on_cuda else model


def batch(step: int, rows: int = 3) -> torch.Tensor:
    torch.manual_seed(100 + step)
    return torch.randn(rows, 4)


def train(
    sim: Sim,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 3,
    forward: str | None = None,
    backward: tuple[str | None, ...] = (None,),
    step_on: str | None = None,
    loss_of: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.square().sum(),
    before_step: Callable[[int], None] | None = None,
    per_step: Callable[[int], None] | None = None,
) -> None:
    """Forward on ``forward``, backward called on ``backward[i % len]``, step and zero_grad on
    ``step_on`` (default: backward's stream); the next forward waits for the step's stream."""
    fwd = sim.stream(forward) if forward else sim.default
    last: list[Any] = [sim.default]  # the module was built (and broadcast) on the default stream
    for i in range(steps):
        sim.context = f"iteration {i}"
        bwd = sim.stream(backward[i % len(backward)]) if backward[i % len(backward)] else fwd
        if per_step is not None:
            per_step(i)
        with sim.use(fwd):
            for stream in last:
                fwd.wait_stream(stream)
            loss = loss_of(model(batch(i)))
        if bwd is not fwd:
            bwd.wait_stream(fwd)
        with sim.use(bwd):
            loss.backward()
        del loss
        if optimizer is None:
            with sim.use(bwd):
                model.zero_grad(set_to_none=True)
            continue
        stream = sim.stream(step_on) if step_on else bwd
        with sim.use(stream):
            if before_step is not None:
                before_step(i)
            optimizer.step()
            optimizer.zero_grad()
        last = [stream]
    done(sim)


def done(sim: Sim) -> None:
    """The user's last ``torch.cuda.synchronize()``: what the scenario leaves behind may be freed."""
    torch.cuda.synchronize()


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- the scenarios ---------------------------------------------------------------------------------------


@scenario("default all-reduce")
def _default(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("gradient_as_bucket_view")
def _as_view(sim: Sim) -> None:
    model = wrap(sim, gradient_as_bucket_view=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, forward="forward", backward=("backward",))


@scenario("fp16_compress_hook")
def _fp16(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(sim, model, sgd(model))


@scenario("bf16_compress_hook")
def _bf16(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    train(sim, model, sgd(model), forward="forward", backward=("backward",))


@scenario("PowerSGD")
def _powersgd(sim: Sim) -> None:
    model = wrap(sim)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    train(sim, model, sgd(model), steps=4)


@scenario("PowerSGD with find_unused_parameters: the usage all-reduce after every hook chain")
def _powersgd_unused(sim: Sim) -> None:
    model = wrap(sim, _Branchy(), find_unused_parameters=True)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, lambda x: model(x, use_extra=sim.context != "iteration 2"), opt, steps=4,  # type: ignore[arg-type]
          forward="forward", backward=("backward",))


def _late_writer_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A custom hook whose callback writes its result late on its own (pool) stream, into a new tensor."""

    def late(future: torch.futures.Future) -> torch.Tensor:
        reduced = future.value()[0]
        written = torch.empty_like(reduced)
        written.copy_(reduced)
        return written

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(late)


@scenario("custom hook writing late on its own stream")
def _late_hook(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, _late_writer_hook)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, step_on="side")


def _compress_into_new_tensor_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reads the bucket on the stream it is called on, and resolves to a new tensor (not the bucket)."""
    compressed = bucket.buffer().to(torch.float16)
    return dist.all_reduce(compressed, async_op=True).get_future().then(lambda f: f.value()[0].to(torch.float32))


@scenario("hook reading the bucket and returning a new tensor, buckets rebuilt")
def _new_tensor_hook(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, _compress_into_new_tensor_hook)
    # No step: the next forward (which rebuilds the buckets, dropping the first ones) waits for nothing.
    train(sim, model, None, forward="forward", backward=("backward",))


@scenario("optimizer overlap")
def _overlap(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt, overlap=True)
    train(sim, model, opt)


@scenario("optimizer overlap with clipping and a scaler")
def _overlap_clip(sim: Sim) -> None:
    model = wrap(sim)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model.attach_optimizer(opt, overlap=True, max_grad_norm=1.0, scaler=scaler)
    fwd = sim.default
    for i in range(3):
        sim.context = f"iteration {i}"
        with sim.use(fwd):
            loss = scaler.scale(model(batch(i)).square().sum())
            loss.backward()
            del loss
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    done(sim)


@scenario("sharded optimizer: SGD with momentum, forward and backward on their own streams")
def _sharded(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt, shard=True)
    train(sim, model, opt, steps=4, forward="forward", backward=("backward",))


@scenario("sharded optimizer: Adam, the backward stream alternating")
def _sharded_adam(sim: Sim) -> None:
    model = wrap(sim)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.attach_optimizer(opt, shard=True)
    train(sim, model, opt, steps=4, forward="forward", backward=("backward A", "backward B"))


@scenario("guard: step, zero_grad, clipping and unscale on a second stream")
def _guard_side(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model.attach_optimizer(opt, scaler=scaler)
    fwd, side = sim.default, sim.stream("side")
    for i in range(3):
        sim.context = f"iteration {i}"
        with sim.use(fwd):
            fwd.wait_stream(side)
            loss = scaler.scale(model(batch(i)).square().sum())
            loss.backward()
            del loss
        with sim.use(side):
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=i % 2 == 0)
    done(sim)


@scenario("mixed precision")
def _mixed(sim: Sim) -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    model = wrap(sim, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, forward="forward", backward=("backward",), loss_of=lambda out: out.float().square().sum())


@scenario("mixed precision with a branch on another stream")
def _mixed_branch(sim: Sim) -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    model = wrap(sim, _TwoBranches(sim), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, loss_of=lambda out: out.float().square().sum())


@scenario("delayed all-reduce")
def _delayed(sim: Sim) -> None:
    module = net()
    delayed = [("4.weight", module[4].weight), ("4.bias", module[4].bias)]  # ready first
    model = wrap(sim, module, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=module[0].weight)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, forward="forward", backward=("backward",))


@scenario("token weighting")
def _tokens(sim: Sim) -> None:
    model = wrap(sim)
    model._reducer.reduction.enable_token_weighting(model.device)._kit = CudaKit(CPU)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, per_step=lambda i: model.count_tokens(3 + i))


class _Branchy(nn.Module):
    """A trunk and an optional branch, before the trunk (its gradients ready last) or after it (first)."""

    def __init__(self, branch_first: bool = True) -> None:
        super().__init__()
        self.trunk = net()
        self.branch_first = branch_first
        self.extra = nn.Linear(4, 4) if branch_first else nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        if self.branch_first:
            return self.trunk(x + self.extra(x) if use_extra else x)
        out = self.trunk(x)
        return out + self.extra(out) if use_extra else out


class _TwoBranches(nn.Module):
    """A trunk and a side branch that forward runs on its own stream (so backward accumulates the
    branch's gradients there), summed at the end: no data flows from one branch to the other."""

    def __init__(self, sim: Sim) -> None:
        super().__init__()
        self.sim = sim
        self.trunk = net()
        self.side = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)  # first in forward: its gradients are ready after the branch's
        branch = self.sim.stream("branch")
        branch.wait_stream(self.sim.current)
        self.sim.record_stream(x, branch)  # the user's x.record_stream(branch)
        with self.sim.use(branch):
            side = self.side(x)
        self.sim.current.wait_stream(branch)
        self.sim.record_stream(side, self.sim.current)  # the user's side.record_stream(current)
        if side.requires_grad:
            self.sim.autograd.branch_on(side, list(self.side.parameters()), branch)
        return out + side


@scenario("gradients of one bucket produced on two streams")
def _two_streams_one_bucket(sim: Sim) -> None:
    module = _TwoBranches(sim)
    model = wrap(sim, module, bucket_cap_mb=25)  # one bucket, filled by the trunk's first layer, ready last
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("non-finite check of a bucket launched from another stream than it was filled on")
def _check_from_another_stream(sim: Sim) -> None:
    module = _TwoBranches(sim)
    model = wrap(sim, module, bucket_cap_mb=40 / 2**20)  # 40 bytes: the side branch's two parameters alone
    # Buckets in this order: the trunk's first layer (ready last) is bucket 0, so the side branch's bucket,
    # the last one, filled on the branch's stream, launches from the trunk's hook on the default stream.
    model.load_bucket_state({"ready_order": [0, 1, 2, 3, 5, 4, 6, 7], "tuned_buckets": None})
    assert model.bucket_indices()[-1] == [6, 7], model.bucket_indices()
    model.check_nonfinite_gradients()
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("gradient_as_bucket_view: one bucket of gradients from two streams")
def _views_two_streams(sim: Sim) -> None:
    # The fill copies each gradient into its view on the filling stream, then drops the gradient, made on
    # its own stream: it must be kept for the filling stream until the copy has run.
    module = _TwoBranches(sim)
    model = wrap(sim, module, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("delayed all-reduce of gradients produced on another stream")
def _delayed_two_streams(sim: Sim) -> None:
    module = _TwoBranches(sim)
    delayed = list(module.side.named_parameters(prefix="side"))
    model = wrap(sim, module, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=module.trunk[0].weight)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("delayed all-reduce launched at the end of backward (its hook parameter unused)")
def _delayed_finish(sim: Sim) -> None:
    module = _Branchy()
    delayed = [("trunk.4.weight", module.trunk[4].weight), ("trunk.4.bias", module.trunk[4].bias)]
    model = wrap(sim, module, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=module.extra.weight,
                 find_unused_parameters=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    # Iteration 1 leaves the hook parameter unused: finalize launches the delayed all-reduce, then finishes it.
    train(sim, lambda x: model(x, use_extra=sim.context != "iteration 1"), opt, forward="forward",  # type: ignore[arg-type]
          backward=("backward",))


@scenario("find_unused_parameters")
def _unused(sim: Sim) -> None:
    module = _Branchy()
    model = wrap(sim, module, find_unused_parameters=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, lambda x: model(x, use_extra=sim.context.endswith("1")), opt, steps=3)  # type: ignore[arg-type]


@scenario("find_unused_parameters, forward and backward on streams other than the construction one")
def _unused_other_streams(sim: Sim) -> None:
    # The reducer holds every AccumulateGrad from construction (on the default stream), so the
    # gradients are accumulated, and the buckets filled, there, not on forward's stream (A2).
    model = wrap(sim, _Branchy(), find_unused_parameters=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, lambda x: model(x, use_extra=sim.context.endswith("1")), opt, forward="forward",  # type: ignore[arg-type]
          backward=("backward",))


@scenario("static_graph")
def _static(sim: Sim) -> None:
    model = wrap(sim, static_graph=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, steps=4, forward="forward", backward=("backward",))


@scenario("tuned plan")
def _tuned(sim: Sim) -> None:
    model = wrap(sim, bucket_plan="tuned")
    opt = sgd(model)
    model.attach_optimizer(opt)
    steps = model._reducer.layouts.final_iteration + 2
    train(sim, model, opt, steps=steps)


@scenario("join")
def _join(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt)
    with model.join():
        train(sim, model, opt)


@scenario("backward stream alternates between iterations")
def _alternating(sim: Sim) -> None:
    model = wrap(sim)
    train(sim, model, None, steps=4, forward="forward", backward=("backward A", "backward B"))


def _iteration(sim: Sim, model: OverlapDDP, step: int, hook: Callable[[], None] | None = None) -> None:
    with sim.use(sim.default):
        loss = model(batch(step)).square().sum()
        if hook is not None:
            loss = loss + 0 * hook()
        loss.backward()


@scenario("abandon: a gradient changed while its bucket reduces")
def _abandon_untouched(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = sgd(model)
    model.attach_optimizer(opt)
    params = list(model.parameters())

    def change_the_last_layers_gradient(param: torch.Tensor) -> None:  # the first layer's is ready last
        if sim.context == "iteration 1":  # after the rebuild: bucket 0 holds the last layer only
            params[-1].grad.mul_(2)

    params[0].register_post_accumulate_grad_hook(change_the_last_layers_gradient)
    for i in range(3):
        sim.context = f"iteration {i}"
        try:
            _iteration(sim, model, i)
        except RuntimeError as error:
            if "were changed" not in str(error):
                raise
        opt.zero_grad()
    done(sim)


@scenario("abandon: non-finite gradients")
def _abandon_nonfinite(sim: Sim) -> None:
    model = wrap(sim)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    model.check_nonfinite_gradients()
    params = list(model.parameters())
    # After the rebuild the first layer's gradient, ready last, fills the last bucket: the others are in flight.
    params[0].register_hook(lambda grad: torch.full_like(grad, float("nan")) if sim.context == "iteration 1" else None)
    for i in range(3):
        sim.context = f"iteration {i}"
        try:
            _iteration(sim, model, i)
        except FloatingPointError:
            pass
        model.zero_grad()
    done(sim)


@scenario("abandon: prior reduction not finished")
def _abandon_prior(sim: Sim) -> None:
    module = _Branchy()
    model = wrap(sim, module)
    model.register_comm_hook(None, _compress_into_new_tensor_hook)  # reads the bucket on the communication stream
    for i in range(4):  # 1 leaves the branch unused, 2 raises in forward and abandons, 3 fills the new buckets
        sim.context = f"iteration {i}"
        with sim.use(sim.default):
            try:
                model(batch(i), use_extra=i != 1).square().sum().backward()
            except RuntimeError as error:
                if "finished reduction" not in str(error):
                    raise
        model.zero_grad()
    done(sim)


@scenario("wrapper dropped after an error, buckets filled but not launched")
def _dropped(sim: Sim) -> None:
    model = wrap(sim, _Branchy(branch_first=False))  # the branch's bucket is first: nothing launches without it
    fwd = sim.stream("forward")
    for i in range(4):
        sim.context = f"iteration {i}"
        stream = sim.default if i < 2 else fwd  # the buckets are rebuilt on the default stream, filled on another
        if stream is fwd:
            fwd.wait_stream(sim.default)
        with sim.use(stream):
            try:
                model(batch(i), use_extra=i < 2).square().sum().backward()
            except RuntimeError as error:
                if "finished reduction" not in str(error):
                    raise
                break
            model.zero_grad()
    module = model.module  # a restart keeps the module and wraps it again
    del model  # the old wrapper's buffers are freed now
    done(sim)
    del module


@scenario("sparse gradients on NCCL are refused at construction")
def _sparse_on_nccl(sim: Sim) -> None:
    try:
        model = wrap(sim, _Sparse())
    except ValueError as error:
        if "embedding.weight" in str(error) and "gloo" in str(error):
            return
        raise
    train(sim, model, torch.optim.SGD(model.parameters(), lr=0.1))
    raise AssertionError("a sparse gradient on NCCL was not refused at construction")


@scenario("join: averaged over the ranks still training")
def _join_training_ranks(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt)
    with model.join(divide_by_initial_world_size=False):
        train(sim, model, opt)


class _WithBuffers(nn.Module):
    """Buffers the forward broadcasts (batch norm), and a branch an iteration can leave unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = self.norm(self.first(x))
        return self.head(h + self.extra(h) if use_extra else h)


@scenario("join: a joined rank shadows a second rank still training, with buffers and unused parameters")
def _join_shadowing(sim: Sim) -> None:
    model = wrap(sim, _WithBuffers(), find_unused_parameters=True)
    opt = sgd(model)
    model.attach_optimizer(opt)
    with model.join():
        train(sim, lambda x: model(x, use_extra=sim.context != "iteration 1"), opt, steps=2)  # type: ignore[arg-type]
    hook = model.join_hook()

    def second_rank(tensor: torch.Tensor, what: str) -> None:
        if what == "all_reduce" and tensor.numel() == 1 and tensor.dtype in (torch.float32, torch.int64):
            tensor.fill_(1)  # the "will sync" flag (its backward reduces), the highest rank training (MAX)

    sim.peer = second_rank
    for i in range(2):  # this rank ran out of inputs: it shadows two of the other rank's iterations
        sim.context = f"shadowed iteration {i}"
        hook.main_hook()
    sim.peer = None
    sim.context = "after join"
    hook.post_hook(True)
    train(sim, model, opt, steps=1)


@scenario("no_sync micro-steps, buffers broadcast")
def _no_sync(sim: Sim) -> None:
    model = wrap(sim, _WithBuffers())
    opt = sgd(model)
    model.attach_optimizer(opt)
    for i in range(4):
        sim.context = f"iteration {i}"
        with sim.use(sim.default):
            if i % 2 == 0:
                with model.no_sync():
                    model(batch(i)).square().sum().backward()
                continue
            model(batch(i)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    done(sim)


@scenario("fp16_compress_hook with gradient_as_bucket_view, fence log")
def _fp16_as_view(sim: Sim) -> None:
    model = wrap(sim, gradient_as_bucket_view=True)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    log = model.record_fences()
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt, forward="forward", backward=("backward",))
    if log.violations():
        raise AssertionError(log.violations())


@scenario("device_ids: inputs in pageable and pinned host memory copied to the device")
def _device_ids(sim: Sim) -> None:
    model = wrap(sim)
    model.device_ids = [0]  # what construction sets for a module on cuda:0 (a CPU module is refused)
    opt = sgd(model)
    model.attach_optimizer(opt)

    def host_batch(i: int) -> torch.Tensor:
        import numpy as np

        on_host = torch.from_numpy(np.random.default_rng(i).standard_normal((3, 4), dtype=np.float32))
        return on_host.pin_memory() if i % 2 else on_host  # a DataLoader with and without pin_memory=True

    for i in range(3):
        sim.context = f"iteration {i}"
        with sim.use(sim.default):
            model(host_batch(i)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    done(sim)


@scenario("optimizer attached with strict=True on another stream is refused")
def _strict(sim: Sim) -> None:
    model = wrap(sim)
    opt = sgd(model)
    model.attach_optimizer(opt, strict=True)
    try:
        train(sim, model, opt, step_on="side", steps=1)
    except RuntimeError as error:
        if "made visible to stream" not in str(error):
            raise
        return
    raise AssertionError("a step on another stream than the gradients' was not refused with strict=True")


def _framework_scenario(sim: Sim, module_of: Callable[[Any, nn.Module], OverlapDDP], where: Any) -> None:
    """A strategy builds the wrapper (on a side stream, as on CUDA: device ids are set), then trains on
    the default stream."""
    stub = type("Strategy", (), {"_determine_ddp_device_ids": lambda self: [0], "determine_ddp_device_ids":
                                 lambda self: [0], "_ddp_kwargs": {}})()
    saved = where.OverlapDDP
    where.OverlapDDP = lambda module, device_ids=None, **kwargs: wrap(sim, module, **kwargs)  # a CPU module
    try:
        with sim.use(sim.default):
            model = module_of(stub, net())
    finally:
        where.OverlapDDP = saved
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("Fabric strategy: the wrapper built on a side stream")
def _fabric(sim: Sim) -> None:
    from overlapddp.integrations import fabric

    _framework_scenario(sim, fabric.OverlapDDPFabricStrategy.setup_module, fabric)


@scenario("Trainer strategy: the wrapper built on a side stream")
def _trainer(sim: Sim) -> None:
    from overlapddp.integrations import trainer_strategy

    _framework_scenario(sim, trainer_strategy.OverlapDDPStrategySteps._setup_model, trainer_strategy)


# -- the CPU path, with gloo's worker thread as a stream ----------------------------------------------------


@scenario("gloo: default all-reduce", backend="gloo")
def _gloo_default(sim: Sim) -> None:
    model = wrap(sim, on_cuda=False)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("gloo: token weighting and find_unused_parameters", backend="gloo")
def _gloo_tokens(sim: Sim) -> None:
    model = wrap(sim, _Branchy(), on_cuda=False, find_unused_parameters=True)
    model._reducer.reduction.enable_token_weighting(model.device)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, lambda x: model(x, use_extra=sim.context.endswith("1")), opt,  # type: ignore[arg-type]
          per_step=lambda i: model.count_tokens(3 + i))


@scenario("gloo: sharded optimizer", backend="gloo")
def _gloo_sharded(sim: Sim) -> None:
    model = wrap(sim, on_cuda=False)
    opt = sgd(model)
    model.attach_optimizer(opt, shard=True)
    train(sim, model, opt)


def _torchft(sim: Sim) -> nn.Module:
    """The torchft integration over a manager of one participant, without its lighthouse: its all-reduce
    is the group's, as the model's work (gloo's; torchft's division by one participant, on the waiting
    thread, left out), or as torchft's on CUDA (T1, the division included)."""
    from torchft.manager import Manager

    from overlapddp.integrations import torchft

    class OneReplica(Manager):
        def __init__(self) -> None:  # no quorum, no store, no threads of its own
            self._use_async_quorum = False

        def register_state_dict_fn(self, *_: Any) -> None:
            pass

        def allreduce(self, tensor: torch.Tensor, *_: Any, **__: Any) -> Any:
            work = dist.all_reduce(tensor, async_op=True)
            return TorchftWork(sim, work, tensor) if dist.get_backend() == "nccl" else work

    return torchft.DistributedDataParallel(OneReplica(), net(), bucket_cap_mb=BUCKET_MB)


@scenario("gloo: torchft, buckets completed on the integration's thread", backend="gloo")
def _gloo_torchft(sim: Sim) -> None:
    model = _torchft(sim)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


@scenario("torchft: buckets compressed to fp16, completed on the integration's thread")
def _cuda_torchft(sim: Sim) -> None:
    model = cuda(sim, _torchft(sim))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = sgd(model)
    model.attach_optimizer(opt)
    train(sim, model, opt)


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding((x.abs() * 3).long().clamp(max=9)).sum(1))


@scenario("gloo: sparse gradients", backend="gloo")
def _gloo_sparse(sim: Sim) -> None:
    model = wrap(sim, _Sparse(), on_cuda=False)
    model.check_nonfinite_gradients()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.attach_optimizer(opt)
    train(sim, model, opt)


class _SparseBranchy(nn.Module):
    """Sparse gradients, and a branch whose bucket (after the embedding's) an iteration can leave unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.extra = nn.Linear(4, 4)
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = self.embedding((x.abs() * 3).long().clamp(max=9)).sum(1)
        return self.head(h + self.extra(x) if use_extra else h)


def _accumulating_after_an_abandoned_reduction(sim: Sim, model: nn.Module) -> None:
    """Iteration 1 leaves the branch unused, so iteration 2's forward abandons it with buckets in flight;
    the user keeps accumulating gradients (no zero_grad) into what those collectives may still write."""
    for i in range(4):
        sim.context = f"iteration {i}"
        try:
            model(batch(i), use_extra=i != 1).square().sum().backward()
        except RuntimeError as error:
            if "finished reduction" not in str(error):
                raise
    done(sim)


@scenario("gloo: sparse gradients accumulated after an abandoned reduction", backend="gloo")
def _gloo_sparse_abandoned(sim: Sim) -> None:
    _accumulating_after_an_abandoned_reduction(sim, wrap(sim, _SparseBranchy(), on_cuda=False))


@scenario("gradient_as_bucket_view accumulated after an abandoned reduction")
def _as_view_abandoned(sim: Sim) -> None:
    _accumulating_after_an_abandoned_reduction(sim, wrap(sim, _Branchy(), gradient_as_bucket_view=True))


@scenario("gloo: sparse gradients, fence log", backend="gloo")
def _gloo_sparse_log(sim: Sim) -> None:
    model = wrap(sim, _Sparse(), on_cuda=False)
    log = model.record_fences()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(sim, model, opt)
    if log.violations():
        raise AssertionError(log.violations())


def run_all(names: list[str] | None = None, **sim_options: Any) -> dict[str, list[str]]:
    """Each scenario (default: all) under a fresh model; findings per scenario."""
    return {name: run(name, Sim(**sim_options)) for name in (names or list(SCENARIOS))}


def one_rank_group() -> None:
    """The real one-rank gloo group the scenarios use for ranks, sizes and object gathers."""
    if dist.is_initialized():
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))


if __name__ == "__main__":
    one_rank_group()
    for name, findings in run_all(sys.argv[1:] or None).items():
        print(f"{'ok  ' if not findings else 'FAIL'} {name}")
        for finding in findings:
            print(f"     {finding}")
