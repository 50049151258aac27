"""How ``nn.Module`` and autograd talk to the reducer: the ``OverlapDDP`` wrapper.

It owns the constructor contract (DDP's arguments, names, order and defaults), the start-of-forward
work (rebuild, buffer broadcast), one post-accumulate-grad hook per parameter and the one
end-of-backward callback. Everything below it sees tensors only.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from overlapddp.bucket_plan import BucketCaps
from overlapddp.comm_hook import CommHook
from overlapddp.comm_hook_validation import builtin_hook, check_comm_hook
from overlapddp.fence import FenceLog, fence_for
from overlapddp.join import OverlapJoinHook, announce_backward_sync, common_rank
from overlapddp.module_sync import broadcast_coalesced, verify_same_parameters
from overlapddp.optimizer_guard import OptimizerGuard
from overlapddp.optimizer_overlap import OverlappedOptimizer
from overlapddp.param_usage import tensors_in
from overlapddp.reducer import Reducer, ReducerOptions

# Arguments this version rejects when set (to anything but None/False), with what to do instead.
_NOT_YET = {
    "delay_all_reduce_named_params": "let all parameters be reduced in buckets",
    "param_to_hook_all_reduce": "let all parameters be reduced in buckets",
    "mixed_precision": "cast the model yourself, or register fp16_compress_hook",
}
# "ddp": DDP's exact layout (bit-equal at every world size); "tuned": the fastest of a modelled plan
# (tuned_plan.py) and DDP's fixed layouts, by measurement (plan_selection.py).
BUCKET_PLANS = ("ddp", "tuned")


class OverlapDDP(nn.Module, Joinable):
    """Drop-in ``DistributedDataParallel``: the same arguments, the same numbers, explicit fences.

    Beyond DDP's arguments, the keyword ``bucket_plan="tuned"`` re-plans the buckets after two
    measured iterations so that the work after backward (the last reductions, the copies into
    ``param.grad`` and an overlapped optimizer's updates) ends as early as the link allows, then
    runs that plan and DDP's fixed layouts for a few iterations each and keeps the fastest.

    Example::

        >>> model = OverlapDDP(net)            # instead of DistributedDataParallel(net)
        >>> loss_fn(model(x), y).backward()    # buckets are reduced during backward
        >>> optimizer.step()                   # every bucket is complete before backward returns
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: list[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any | None = None,
        device_mesh: Any | None = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        bucket_plan: str = "ddp",
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time.")
        given = locals()
        for name, instead in _NOT_YET.items():
            if given[name] is not None and given[name] is not False:
                raise NotImplementedError(
                    f"OverlapDDP does not implement {name}={given[name]!r} yet; {instead}."
                )
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument is deprecated (as in DDP) and has no effect.",
                FutureWarning,
                stacklevel=2,
            )
        self.process_group = _resolve_group(process_group, device_mesh)
        self.module = module
        self.dim = dim
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True  # set by join(); read by forward under Join
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))

        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        _check_parameters(named, trainable)
        self.device = trainable[0][1].device
        self.device_type = self.device.type
        self.device_ids, self.output_device = _resolve_devices(device_ids, output_device, named)
        self.forward_sync_buffers, init_sync_buffers = _resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.modules_buffers = [
            b for n, b in module.named_buffers() if n not in self.parameters_to_ignore
        ]
        caps = BucketCaps.from_user(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap = caps.bytes_cap

        names = [n for n, _ in trainable]
        params = [p for _, p in trainable]
        if init_sync:
            verify_same_parameters(names, params, self.process_group)
            self._broadcast_state(0, with_buffers=init_sync_buffers)

        sparse = [False] * len(params)
        for module_name, sub in module.named_modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
                raise NotImplementedError(
                    f"OverlapDDP does not reduce sparse gradients yet ({module_name} has sparse=True); "
                    "use sparse=False."
                )
        if static_graph and find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to OverlapDDP with static_graph enabled; with a "
                "static graph unused parameters are found in the first iteration, so it is not needed.",
                UserWarning,
                stacklevel=2,
            )
        if bucket_plan not in BUCKET_PLANS:
            raise ValueError(f"bucket_plan must be one of {', '.join(map(repr, BUCKET_PLANS))}, got {bucket_plan!r}.")
        if bucket_plan == "tuned" and find_unused_parameters and not static_graph:
            raise ValueError(
                "bucket_plan='tuned' re-plans the buckets after DDP's ready-order rebuild, which "
                "find_unused_parameters=True never does on a dynamic graph; use bucket_plan='ddp', or "
                "static_graph=True if the graph does not change."
            )
        options = ReducerOptions(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            batched_grad_copy=batched_grad_copy,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            tuned_plan=bucket_plan == "tuned",
        )
        self._reducer = Reducer(params, names, self.process_group, fence_for(self.device), caps, sparse, options)
        self._hook_handles = _register_ready_hooks(self._reducer, params)
        self._comm_hooks: list[tuple[Callable, object]] = []

    # -- forward ------------------------------------------------------------------------------

    # The wrapper's own bookkeeping and collectives always run eagerly: under
    # ``torch.compile(OverlapDDP(model))`` Dynamo traces only what the wrapper calls (the module),
    # never the reducer's collectives or fences.
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; a synchronized forward arms the reduction of its backward."""
        with torch.autograd.profiler.record_function("OverlapDDP.forward"):
            self._reducer.check_not_in_backward()
            grad_enabled = torch.is_grad_enabled()
            joining = self._join_config.enable
            work = Join.notify_join_context(self)
            if work is not None:
                self._reducer.set_join_count(work, self._divide_by_initial_world_size)
            if grad_enabled:
                self._reducer.prepare_for_forward()
            if self.will_sync_module_buffers():
                self._broadcast_buffers(common_rank(self, True) if joining else 0)
            if joining:
                announce_backward_sync(self, self.require_backward_grad_sync)
            if self.device_ids:
                target = torch.device(self.device_type, self.device_ids[0])
                inputs, kwargs = _map_tensors((inputs, kwargs), lambda t: t.to(target, non_blocking=True))
            output = self.module(*inputs, **kwargs)
            if grad_enabled and self.require_backward_grad_sync:
                self.require_forward_param_sync = True
                outputs = list(tensors_in(output)) if self.find_unused_parameters else []
                self._reducer.prepare_for_backward(outputs)
                if self._reducer.needs_end_of_backward_trigger:
                    output = _end_of_backward_trigger(output, self._reducer)
            else:
                self.require_forward_param_sync = False
            return output

    def _broadcast_buffers(self, source: int) -> None:
        broadcast_coalesced(self.modules_buffers, source, self.process_group)

    def _broadcast_state(self, source: int, with_buffers: bool) -> None:
        """Parameters (and, ``with_buffers``, buffers) from rank ``source`` to all ranks."""
        states = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        if with_buffers:
            states += self.modules_buffers
        broadcast_coalesced(states, source, self.process_group)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers from rank 0 (DDP's rule, no_sync exceptions included)."""
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0

    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated alias of ``forward_sync_buffers``, kept as in DDP."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in forwards run inside this context; the next synchronized
        backward reduces the sum. Assigning ``require_backward_grad_sync`` does the same."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _set_static_graph(self) -> None:
        """DDP's older way to ask for ``static_graph=True``; call it before the first backward."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self._reducer.enable_static_graph()
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to OverlapDDP, `_set_static_graph` will detect unused "
                "parameters automatically, so you do not need to set find_unused_parameters=true.",
                stacklevel=2,
            )

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Name parameters and buffers (fully qualified) that OverlapDDP, like DDP, leaves alone:
        not broadcast, not reduced. Call on the bare module before wrapping it."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    # -- DDP's device-placement helpers, kept for scripts that call them --------------------------

    def to_kwargs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_id: int) -> tuple[tuple, tuple]:
        """``inputs`` and ``kwargs`` moved to device ``device_id`` of this model's type, as DDP returns them:
        a tuple of input tuples and a tuple of kwargs dicts, padded to the same length."""
        # torch's own helper (DDP's), so lists, named tuples and PackedSequence come back as DDP returns them.
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id), False)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: list[int]) -> tuple[tuple, tuple]:
        """Split the inputs along ``dim`` over ``device_ids`` (``torch.nn.parallel.scatter_kwargs``)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """Concatenate per-device outputs along ``dim`` on ``output_device`` (``torch.nn.parallel.gather``)."""
        return gather(outputs, output_device, dim=self.dim)

    # -- communication hooks ------------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)``; the stock DDP hooks run unmodified."""
        check_comm_hook(hook, self.process_group)
        if self._reducer.options.tuned_plan:
            _check_per_bucket_state(state, self._reducer.final_layout_iteration)
        self._reducer.set_comm_hook(state, hook)
        self._comm_hooks.append((hook, state))

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """DDP's built-in ALLREDUCE and FP16_COMPRESS hooks, with their arithmetic."""
        hook = builtin_hook(comm_hook_type)
        self._reducer.set_comm_hook(self.process_group, hook)
        self._comm_hooks.append((hook, self.process_group))

    # -- the optimizer and the fences ----------------------------------------------------------

    def attach_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        overlap: bool = False,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        strict: bool = False,
        allow_unsynced: bool = False,
    ) -> OptimizerGuard | OverlappedOptimizer:
        """Guard ``optimizer``: its ``step()`` and ``zero_grad()`` only touch complete, reduced, fresh gradients.

        With ``overlap=True`` each bucket's update runs as soon as that bucket is reduced, while later
        buckets are still reducing; ``step()`` then returns once all updates are done (SGD, Adam, AdamW).
        ``max_grad_norm`` clips as ``clip_grad_norm_`` would, and ``scaler`` unscales as
        ``scaler.unscale_`` would (per-bucket norms and unscaling overlap communication; the updates
        then wait for the last bucket). Keep calling ``scaler.step(optimizer)`` and ``scaler.update()``.
        Without overlap, a ``scaler`` is guarded too: its ``unscale_(optimizer)`` gets the step's checks.

        Example::

            >>> guard = model.attach_optimizer(optimizer)
            >>> loss.backward(); optimizer.step()       # raises if a gradient is stale or in flight
        """
        if overlap:
            return OverlappedOptimizer(self._reducer, optimizer, max_grad_norm=max_grad_norm, scaler=scaler)
        if max_grad_norm is not None:
            raise ValueError("max_grad_norm is for overlap=True; without overlap call clip_grad_norm_ before step().")
        return OptimizerGuard(self._reducer, optimizer, strict=strict, allow_unsynced=allow_unsynced, scaler=scaler)

    def record_fences(self) -> FenceLog:
        """Start recording every fence edge (a debug option); ``log.violations()`` checks their order."""
        log = FenceLog()
        self._reducer.fence.log = log
        return log

    def count_tokens(self, tokens: int) -> None:
        """Token-weighted reduction: call once per micro-batch, before its forward, with its token
        count, and backpropagate the SUM of its token losses; the reduced gradient is then that of
        the global per-token mean loss. The first call switches the wrapper to this mode.

        Example::

            >>> model.count_tokens(int(mask.sum()))
            >>> loss = F.cross_entropy(model(x)[mask], y[mask], reduction="sum"); loss.backward()
        """
        self._reducer.enable_token_weighting().add(tokens)

    def bucket_indices(self) -> list[list[int]]:
        """The current buckets, in launch order, as indices into the parameters that require grad."""
        return [list(members) for members in self._reducer.plan.buckets]

    def check_nonfinite_gradients(self, enabled: bool = True) -> None:
        """Debug option: stop every rank, naming the ranks and parameters, when a gradient is NaN or
        Inf, before its bucket is reduced (costs one small all-reduce per bucket)."""
        self._reducer.check_finite = enabled

    def bucket_state(self) -> dict[str, Any]:
        """What a checkpoint needs, beside ``state_dict()``, to resume bit-exactly: the bucket layout."""
        return {"ready_order": self._reducer.bucket_order(), "tuned_buckets": self._reducer.tuned_buckets()}

    def load_bucket_state(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's bucket layout (call before the first forward after resuming)."""
        if not isinstance(state, dict) or "ready_order" not in state:
            raise ValueError(f"Expected the dict returned by bucket_state(), got {state!r}.")
        self._reducer.restore_bucket_order(state["ready_order"], state.get("tuned_buckets"))

    @property
    def _has_rebuilt_buckets(self) -> bool:
        return self._reducer.has_rebuilt_buckets

    # -- uneven inputs ---------------------------------------------------------------------------

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs: joined ranks shadow the others' collectives (as DDP).

        ``divide_by_initial_world_size=False`` averages over the ranks still training instead.
        """
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    def join_hook(self, **kwargs: Any) -> OverlapJoinHook:
        """The hook ``Join`` runs on a rank that has run out of inputs."""
        return OverlapJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group


def _check_per_bucket_state(state: object, final_layout_iteration: int) -> None:
    """PowerSGD keeps state per bucket index from ``start_powerSGD_iter`` on: the tuned layout must be
    final by then (DDP's own rebuild comes early enough for PowerSGD's minimum of 2)."""
    if isinstance(state, PowerSGDState) and state.start_powerSGD_iter < final_layout_iteration:
        raise ValueError(
            f"PowerSGD keeps per-bucket state from iteration start_powerSGD_iter={state.start_powerSGD_iter} on, "
            f"but the buckets change until iteration {final_layout_iteration} (bucket_plan='tuned'); set "
            f"start_powerSGD_iter >= {final_layout_iteration} or use bucket_plan='ddp'."
        )


def _resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any | None) -> dist.ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        raise RuntimeError(
            "OverlapDDP needs torch.distributed: call dist.init_process_group(...) first, or pass process_group."
        )
    return dist.group.WORLD


def _check_parameters(named: list[tuple[str, torch.Tensor]], trainable: list[tuple[str, torch.Tensor]]) -> None:
    lazy = [n for n, p in named if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise RuntimeError(
            f"Modules with uninitialized parameters can't be used with OverlapDDP ({', '.join(lazy)}). "
            "Run a dummy forward pass to initialize them first."
        )
    if not trainable:
        raise RuntimeError(
            "OverlapDDP is not needed when a module doesn't have any parameter that requires a gradient."
        )
    device_types = {p.device.type for _, p in named}
    if len(device_types) != 1:
        by_type = {t: [n for n, p in named if p.device.type == t][:3] for t in sorted(device_types)}
        raise ValueError(
            f"OverlapDDP's input module must be on one type of device, but its parameters are on {by_type}."
        )


def _resolve_devices(
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[int] | None, int | None]:
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    devices = {p.device for _, p in named}
    single_gpu = len(devices) == 1 and next(iter(devices)).type != "cpu"
    if not device_ids or not single_gpu:
        if device_ids or output_device is not None:
            raise ValueError(
                "device_ids and output_device only work with single-device GPU modules, but got "
                f"device_ids {device_ids}, output_device {output_device}, and module parameters on {devices}."
            )
        return None, None
    ids = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]
    out = ids[0] if output_device is None else output_device
    return ids, (torch.device(out).index if not isinstance(out, int) else out)


def _resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(runtime buffer broadcast, buffer broadcast at construction), as DDP resolves them."""
    if broadcast_buffers is not None:
        warnings.warn(
            "`broadcast_buffers` is deprecated (as in DDP); use `forward_sync_buffers`. "
            + ("It is ignored because `forward_sync_buffers` is given." if forward_sync_buffers is not None else ""),
            FutureWarning,
            stacklevel=3,
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _register_ready_hooks(reducer: Reducer, params: list[torch.Tensor]) -> list[Any]:
    """One post-accumulate-grad hook per parameter; the last launch queues finalize once per backward.

    The hooks hold the reducer weakly so that a discarded wrapper never reduces again.
    """
    reducer_ref = weakref.ref(reducer)

    def make_hook(index: int) -> Callable[[torch.Tensor], None]:
        def on_ready(_: torch.Tensor) -> None:
            live = reducer_ref()
            if live is not None and live.mark_ready(index):
                torch.autograd.Variable._execution_engine.queue_callback(live.finalize)

        return on_ready

    return [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)]


class _EndOfBackward(torch.autograd.Function):
    """Identity on the outputs whose backward queues the static graph's first reduction.

    Its backward runs first in the outermost graph task, so the queued callback runs when that
    whole backward (reentrant checkpoints included) has finished.
    """

    @staticmethod
    def forward(ctx: Any, reducer: Reducer, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.reducer = reducer
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if not getattr(ctx, "queued", False):
            ctx.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(ctx.reducer.reduce_learned_graph)
        return (None, *grads)


def _end_of_backward_trigger(output: Any, reducer: Reducer) -> Any:
    """Route the differentiable tensors of ``output`` through :class:`_EndOfBackward`, keeping its structure."""
    leaves = [t for t in tensors_in(output) if t.grad_fn is not None]
    if not leaves:
        return output
    replaced = dict(zip(map(id, leaves), _EndOfBackward.apply(reducer, *leaves)))
    return _map_tensors(output, lambda t: replaced.get(id(t), t))


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples (named ones too) and dicts."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        items = [_map_tensors(x, fn) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tensors(v, fn)) for k, v in tree.items())
    return tree
