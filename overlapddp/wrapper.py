"""How ``nn.Module`` and autograd talk to the reducer: the ``OverlapDDP`` wrapper.

It owns the constructor contract (DDP's arguments, names, order and defaults), the start-of-forward
work (rebuild, buffer broadcast), one post-accumulate-grad hook per parameter and the one
end-of-backward callback. Everything below it sees tensors only.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from overlapddp.attachment import AttachTo, Switches, attach
from overlapddp.bucket.comm_hook import CommHook
from overlapddp.bucket.comm_hook_validation import builtin_hook, check_comm_hook, check_hook_state
from overlapddp.compile_split import GraphSplitter, in_compiled_autograd
from overlapddp.construction import Arguments, Construction, resolve, synchronize
from overlapddp.delayed_reduction import DelayedReduction
from overlapddp.fence import Fence, FenceLog
from overlapddp.join import OverlapJoinHook, announce_backward_sync, common_rank
from overlapddp.mixed_precision import MixedPrecision, ParameterCasts, ReduceInPrecision, reduce_in_precision_hook
from overlapddp.module_sync import broadcast_buffers, broadcast_state
from overlapddp.optim.guard import OptimizerGuard
from overlapddp.optim.overlap import OverlappedOptimizer
from overlapddp.param_usage import map_tensors, tensors_in
from overlapddp.pickling import ReducerRecipe, bind_to_default_group, pickled_state, recipe_of
from overlapddp.reducer import Reducer
from overlapddp.refusals import Feature, refuse_pairs
from overlapddp.shard.optimizer import ShardedOptimizer
from overlapddp.sync_checks import SyncFlagCheck
from overlapddp.torch_compat import let_dcp_unwrap, queue_callback, to_kwargs


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
        given = locals()  # DDP's arguments by name, so none can shift into another's place
        args = Arguments(**{field.name: given[field.name] for field in dataclasses.fields(Arguments)})
        built = resolve(module, args)  # every argument checked; no collective yet
        self._keep(module, args, built)
        synchronize(built, init_sync)
        if built.precision is not None:
            built.precision.cast_buffers(self.modules_buffers)  # once, at construction (as DDP)
        self._build(built.recipe, built.process_group)

    def _build(self, recipe: ReducerRecipe, process_group: dist.ProcessGroup) -> None:
        """The wrapper's live parts, the one way its constructor and its copies get them: the reducer
        (with its fence, desync records and sync flag), the autograd hooks, the compiled graphs'
        splitter and mixed precision's casts."""
        self.process_group = process_group
        self._recipe = recipe
        # Every alias: the recipe may name a tied weight by its second name (see construction.py).
        every_alias: dict[str, torch.Tensor] = dict(self.module.named_parameters(remove_duplicate=False))
        self._reducer = recipe.build(every_alias, process_group, self._sync_flags)
        self._hook_handles = _register_ready_hooks(self._reducer, self._reducer.params)
        delayed = self._reducer.delayed
        if delayed is not None:
            hook_param = self.module.get_parameter(cast(str, recipe.hook_parameter))  # named with delayed ones
            self._hook_handles += _register_delayed_hooks(self._reducer, delayed, hook_param)
        self._graph_splitter = GraphSplitter(self._reducer, self.bucket_bytes_cap)  # see compile_split.py
        self._hook_is_builtin = False  # DDP's _comm_hooks records registered hooks, not built-in ones
        self._sharded_optimizers: list[ShardedOptimizer] = []  # attach_optimizer(shard=True)'s, in order
        self._mixed_precision: tuple[MixedPrecision, ParameterCasts] | None = None
        if self.mixed_precision is not None:
            self._set_up_mixed_precision(MixedPrecision(self.mixed_precision))

    def _keep(self, module: nn.Module, args: Arguments, built: Construction) -> None:
        """The attributes DDP has (scripts and frameworks read them), from the resolved arguments."""
        self.module = module
        self.dim = args.dim
        self.find_unused_parameters = args.find_unused_parameters
        self.gradient_as_bucket_view = args.gradient_as_bucket_view
        self.static_graph = args.static_graph
        self.batched_grad_copy = args.batched_grad_copy
        self.mixed_precision = args.mixed_precision
        self._sync_flags = SyncFlagCheck()  # holds require_backward_grad_sync (see sync_checks.py)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True  # set by join(); read by forward under Join
        self.parameters_to_ignore = built.ignored
        self.device = built.device
        self.device_type = self.device.type
        self.device_ids, self.output_device = built.device_ids, built.output_device
        self.forward_sync_buffers = built.forward_sync_buffers
        self.modules_buffers = built.buffers
        self.bucket_bytes_cap = built.recipe.caps.bytes_cap
        self._sparse_names = built.sparse_names

    def _set_up_mixed_precision(self, precision: MixedPrecision) -> None:
        """DDP's ``mixed_precision`` (see mixed_precision.py): parameters cast per forward, buckets
        reduced in the reduce dtype by a comm hook (so, as in DDP, no other hook can be registered)."""
        named = self.module.named_parameters()
        casts = ParameterCasts([p for n, p in named if n not in self.parameters_to_ignore], precision.param_dtype,
                               _fence_of(weakref.ref(self._reducer)))
        reduction = ReduceInPrecision(precision, casts, self.process_group)
        self._reducer.reduction.set_comm_hook(reduction, reduce_in_precision_hook)
        self._mixed_precision = (precision, casts)

    # -- forward ------------------------------------------------------------------------------

    # The wrapper's own bookkeeping and collectives always run eagerly: under
    # ``torch.compile(OverlapDDP(model))`` Dynamo traces only what the wrapper calls (the module),
    # never the reducer's collectives or fences (the helpers around the module call are disabled).
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; a synchronized forward arms the reduction of its backward."""
        with torch.autograd.profiler.record_function("OverlapDDP.forward"):
            inputs, kwargs = self._pre_forward(inputs, kwargs)
            # Compiled graphs are cut where the buckets close, so they launch during backward.
            with self._graph_splitter:
                output = self.module(*inputs, **kwargs)
            return self._post_forward(output)

    @torch.compiler.disable
    def _pre_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._reducer.check_not_in_backward()
        work = Join.notify_join_context(self)
        if work is not None:
            self._reducer.reduction.set_join_count(work, self._divide_by_initial_world_size)
        if torch.is_grad_enabled():
            self._reducer.prepare_for_forward()
        if self.will_sync_module_buffers():
            self._broadcast_buffers(common_rank(self, True) if self._join_config.enable else 0)
        if self._join_config.enable:
            announce_backward_sync(self, self.require_backward_grad_sync)
        if self.device_ids:
            target = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(target, non_blocking=True))
        if self._mixed_precision is not None:
            precision, casts = self._mixed_precision
            casts.to_low()
            inputs, kwargs = map_tensors((inputs, kwargs), precision.cast_input)
        return inputs, kwargs

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        if self._mixed_precision is not None and not torch.is_grad_enabled():
            self._mixed_precision[1].to_full()  # no backward will return them (DDP leaves them in param_dtype)
        if torch.is_grad_enabled():
            self._sync_flags.forward_synced = self.require_backward_grad_sync
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._expect_backward(list(tensors_in(output)))
            if self._reducer.needs_end_of_backward_trigger:
                output = _end_of_backward_trigger(output, self._reducer)
            elif self._reducer.options.searches_unused_each_forward:
                # As DDP's sink: an output the loss never reaches still fires its parameters' hooks (with
                # an undefined gradient: unused), so their buckets complete.
                output = _end_of_backward_trigger(output, None)
        else:
            self.require_forward_param_sync = False
        return output

    def _expect_backward(self, outputs: list[torch.Tensor]) -> None:
        """The next backward, from ``outputs``, reduces its gradients (they tell the unused-parameter
        search which parameters take part)."""
        self.require_forward_param_sync = True
        self._reducer.prepare_for_backward(outputs if self.find_unused_parameters else [])

    def arm_backward(self, outputs: list[torch.Tensor], *, caller: str, rebuild: bool = False) -> None:
        """For frameworks that decide just before the backward, not in ``forward``, that it reduces
        (Lightning's manual optimization, Accelerate's ``trigger_sync_in_backward``: they call DDP's
        ``reducer.prepare_for_backward``): make the next backward, from ``outputs``, reduce as a
        synchronized forward would have. ``rebuild`` first applies a pending bucket rebuild, as a
        forward would (Lightning rebuilds DDP's buckets there). ``caller`` names the framework in errors.
        """
        if rebuild:
            self._reducer.prepare_for_forward()
        if self._reducer.learns_graph_next:
            raise RuntimeError(
                f"{caller}: OverlapDDP with static_graph=True reduces its first iteration when backward "
                "reaches the forward's outputs, so that iteration must come from a synchronized forward; "
                "run the first step with the usual forward, or set static_graph=False."
            )
        self._expect_backward(outputs)
        if self._reducer.needs_end_of_backward_trigger:
            raise RuntimeError(
                f"{caller}: with find_unused_parameters=True and a reentrant checkpoint (use_reentrant=True) in "
                "the graph, OverlapDDP reduces when backward reaches the forward's outputs, so the backward must "
                "come from a synchronized forward; use use_reentrant=False, or static_graph=True if the graph "
                "does not change."
            )

    def _shadow_forward(self) -> None:
        """A joined rank's part of the others' forward (join.py): a pending rebuild, as they apply it."""
        self._reducer.prepare_for_forward()

    def _shadow_backward(self) -> None:
        """A joined rank's part of the others' backward (join.py): their collectives, on zeros."""
        self._reducer.shadow_backward()

    def _broadcast_buffers(self, source: int) -> None:
        broadcast_buffers(self.modules_buffers, source, self.process_group)

    def _broadcast_state(self, source: int, with_buffers: bool) -> None:
        """Parameters (and, ``with_buffers``, buffers) from rank ``source`` to all ranks."""
        parameters = [p for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        broadcast_state(parameters, self.modules_buffers if with_buffers else [], source, self.process_group)

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

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next forward arms the reduction of its backward (DDP's flag; ``no_sync()`` sets it)."""
        return self._sync_flags.requested

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync_flags.requested = value

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
                tensor._ddp_ignored = True  # type: ignore[attr-defined]

    # -- DDP's device-placement helpers, kept for scripts that call them --------------------------

    def to_kwargs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_id: int) -> tuple[tuple, tuple]:
        """``inputs`` and ``kwargs`` moved to device ``device_id`` of this model's type, as DDP returns them:
        a tuple of input tuples and a tuple of kwargs dicts, padded to the same length."""
        # torch's own helper (DDP's), so lists, named tuples and PackedSequence come back as DDP returns them.
        return to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id))

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: list[int]
    ) -> tuple[tuple, tuple]:
        """Split the inputs along ``dim`` over ``device_ids`` (``torch.nn.parallel.scatter_kwargs``)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """Concatenate per-device outputs along ``dim`` on ``output_device`` (``torch.nn.parallel.gather``)."""
        return gather(outputs, output_device, dim=self.dim)

    # -- communication hooks ------------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)``; the stock DDP hooks run unmodified."""
        check_comm_hook(hook, self.process_group)
        refuse_pairs(self._features(), Feature.COMM_HOOK, hook=getattr(hook, "__qualname__", repr(hook)),
                     rank=self._reducer.rank)
        layout_final_at = self._reducer.layouts.final_iteration if self._reducer.options.tuned_plan else 0
        check_hook_state(state, self._sparse_names, layout_final_at)
        self._reducer.reduction.set_comm_hook(state, hook)

    @property
    def _comm_hooks(self) -> list[tuple[CommHook, object]]:
        """DDP's record of ``register_comm_hook`` as ``[(hook, state)]``, read from the reducer's one
        copy: mixed precision's reduction is there (DDP registers its own the same way), a built-in
        hook is not."""
        registered = self._reducer.reduction.comm_hook
        if registered is None or self._hook_is_builtin:
            return []
        state, hook = registered
        return [(hook, state)]

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """DDP's built-in ALLREDUCE and FP16_COMPRESS hooks, with their arithmetic."""
        hook = builtin_hook(comm_hook_type)
        refuse_pairs(self._features(), Feature.COMM_HOOK, hook=hook.__qualname__, rank=self._reducer.rank)
        self._reducer.reduction.set_comm_hook(self.process_group, hook)
        self._hook_is_builtin = True

    def _features(self) -> set[Feature]:
        """The features in force whose combinations the refusal table checks (refusals.py), each read
        from the one object that holds it."""
        reducer, reduction = self._reducer, self._reducer.reduction
        switched = {
            Feature.TUNED_PLAN: reducer.options.tuned_plan,
            Feature.SPARSE_GRADIENTS: bool(self._sparse_names),
            Feature.UNUSED_SEARCH: reducer.options.searches_unused_each_forward,
            Feature.MIXED_PRECISION: self._mixed_precision is not None,
            Feature.GRADIENT_AS_BUCKET_VIEW: reducer.options.gradient_as_bucket_view,
            Feature.DELAYED_ALL_REDUCE: reducer.delayed is not None,
            Feature.COMM_HOOK: reduction.comm_hook is not None,
            Feature.COUNT_TOKENS: reduction.tokens is not None,
            Feature.OVERLAPPED_OPTIMIZER: any(isinstance(c, OverlappedOptimizer) for c in reducer.consumers),
            Feature.SHARDED_OPTIMIZER: bool(self._sharded_optimizers),
            Feature.JOIN: self._join_config.enable,  # once inside model.join() (as the forward reads it)
        }
        return {feature for feature, on in switched.items() if on}

    # -- the optimizer and the fences ----------------------------------------------------------

    def attach_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        overlap: bool = False,
        shard: bool = False,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        strict: bool = False,
        allow_unsynced: bool = False,
    ) -> OptimizerGuard | OverlappedOptimizer | ShardedOptimizer:
        """Guard ``optimizer``: its ``step()`` and ``zero_grad()`` only touch complete, reduced, fresh gradients.

        With ``overlap=True`` each bucket's update runs as soon as that bucket is reduced, while later
        buckets are still reducing; ``step()`` then returns once all updates are done (per-parameter
        optimizers: SGD, Adam, AdamW, Muon, Adafactor, Adagrad, RMSprop, NAdam, RAdam, or a declared class).
        ``max_grad_norm`` clips as ``clip_grad_norm_`` would, and ``scaler`` unscales as
        ``scaler.unscale_`` would (per-bucket norms and unscaling overlap communication; the updates
        then wait for the last bucket). Keep calling ``scaler.step(optimizer)`` and ``scaler.update()``.
        Without overlap, a ``scaler`` is guarded too: its ``unscale_(optimizer)`` gets the step's checks.

        With ``shard=True`` backward is DDP's; ``step()`` updates only the parameters this rank owns
        (1/N of the state, balanced by cost) and sends each to every rank, all arrived when it returns
        (Muon, SGD, Adam, AdamW and other per-parameter optimizers; see docs/sharded_optimizer.md).

        Every line of a DDP loop keeps its meaning or raises at that line (docs/loop_contract.md). With
        ``overlap=True``, an lr set between backward and ``step()``, or a skipped ``step()``, raises; one
        read cannot be seen and is this mode's contract: parameters read between backward and ``step()``
        already hold their updated values.

        Example::

            >>> guard = model.attach_optimizer(optimizer)
            >>> loss.backward(); optimizer.step()       # raises if a gradient is stale or in flight
        """
        target = AttachTo(self._reducer, self.process_group, {id(p): n for n, p in self.module.named_parameters()},
                          self._features(), self._sharded_optimizers)
        return attach(target, optimizer, Switches(overlap, shard, max_grad_norm, scaler, strict, allow_unsynced))

    @property
    def fence(self) -> Fence:
        """The fence that orders every bucket's collective before its readers (``overlapddp.testing``)."""
        return self._reducer.fence

    def replace_fence(self, fence: Fence) -> Fence:
        """Swap in another fence between iterations, returning the one in force (race-forcing tools
        wrap the real one: ``overlapddp.testing``)."""
        return self._reducer.replace_fence(fence)

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
        registered = self._reducer.reduction.comm_hook
        hook = "" if registered is None else getattr(registered[1], "__qualname__", repr(registered[1]))
        features = self._features()
        if Feature.COUNT_TOKENS not in features:
            refuse_pairs(features, Feature.COUNT_TOKENS, rank=self._reducer.rank, hook=hook)
        self._reducer.reduction.enable_token_weighting(self.device).add(tokens)

    def bucket_indices(self) -> list[list[int]]:
        """The current buckets, in launch order, as indices into the parameters that require grad."""
        return [list(members) for members in self._reducer.plan.buckets]

    def check_nonfinite_gradients(self, enabled: bool = True) -> None:
        """Debug option: stop every rank, naming the ranks and parameters, when a gradient is NaN or
        Inf, before its bucket is reduced (costs one small all-reduce per bucket)."""
        self._reducer.stages.check_nonfinite = enabled

    def bucket_state(self) -> dict[str, Any]:
        """What a checkpoint needs, beside ``state_dict()``, to resume bit-exactly: the bucket layout."""
        return {"ready_order": self._reducer.layouts.bucket_order(), "tuned_buckets": self._reducer.tuned_buckets()}

    def load_bucket_state(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's bucket layout (call before the first forward after resuming)."""
        if not isinstance(state, dict) or "ready_order" not in state:
            raise ValueError(f"Expected the dict returned by bucket_state(), got {state!r}.")
        self._reducer.restore_bucket_order(state["ready_order"], state.get("tuned_buckets"))

    @property
    def _has_rebuilt_buckets(self) -> bool:
        return self._reducer.layouts.rebuilt

    # -- copies and pickles (pickling.py) --------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """As DDP: everything but the process group and the reducer (``copy.deepcopy``, ``torch.save``)."""
        return pickled_state(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As DDP: bind to the default process group and build new live parts, as at construction."""
        group = bind_to_default_group(recipe_of(state))
        super().__setstate__(state)
        self._build(self._recipe, group)

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
        refuse_pairs(self._features(), Feature.JOIN, rank=self._reducer.rank)
        return OverlapJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group


# DCP's state-dict helpers (get_model_state_dict, get_state_dict, ...) drop OverlapDDP's ``module.``
# prefix as they drop DDP's, so checkpoints move between the two.
let_dcp_unwrap(OverlapDDP)


def _fence_of(reducer_ref: weakref.ReferenceType[Reducer]) -> Callable[[], Fence]:
    """The fence the reducer holds when called (a test may replace it), without keeping the reducer alive."""

    def fence() -> Fence:
        reducer = reducer_ref()
        return reducer.fence if reducer is not None else Fence()

    return fence


def _register_ready_hooks(reducer: Reducer, params: list[torch.Tensor]) -> list[Any]:
    """One post-accumulate-grad hook per parameter; the last launch queues finalize once per backward.

    The hooks hold the reducer weakly so that a discarded wrapper never reduces again.
    """
    reducer_ref = weakref.ref(reducer)

    def make_hook(index: int) -> Callable[[torch.Tensor], None]:
        @torch.compiler.disable  # under compiled autograd: run eagerly, where the gradient is accumulated
        def on_ready(_: torch.Tensor) -> None:
            live = reducer_ref()
            if live is not None and live.mark_ready(index):
                _at_end_of_backward(live.finalize)

        return on_ready

    return [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)]


def _register_delayed_hooks(reducer: Reducer, delayed: DelayedReduction, hook_param: torch.Tensor) -> list[Any]:
    """Each delayed parameter reports its gradient (one arriving after the launch is an error); then
    ``hook_param``'s gradient launches the delayed all-reduce. Hooks run in registration order."""
    reducer_ref = weakref.ref(reducer)

    def make_arrival(index: int) -> Callable[[torch.Tensor], None]:
        def arrived(_: torch.Tensor) -> None:
            live = reducer_ref()
            if live is not None and live.delayed is not None:
                live.delayed.gradient_ready(index, live.fence)

        return arrived

    def launch(_: torch.Tensor) -> None:
        live = reducer_ref()
        if live is not None:
            live.launch_delayed()

    handles = [p.register_post_accumulate_grad_hook(make_arrival(i)) for i, p in enumerate(delayed.params)]
    return handles + [hook_param.register_post_accumulate_grad_hook(launch)]


def _at_end_of_backward(callback: Callable[[], None]) -> None:
    """Queue ``callback`` for the end of this backward; compiled autograd drops queued callbacks, so
    there it runs now (from the hook of the last gradient, every bucket launched)."""
    if in_compiled_autograd():
        callback()
    else:
        queue_callback(callback)


class _EndOfBackward(torch.autograd.Function):
    """Identity on the outputs whose backward queues the reduction of a backward that only counts its
    gradients (the static graph's first; one through a reentrant checkpoint with find_unused_parameters).
    With no reducer it queues nothing: it only passes an undefined gradient on for each output the loss
    did not reach, so the hooks of the parameters behind it still fire (DDP's ``_DDPSink``).

    Its backward runs first in the outermost graph task, so the queued callback runs when that
    whole backward (reentrant checkpoints included) has finished.
    """

    @staticmethod
    def forward(ctx: Any, reducer: Reducer | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.reducer = reducer
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.reducer is not None and not getattr(ctx, "queued", False):
            ctx.queued = True
            queue_callback(ctx.reducer.reduce_at_end_of_backward)
        return (None, *grads)


def _end_of_backward_trigger(output: Any, reducer: Reducer | None) -> Any:
    """Route the differentiable tensors of ``output`` through :class:`_EndOfBackward`, keeping its structure."""
    leaves = [t for t in tensors_in(output) if t.grad_fn is not None]
    if not leaves:
        return output
    replaced = dict(zip(map(id, leaves), _EndOfBackward.apply(reducer, *leaves), strict=True))
    return map_tensors(output, lambda t: replaced.get(id(t), t))
