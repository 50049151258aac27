"""Which generated mutants cannot change what overlapddp does, and why not?

Each entry names the module and the mutated line before and after (``old => new``, stripped, as
tools/mutation_run.py prints it), so an entry survives the line moving. A mutant listed here is
reported as equivalent, not survived; the argument says why no test can tell it apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Equivalent:
    module: str
    change: str
    why: str


_ONE_TRAINABLE_DEVICE = (
    "a module whose parameters that require grad are on more than one device is refused first "
    "(construction._check_parameters): the last one's device is the first one's"
)

_ENUM_MEMBERS = "enum members are singletons without a custom __eq__: identity and equality agree"
_FIRES = "a firing count starts at 0 and only grows, so it is never negative: '<= 0' is '== 0'"
_NEXT_LAUNCH = (
    "next_launch grows by one from 0 and only while it is below the number of buckets, so it never passes it: "
    "'<' is '!=' and '==' is '>='"
)
_BUCKET_INDEX = "a bucket's index is below the number of buckets, so '>= count - 1' is '== count - 1'"
_MISSING = "a bucket's missing count starts at its member count and only falls, so '<' is '!='"
_SPARSE_ALONE = (
    "a parameter with sparse gradients gets a bucket of its own (layout/plan.py), so a bucket's first and last "
    "member are one parameter, or both dense"
)

_ONE_BUFFER_DEVICE = (
    "every bucket's buffer is on the parameters' one device (construction refuses a module on several), so the "
    "first bucket's device is the last one's"
)

_STACKLEVEL = (
    "stacklevel only chooses which frame the warning is attributed to; levels 2, 3 and 4 are all inside "
    "overlapddp (sync_checks.py, then the reducer, then the wrapper or the reducer's gradient hook), the "
    "message names the rank and the cause, and warning filters and the once-per-wrapper rule do not read it"
)

_EMPTY = (
    "inspect's empty marker is a class that only equals itself, and annotations compare by identity "
    "or as strings, so 'is not empty' and '!= empty' agree on every annotation"
)

_ENUM = (
    "enum members are singletons and Accelerate stores members, not strings, so 'is' and '==' agree"
)

_RANK_ZERO = (
    "ranks are never negative, and broadcast_from overwrites every other rank's result with rank 0's: "
    "computing it on the other ranks too changes only the work done"
)

_EMPTY_PREFIX = (
    "the empty prefix's bucket start and predecessor are never read: the planner unpacks it as (finish, worst, _, _), "
    "and the backtrack stops when it reaches it"
)

_NO_PARAMETERS = (
    "ready_s is empty only for a model without parameters (the length check comes first): its one layout "
    "is the minimum whatever the key, and backward_end is read nowhere else"
)

_ONE_SPARSE_PARAMETER = (
    "a sparse bucket holds exactly one parameter (the constructor refuses any other count) and gets one "
    "gradient per copy: its first element is its last"
)

DEFAULT_RANK_AND_SIZE = (
    "the default rank and size belong to a record without a store, which never writes or reads a key and "
    "whose behind() returns before naming a rank; a record with a store always has the group's rank and size"
)

STEPPED_AT_ALIASES = (
    "_stepped_at is bound to the reducer's count object itself, and the count changes only by rebinding to "
    "a larger int: equal to it means the same object (checked past 256 steps)"
)

EQUIVALENTS: tuple[Equivalent, ...] = (
    Equivalent(
        "overlapddp/bucket/comm_hook_validation.py",
        'if annotation is not inspect.Parameter.empty and annotation not in (dist.GradBucket, Bucket, "dist.GradBucket"): '  # noqa: E501 (the line as cosmic-ray changes it)
        '=> if annotation != inspect.Parameter.empty and annotation not in (dist.GradBucket, Bucket, "dist.GradBucket"):',  # noqa: E501 (the line as cosmic-ray changes it)
        _EMPTY,
    ),
    Equivalent(
        "overlapddp/bucket/comm_hook_validation.py",
        "if returned is not inspect.Signature.empty and returned not in ( "
        "=> if returned != inspect.Signature.empty and returned not in (",
        _EMPTY,
    ),
    Equivalent(
        "overlapddp/bucket/comm_hook.py",
        "self._buffer.narrow(0, off, length).view(param.shape) => self._buffer.narrow( -1, off, length).view(param.shape)",  # noqa: E501 (the line as cosmic-ray changes it)
        "a bucket's buffer is one-dimensional, so its last dimension is its first",
    ),
    Equivalent(
        "overlapddp/bucket/comm_hook.py",
        "for off, length, param in zip(self._offsets, self._lengths, self._params, strict=True) "
        "=> for off, length, param in zip(self._offsets, self._lengths, self._params, strict=False)",
        "BucketStorage derives lengths and offsets from its own params list (one entry each), and the "
        "pipeline hands exactly those three to Bucket, so they never differ in length and strict never fires",
    ),
    Equivalent(
        "overlapddp/bucket/comm_hook_validation.py",
        "return str(self.args[0]) => return str(self.args[ -1])",
        "the error is raised in one place, with exactly one argument, so args[0] is args[-1]",
    ),
    Equivalent(
        "overlapddp/sync_checks.py",
        "warnings.warn(message, UserWarning, stacklevel=3) => warnings.warn(message, UserWarning, stacklevel= 4)",
        _STACKLEVEL,
    ),
    Equivalent(
        "overlapddp/sync_checks.py",
        "warnings.warn(message, UserWarning, stacklevel=3) => warnings.warn(message, UserWarning, stacklevel= 2)",
        _STACKLEVEL,
    ),
    Equivalent(
        "overlapddp/layout/plan.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "no BucketCaps or BucketPlan is ever assigned to or hashed (plans are compared by identity, caps read), "
        "and equality and repr are the same for a frozen and a plain dataclass",
    ),
    Equivalent(
        "overlapddp/layout/plan.py",
        "if isinstance(bucket_cap_mb_list, (str, bytes)) or len(bucket_cap_mb_list) == 0: "
        "=> if isinstance(bucket_cap_mb_list, (str, bytes)) or len(bucket_cap_mb_list) <= 0:",
        "a length is never negative",
    ),
    Equivalent(
        "overlapddp/layout/plan.py",
        "return self.rebuild_limits() if self.first_bytes < self.bytes_cap else [self.bytes_cap] "
        "=> return self.rebuild_limits() if self.first_bytes != self.bytes_cap else [self.bytes_cap]",
        "without a cap list, first_bytes is 1 MiB under the 25 MiB default cap or equals the user's cap: never "
        "larger, so < and != agree",
    ),
    Equivalent(
        "overlapddp/layout/plan.py",
        "return self.rebuild_limits() if self.first_bytes < self.bytes_cap else [self.bytes_cap] "
        "=> return self.rebuild_limits() if self.first_bytes is not self.bytes_cap else [self.bytes_cap]",
        "first_bytes is the user's cap object itself, or 1 MiB under the 25 MiB default; and where equal caps were "
        "distinct objects, limits [cap, cap] assign exactly as [cap] (the last limit repeats)",
    ),
    Equivalent(
        "overlapddp/optim/unscaler.py",
        "if p.grad.dtype == torch.float16: => if p.grad.dtype is torch.float16:",
        "torch dtypes are singletons: a float16 gradient's dtype is torch.float16 itself",
    ),
    Equivalent(
        "overlapddp/optim/unscaler.py",
        "if optimizer is not self._optimizer: => if optimizer != self._optimizer:",
        "torch.optim.Optimizer defines no __eq__, so != compares identity, as is not does",
    ),
    Equivalent(
        "overlapddp/optim/unscaler.py",
        'if self.scaler._per_optimizer_states[id(self._optimizer)]["stage"] is not OptState.READY: '
        '=> if self.scaler._per_optimizer_states[id(self._optimizer)]["stage"] != OptState.READY:',
        "OptState is an Enum: its members compare equal only to themselves",
    ),
    Equivalent(
        "overlapddp/optim/guard.py",
        "if self._reducer.reductions == self._stepped_at: => if self._reducer.reductions <= self._stepped_at:",
        "_stepped_at is only ever set to the reducer's reductions, which only grow: never larger than them",
    ),
    Equivalent(
        "overlapddp/optim/guard.py",
        '+ ("no synchronized backward has run yet." if self._stepped_at == 0 else '
        '=> + ("no synchronized backward has run yet." if self._stepped_at <= 0 else',
        "_stepped_at starts at 0 and is only set to the reducer's reductions, a count: never negative",
    ),
    Equivalent(
        "overlapddp/optim/guard.py",
        "if optimizer is self.optimizer: => if optimizer == self.optimizer:",
        "torch.optim.Optimizer defines no __eq__, so == compares identity, as is does",
    ),
    Equivalent(
        "overlapddp/mixed_precision.py",
        "if self.param_dtype is None or not tensor.is_floating_point() or tensor.dtype == self.param_dtype: "
        "=> if self.param_dtype is None or not tensor.is_floating_point() or tensor.dtype is self.param_dtype:",
        "torch dtypes are singletons: equal dtypes are the same object",
    ),
    Equivalent(
        "overlapddp/optim/guard.py",
        "if self._reducer.reductions == self._stepped_at: => if self._reducer.reductions is self._stepped_at:",
        "_stepped_at is 0 (a cached small int, as the reducer's first count) or the very object the reducer's "
        "count held at the last step; the count changes only by += 1, to a different value: equal means identical",
    ),
    Equivalent(
        "overlapddp/mixed_precision.py",
        "return work.get_future().then(lambda done: done.value()[0].div_(world_size)) "
        "=> return work.get_future().then(lambda done: done.value()[ -1].div_(world_size))",
        "an all_reduce of one tensor completes its future with a list of exactly that tensor",
    ),
    Equivalent(
        "overlapddp/pickling.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "a ReducerRecipe is never assigned to or hashed (copies are made with dataclasses.replace), and equality "
        "and repr are the same for a frozen and a plain dataclass",
    ),
    Equivalent(
        "overlapddp/pickling.py",
        "device = params[0].device => device = params[ -1].device",
        "OverlapDDP, like DDP, refuses a module whose parameters are on more than one device: the last "
        "parameter's device is the first's",
    ),
    Equivalent(
        "overlapddp/pickling.py",
        "if not dist.is_initialized() or group != dist.group.WORLD: "
        "=> if not dist.is_initialized() or group is not dist.group.WORLD:",
        "ProcessGroup defines no __eq__: != compares identity, as is not does",
    ),
    Equivalent(
        "overlapddp/delayed_reduction.py",
        "FENCE_KEY = -2 => FENCE_KEY = ~2",
        "~2 is -3: like -2 it is neither a bucket's index (0, 1, ...) nor the backward-end marker (-1)",
    ),
    Equivalent(
        "overlapddp/join.py",
        "chosen = torch.tensor([rank if candidate else -1], device=model.device) "
        "=> chosen = torch.tensor([rank if candidate else ~1], device=model.device)",
        "~1 is -2: like -1 it is below every rank, so a MAX picks a candidate and all-negative still means none",
    ),
    Equivalent(
        "overlapddp/join.py",
        "return bool(flag.item() != 0) => return bool(flag.item() > 0)",
        "the flag is a SUM of 0.0 and 1.0 over the ranks: never negative, so != 0 and > 0 agree",
    ),
    Equivalent(
        "overlapddp/delayed_reduction.py",
        "FENCE_KEY = -2 => FENCE_KEY = - 3",
        "-3, like -2, is neither a bucket's index (0, 1, ...) nor the backward-end marker (-1)",
    ),
    Equivalent(
        "overlapddp/delayed_reduction.py",
        "if len(kinds) > 1: => if len(kinds) != 1:",
        "its only caller (construction.py) returns before it for an empty list, so there is always a kind",
    ),
    Equivalent(
        "overlapddp/join.py",
        "chosen = torch.tensor([rank if candidate else -1], device=model.device) "
        "=> chosen = torch.tensor([rank if candidate else - 2], device=model.device)",
        "-2, like -1, is below every rank, so a MAX picks a candidate and all-negative still means none",
    ),
    Equivalent(
        "overlapddp/join.py",
        "flag = torch.tensor([1.0 if will_sync else 0.0], device=model.device) "
        "=> flag = torch.tensor([ 2.0 if will_sync else 0.0], device=model.device)",
        "only whether the SUM is 0 is read: a sum of 2.0s is 0 exactly when a sum of 1.0s is",
    ),
    Equivalent(
        "overlapddp/bucket/token_weighting.py",
        "total = float(self._on_host[0]) => total = float(self._on_host[ -1])",
        "the host copy of the count holds one element",
    ),
    Equivalent(
        "overlapddp/bucket/token_weighting.py",
        "total = float(future.wait()[0].item()) => total = float(future.wait()[ -1].item())",
        "an all_reduce of one tensor completes its future with a list of exactly that tensor",
    ),
    Equivalent(
        "overlapddp/bucket/token_weighting.py",
        'reduced = self._kit.wait_future(future, "collective")[0] '
        '=> reduced = self._kit.wait_future(future, "collective")[ -1]',
        "an all_reduce of one tensor completes its future with a list of exactly that tensor",
    ),
    Equivalent(
        "overlapddp/bucket/token_weighting.py",
        "self._on_host = torch.empty(1, dtype=torch.float64, pin_memory=reduced.is_cuda) "
        "=> self._on_host = torch.empty( 2, dtype=torch.float64, pin_memory=reduced.is_cuda)",
        "the one-element count is copied into a two-element buffer by broadcasting, and only element 0 is read",
    ),
    Equivalent(
        "overlapddp/bucket/token_weighting.py",
        "if total <= 0: => if total == 0:",
        "the total is a SUM of counts add() keeps non-negative: never below 0",
    ),
    Equivalent(
        'overlapddp/timeline.py',
        'if edge.edge != BACKWARD_END: => if edge.edge > BACKWARD_END:',
        "the fence's bucket edges (produced, launched, completed, consumed) all sort after 'backward end', so the order comparison agrees with inequality on every edge a log can hold",
    ),
    Equivalent(
        'overlapddp/timeline.py',
        'ends = {e.iteration: e.time for e in log.edges if e.edge == BACKWARD_END} => ends = {e.iteration: e.time for e in log.edges if e.edge <= BACKWARD_END}',
        "the fence's bucket edges (produced, launched, completed, consumed) all sort after 'backward end', so the order comparison agrees with inequality on every edge a log can hold",
    ),
    Equivalent(
        'overlapddp/timeline.py',
        'if e.edge == BACKWARD_END: => if e.edge <= BACKWARD_END:',
        "the fence's bucket edges (produced, launched, completed, consumed) all sort after 'backward end', so the order comparison agrees with inequality on every edge a log can hold",
    ),
    Equivalent(
        'overlapddp/bucket/gradient_checks.py',
        '(i, p.grad, p.grad._version) for i, p in zip(members, params, strict=True) if p.grad is not None => (i, p.grad, p.grad._version) for i, p in zip(members, params, strict=False) if p.grad is not None',
        'the two sequences come from one bucket (members and their parameters, or the entries and the flags stacked from them): their lengths are equal by construction, so strict never fires',
    ),
    Equivalent(
        'overlapddp/bucket/gradient_checks.py',
        'present = [(i, p.grad) for i, p in zip(members, params, strict=True) if p.grad is not None] => present = [(i, p.grad) for i, p in zip(members, params, strict=False) if p.grad is not None]',
        'the two sequences come from one bucket (members and their parameters, or the entries and the flags stacked from them): their lengths are equal by construction, so strict never fires',
    ),
    Equivalent(
        'overlapddp/bucket/gradient_checks.py',
        'bad = [names[i] for (i, _), flag in zip(present, flags.tolist(), strict=True) if flag] => bad = [names[i] for (i, _), flag in zip(present, flags.tolist(), strict=False) if flag]',
        'the two sequences come from one bucket (members and their parameters, or the entries and the flags stacked from them): their lengths are equal by construction, so strict never fires',
    ),
    Equivalent(
        'overlapddp/bucket/gradient_checks.py',
        'if self._params[i].grad is not grad or grad._version != version] => if self._params[i].grad is not grad or grad._version > version]',
        "a tensor's version counter only grows, so a changed version is always a larger one",
    ),
    Equivalent(
        'overlapddp/bucket/gradient_checks.py',
        'if count.item() == 0: => if count.item() <= 0:',
        'the count is a sum of 0/1 flags over ranks: never below 0',
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'return list(tree.values()), lambda values: type(tree)(zip(keys, values, strict=True)) => return list(tree.values()), lambda values: type(tree)(zip(keys, values, strict=False))',
        "keys and values are the same mapping's, in one order: equal lengths, so strict never fires",
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'changed = {f.name: v for f, v in zip(fields, values, strict=True) if f.init} => changed = {f.name: v for f, v in zip(fields, values, strict=False) if f.init}',
        "the values are the dataclass's own fields, mapped one to one: equal lengths, so strict never fires",
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'if all(new is old for new, old in zip(mapped, items, strict=True)): => if all(new is old for new, old in zip(mapped, items, strict=False)):',
        'mapped is built from items one to one: equal lengths, so strict never fires',
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'return [cast(Any, p.view_as(p).grad_fn).next_functions[0][0] for p in params] => return [cast(Any, p.view_as(p).grad_fn).next_functions[ -1][0] for p in params]',
        "a view_as node has exactly one next function (its input's accumulator): the first is the last",
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'hidden = hidden or getattr(node, "_forward_cls", None) is CheckpointFunction => hidden = hidden or getattr(node, "_forward_cls", None) == CheckpointFunction',
        'classes compare by identity: == and is agree on CheckpointFunction',
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'self._flags[index] = 1 => self._flags[index] = 2',
        'the flags are only ever tested for nonzero, locally and summed over ranks: a sum of 2s is nonzero exactly when a sum of 1s is',
    ),
    Equivalent(
        'overlapddp/param_usage.py',
        'self._global = self._reduction.wait()[0].tolist() => self._global = self._reduction.wait()[ -1].tolist()',
        'an all_reduce of one tensor completes its future with a list of exactly that tensor',
    ),
    Equivalent(
        "overlapddp/bucket/reduction.py",
        "self._divide_by: float | None = 1 => self._divide_by: float | None = 0",
        "never read: gradients are copied in only after a synchronized forward, whose arm() sets it first",
    ),
    Equivalent(
        "overlapddp/timeline.py",
        "start = min((e.time for e in log.edges), default=0.0) => start = min((e.time for e in log.edges), default= 1.0)",
        "the default is the start of an empty log, which has no events to place",
    ),
    Equivalent(
        "overlapddp/timeline.py",
        "start = min((e.time for e in log.edges), default=0.0) => start = min((e.time for e in log.edges), default= -1.0)",
        "the default is the start of an empty log, which has no events to place",
    ),
    Equivalent(
        "overlapddp/backend_support.py",
        'if backend == "nccl" and _async_error_handling() == "2": => if backend == "nccl" and _async_error_handling() is "2":',  # noqa: E501 (the line as cosmic-ray changes it)
        "CPython keeps one object per one-character string: the environment's '2', stripped, is the literal",
    ),
    Equivalent(
        'overlapddp/integrations/accelerate.py',
        'multi_cpu = accelerator.distributed_type == DistributedType.MULTI_CPU => multi_cpu = accelerator.distributed_type is DistributedType.MULTI_CPU',
        _ENUM,
    ),
    Equivalent(
        'overlapddp/integrations/accelerate.py',
        'if accelerator.distributed_type == DistributedType.MULTI_CPU: => if accelerator.distributed_type is DistributedType.MULTI_CPU:',
        _ENUM,
    ),
    Equivalent(
        'overlapddp/integrations/accelerate.py',
        'if accelerator.distributed_type == DistributedType.MULTI_CPU: => if accelerator.distributed_type <= DistributedType.MULTI_CPU:',
        "_device_ids runs only where _builds_ddp holds: MULTI_CPU, or a multi-device type (MULTI_GPU ... MULTI_XPU), none of which sorts below 'MULTI_CPU'",
    ),
    Equivalent(
        'overlapddp/integrations/accelerate.py',
        'if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO: => if accelerator.state.dynamo_plugin.backend is not DynamoBackend.NO:',
        _ENUM,
    ),
    Equivalent(
        'overlapddp/integrations/ray.py',
        'if parallel_strategy is None or get_context().get_world_size() == 1: => if parallel_strategy is None or get_context().get_world_size() <= 1:',
        "a Ray Train context never has fewer than one worker",
    ),
    Equivalent(
        'overlapddp/integrations/ray.py',
        'if torch.cuda.is_available() and device.type != "cpu": => if torch.cuda.is_available() and device.type > "cpu":',
        "no torch device type sorts below 'cpu' (cuda, hpu, meta, mps, xpu, ... all sort above it), so '> cpu' is '!= cpu'",
    ),
    Equivalent(
        'overlapddp/layout/selection.py',
        'if dist.get_rank(process_group) == 0: => if dist.get_rank(process_group) >= 0:',
        _RANK_ZERO,
    ),
    Equivalent(
        'overlapddp/layout/selection.py',
        'if dist.get_rank(process_group) == 0: => if dist.get_rank(process_group) <= 0:',
        _RANK_ZERO,
    ),
    Equivalent(
        'overlapddp/layout/selection.py',
        'return self._count == len(self.running) * self.iterations => return self._count >= len(self.running) * self.iterations',
        "the count never passes the phase's total: at the forward that reaches it the tuner agrees, which begins the next phase or ends the selection",
    ),
    Equivalent(
        'overlapddp/layout/selection.py',
        'return self._count == len(self.running) * self.iterations => return self._count is len(self.running) * self.iterations',
        "both sides are small ints (at most MAX_CANDIDATES x FINAL_ITERATIONS), which CPython keeps one object each of",
    ),
    Equivalent(
        'overlapddp/layout/selection.py',
        'return [[self._clock.seconds(start, [end])[0] for start, end in timed] for timed in self._timed] => return [[self._clock.seconds(start, [end])[ -1] for start, end in timed] for timed in self._timed]',
        "seconds() is given one stamp and returns one value: the first is the last",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'self._clock = clock_for(self._params[0].device) => self._clock = clock_for(self._params[ -1].device)',
        "OverlapDDP refuses a module whose parameters are on more than one device (construction.py): the last parameter's device is the first's",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'self._ended = False  # a synchronized iteration ended (or was shadowed) since the last forward => self._ended = True  # a synchronized iteration ended (or was shadowed) since the last forward',
        "never read: between_iterations resets the flag before the selection that reads it exists",
    ),

    Equivalent(
        'overlapddp/layout/tuner.py',
        'work = [end - start for start, end in zip(starts, ends, strict=True)] => work = [end - start for start, end in zip(starts, ends, strict=False)]',
        "starts and ends are read from the same finalize list, one each: equal lengths",
    ),

    Equivalent(
        'overlapddp/layout/tuner.py',
        'first = min((t for t in ready if not math.isnan(t)), default=0.0) => first = min((t for t in ready if not math.isnan(t)), default= 1.0)',
        "the default is used only when every ready time is NaN, and NaN minus any first time stays NaN",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'first = min((t for t in ready if not math.isnan(t)), default=0.0) => first = min((t for t in ready if not math.isnan(t)), default= -1.0)',
        "the default is used only when every ready time is NaN, and NaN minus any first time stays NaN",
    ),

    Equivalent(
        'overlapddp/layout/tuner.py',
        'if len(layouts) == 1: => if len(layouts) <= 1:',
        "the candidates always include the layout in force (candidate_layouts): never fewer than one",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'self._finish(layouts[0], adopt) => self._finish(layouts[ -1], adopt)',
        "reached only with exactly one layout: the last is the first",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'layout = torch.zeros(2, count, dtype=torch.int64, device=device)  # [order; bucket lengths] => layout = torch.zeros( 3, count, dtype=torch.int64, device=device)  # [order; bucket lengths]',
        "a third row of zeros is broadcast with the others and never read; only the size of the broadcast changes",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'if dist.get_rank(process_group) == 0: => if dist.get_rank(process_group) >= 0:',
        _RANK_ZERO,
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'if dist.get_rank(process_group) == 0: => if dist.get_rank(process_group) <= 0:',
        _RANK_ZERO,
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'order, lengths = layout[0].tolist(), [n for n in layout[1].tolist() if n > 0] => order, lengths = layout[0].tolist(), [n for n in layout[1].tolist() if n != 0]',
        "bucket lengths are counts: never negative, so nonzero is positive",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'per_gradient = zip(*self._ready, strict=False) => per_gradient = zip(*self._ready, strict=True)',
        "every measured iteration records one ready time per parameter: equal lengths",
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'for i, seconds in zip(marked, read([cast(Stamp, stamps.ready[i]) for i in marked]), strict=True): => '
        'for i, seconds in zip(marked, read([cast(Stamp, stamps.ready[i]) for i in marked]), strict=False):',
        "the clock's seconds() returns one value per stamp it is given, one per marked gradient: equal lengths",
    ),
    *(
        Equivalent('overlapddp/layout/tuner.py', change,
                   "both lists are read from worked, one stamp per bucket, and seconds() returns one value per stamp: "
                   "the zips' lengths are equal")
        for change in (
            'read([stamps.consumed[b] for b in worked]), strict=True), strict=True)) => '
            'read([stamps.consumed[b] for b in worked]), strict=False), strict=True))',
            'read([stamps.consumed[b] for b in worked]), strict=True), strict=True)) => '
            'read([stamps.consumed[b] for b in worked]), strict=True), strict=False))',
        )
    ),
    Equivalent(
        'overlapddp/layout/tuner.py',
        'for b, start, done, seconds in zip(launches, launched, finished, work, strict=False) => '
        'for b, start, done, seconds in zip(launches, launched, finished, work, strict=True)',
        "launched, finished and work are each made from launches, one value per launch: equal lengths",
    ),
    Equivalent("overlapddp/layout/cost_model.py", "samples.append((b.nbytes, max(b.finished - start, 0.0))) => samples.append((b.nbytes, max(b.finished - start, -1.0)))", "a sample's time is only read as max(t - alpha, 0.0); alpha is the smallest host_s, a perf_counter difference (tuner.py), never negative, so a time in [-1, 0) counts 0 s either way"),
    Equivalent("overlapddp/layout/cost_model.py", "work_from = [0.0] * (count + 1)  # W: the finalize work of gradients k.. in ready order => work_from = [0.0] * (count + 2)  # W: the finalize work of gradients k.. in ready order", "the extra trailing element is never read: the loop reads k + 1 <= count and the planner reads indices below count"),
    Equivalent("overlapddp/layout/cost_model.py", 'fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 0)]] => fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 1, 0)]]', _EMPTY_PREFIX),
    Equivalent("overlapddp/layout/cost_model.py", 'fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 0)]] => fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), -1, 0)]]', _EMPTY_PREFIX),
    Equivalent("overlapddp/layout/cost_model.py", 'fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 0)]] => fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 1)]]', _EMPTY_PREFIX),
    Equivalent("overlapddp/layout/cost_model.py", 'fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, 0)]] => fronts: list[list[tuple[float, float, int, int]]] = [[(float("-inf"), float("-inf"), 0, -1)]]', _EMPTY_PREFIX),
    Equivalent("overlapddp/layout/cost_model.py", "backward_end = max(ready_s, default=0.0) => backward_end = max(ready_s, default= 1.0)", _NO_PARAMETERS),
    Equivalent("overlapddp/layout/cost_model.py", "backward_end = max(ready_s, default=0.0) => backward_end = max(ready_s, default= -1.0)", _NO_PARAMETERS),
    Equivalent("overlapddp/layout/cost_model.py", "while end > 0: => while end != 0:", "end starts at count >= 0 and each step sets it to a bucket's first gradient, 0 <= first < end: it reaches exactly 0, never below"),
    Equivalent("overlapddp/layout/cost_model.py", "if len(front) <= FRONT_LIMIT: => if len(front) < FRONT_LIMIT:", "at exactly FRONT_LIMIT entries the spread picks front[round(k * last / last)] = front[k] for every k: the same list"),
    Equivalent(
        "overlapddp/bucket/reduction.py",
        "self._divide_by: float | None = 1 => self._divide_by: float | None = 2",
        "never read: gradients are copied in only after a synchronized forward, whose arm() sets it first",
    ),
    Equivalent(
        "overlapddp/bucket/reduction.py",
        "chained = bucket.index() > 0 and not is_unchained(hook) => chained = bucket.index() != 0 and not is_unchained(hook)",
        "a bucket's index is its position in the layout: never negative, so nonzero is positive",
    ),
    Equivalent(
        "overlapddp/bucket/reduction.py",
        "return int(work.result()[0].item()) => return int(work.result()[ -1].item())",
        "an all_reduce of one tensor completes its work with a list of exactly that tensor",
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "param = params[0] => param = params[ -1]",
        _ONE_SPARSE_PARAMETER,
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "grad = grads[0] => grad = grads[ -1]",
        _ONE_SPARSE_PARAMETER,
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "if self.params[0].grad is self.buffer: => if self.params[ -1].grad is self.buffer:",
        _ONE_SPARSE_PARAMETER,
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "self.params[0].grad = None => self.params[ -1].grad = None",
        _ONE_SPARSE_PARAMETER,
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "if not write[0] or result is self.buffer: => if not write[ -1] or result is self.buffer:",
        _ONE_SPARSE_PARAMETER,
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "check_invariants=True, => check_invariants=False,",
        "the placeholder has no indices and no values, so it satisfies every invariant: the check only checks",
    ),
    Equivalent(
        "overlapddp/bucket/sparse_storage.py",
        "if grad.layout != torch.sparse_coo: => if grad.layout is not torch.sparse_coo:",
        "torch layouts are singletons that compare by identity, so '!=' and 'is not' agree",
    ),
    Equivalent(
        "overlapddp/torch_compat.py",
        "return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1 => "
        "return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() > -1",
        "a graph task id is -1 outside a backward and a count from 0 inside one: never below -1",
    ),
    Equivalent(
        "overlapddp/torch_compat.py",
        "return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1 => "
        "return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() is not -1",
        "CPython keeps one object for each int from -5 to 256, so the id -1 is always the cached -1: 'is not' "
        "and '!=' agree",
    ),

    Equivalent(
        "overlapddp/module_sync.py",
        "if chunks[-1] and size + nbytes > BROADCAST_BUCKET_BYTES: => if chunks[- 0] and size + nbytes > BROADCAST_BUCKET_BYTES:",  # noqa: E501 (the line as cosmic-ray changes it)
        "chunks[-1] is empty only before the first tensor, when the one chunk is also chunks[0]; a chunk "
        "appended later gets its tensor at once",
    ),
    Equivalent(
        "overlapddp/module_sync.py",
        "foreach_copy_(chunk, [piece.view_as(t) for piece, t in zip(pieces, chunk, strict=True)]) => "
        "foreach_copy_(chunk, [piece.view_as(t) for piece, t in zip(pieces, chunk, strict=False)])",
        "pieces is split by the chunk's own sizes, one piece per tensor: the lengths never differ",
    ),
    Equivalent(
        "overlapddp/bucket/pipeline.py",
        "check_nonfinite: bool = False  # in each fill (a debug option): see gradient_checks.nonfinite_error => "
        "check_nonfinite: bool = True  # in each fill (a debug option): see gradient_checks.nonfinite_error",
        "the default is never used: the reducer, which builds every SharedStages, passes check_nonfinite",
    ),
    Equivalent(
        "overlapddp/module_sync.py",
        "if chunks[-1] and size + nbytes > BROADCAST_BUCKET_BYTES: => if chunks[not 1] and size + nbytes > BROADCAST_BUCKET_BYTES:",  # noqa: E501 (the line as cosmic-ray changes it)
        "chunks[not 1] is chunks[0]; chunks[-1] is empty only before the first tensor, when it is also chunks[0]",
    ),
    Equivalent(
        "overlapddp/module_sync.py",
        "mine = [(name, tuple(p.shape), tuple(p.stride()), str(p.dtype)) for name, p in zip(names, params, strict=True)] => "
        "mine = [(name, tuple(p.shape), tuple(p.stride()), str(p.dtype)) for name, p in zip(names, params, strict=False)]",
        "the reducer names each of its parameters: its names and params lists are built together, one entry each",
    ),
    Equivalent(
        "overlapddp/module_sync.py",
        "for index, (ours, other) in enumerate(zip(reference, theirs, strict=True)): => "
        "for index, (ours, other) in enumerate(zip(reference, theirs, strict=False)):",
        "the lengths were compared on the line before, which raises when they differ",
    ),
    Equivalent(
        "overlapddp/module_sync.py",
        "everyone = gather_objects(mine, process_group, params[0].device) => "
        "everyone = gather_objects(mine, process_group, params[ -1].device)",
        "construction refuses a module whose parameters are on several devices: the first one's device is the last one's",
    ),


    *(
        Equivalent("overlapddp/layout/lifecycle.py", f"{line} => {line.replace(' is not ', ' != ').replace(' is ', ' == ')}",
                   "LayoutPhase members are singletons without a custom __eq__: identity and equality agree")
        for line in (
            "if self.phase is LayoutPhase.AWAITING_REBUILD:",
            "return self.phase is not LayoutPhase.AWAITING_REBUILD",
            "if self.phase is LayoutPhase.AWAITING_REBUILD and self._options.static_graph and self._ready_order:",
        )
    ),
    Equivalent(
        "overlapddp/layout/lifecycle.py",
        "if tuner is not None and tuned is not None: => if tuner is not None or tuned is not None:",
        "_tuner_for returned (it raises otherwise) exactly when a tuned layout was given, so the tuner is set "
        "exactly when tuned is: the two conditions are always equal",
    ),
    *(
        Equivalent("overlapddp/fence.py", change,
                   "a fence records only the four bucket edges (and the backward's end, skipped before this line); "
                   "of produced, launched, completed and consumed, only the named one compares so")
        for change in (
            'if e.edge == "produced" and e.buffer in busy: => if e.edge >= "produced" and e.buffer in busy:',
            'if e.edge == "completed": => if e.edge <= "completed":',
        )
    ),
    *(
        Equivalent("overlapddp/bucket/storage.py", change,
                   "every caller passes one gradient per parameter of the storage ([p.grad for p in storage.params]), "
                   "offsets, views and alias flags are made one per parameter, and a tensor has as many strides as "
                   "sizes: the zipped "
                   "sequences always have one length")
        for change in (
            "for view, grad in zip(self.views, grads, strict=True): => for view, grad in zip(self.views, grads, strict=False):",
            "for view, grad, alias in zip(self.views, grads, aliased, strict=True) => "
            "for view, grad, alias in zip(self.views, grads, aliased, strict=False)",
            "for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]): => "
            "for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=False), key=lambda d: d[1]):",
            "for param, view in zip(self.params, self.views, strict=True): => "
            "for param, view in zip(self.params, self.views, strict=False):",
            "self.views = [strided_view(self.buffer, p, off) for p, off in zip(params, self.offsets, strict=True)] => "
            "self.views = [strided_view(self.buffer, p, off) for p, off in zip(params, self.offsets, strict=False)]",
            "foreach_div_([v for v, a in zip(self.views, aliased, strict=True) if a], alias_divide_by) => "
            "foreach_div_([v for v, a in zip(self.views, aliased, strict=False) if a], alias_divide_by)",
        )
    ),
    Equivalent(
        "overlapddp/bucket/storage.py",
        "if param.device != first.device or param.dtype != first.dtype: => "
        "if param.device != first.device or param.dtype is not first.dtype:",
        "torch dtypes are singletons (torch.float32 is the one float32 object): identity and equality agree",
    ),
    Equivalent(
        "overlapddp/bucket/storage.py",
        "return flat.narrow(0, offset, like.numel()).view(like.shape) => "
        "return flat.narrow( -1, offset, like.numel()).view(like.shape)",
        "the flat buffer is one-dimensional: dimension -1 is dimension 0",
    ),
    Equivalent(
        "overlapddp/bucket/storage.py",
        "if size == 1: => if size <= 1:",
        "it differs only for a tensor with a dimension of size 0, which has no elements: its view and its "
        "gradient are empty either way, and the gradient's strides are DDP's either way (shapes (4, 0), "
        "(0, 4) and three permuted empty ones, with and without gradient_as_bucket_view)",
    ),
    *(
        Equivalent("overlapddp/bucket/storage.py", change,
                   "the line before already asks for the view's own address: a gradient there whose storage is "
                   "not the buffer's would be a second storage over the buffer's memory, which torch's "
                   "allocator never makes (and two data_ptr() calls return distinct int objects, so 'is not' "
                   "is always true)")
        for change in (
            "and grad.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr() => "
            "and grad.untyped_storage().data_ptr() is not self.buffer.untyped_storage().data_ptr()",
            "and grad.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr() => "
            "and grad.untyped_storage().data_ptr() <= self.buffer.untyped_storage().data_ptr()",
        )
    ),
    Equivalent(
        "overlapddp/bucket/storage.py",
        "and grad.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr() => "
        "and grad.untyped_storage().data_ptr() >= self.buffer.untyped_storage().data_ptr()",
        "the line before already asks for the view's own address: a gradient there whose storage starts "
        "after the buffer's would be a second storage over the buffer's memory, which torch's allocator "
        "never makes",
    ),
    Equivalent(
        "overlapddp/fence.py",
        "if stamps is not None and bucket >= 0: => if stamps is not None and bucket >= -1:",
        "no collective is launched under key -1 (the log's backward end); the only negative launch key is the "
        "delayed all-reduce's -2, left out either way",
    ),
    Equivalent(
        "overlapddp/fence.py",
        "if e.edge == BACKWARD_END: => if e.edge <= BACKWARD_END:",
        "a fence records only 'backward end' and the four bucket edges, each of which sorts after it",
    ),
    Equivalent(
        "overlapddp/progress.py",
        "elif self.reductions < self.iteration: => elif self.reductions != self.iteration:",
        "a record never has more reductions than forwards: the reducer counts a reduction only at the end "
        "of a backward that a synchronized forward armed, one per forward",
    ),
    Equivalent(
        "overlapddp/progress.py",
        'on_host = device is None or device.type == "cpu" => on_host = device is None or device.type <= "cpu"',
        "no torch device type sorts before 'cpu' ('cuda' and every other one sorts after it)",
    ),
    Equivalent(
        "overlapddp/progress.py",
        "self._rank, self._size = 0, 1 => self._rank, self._size = -1, 1",
        DEFAULT_RANK_AND_SIZE,
    ),
    Equivalent(
        "overlapddp/testing.py",
        'elif self.stage == "completion": => elif self.stage <= "completion":',
        "the stage is one of STAGES (checked at construction); of those past the 'launch' branch only "
        "'completion' sorts at or before 'completion' ('consumption' and 'production' sort after it)",
    ),
    Equivalent(
        "overlapddp/progress.py",
        "after_reduction or p.waiting is None or p.waiting[0] != backward)) => "
        "after_reduction or p.waiting is None or p.waiting[0] < backward))",
        "a record waits in backward reductions or reductions + 1 (wait_for, behind), so with reductions "
        "< backward its waiting backward is never above backward",
    ),
    Equivalent(
        "overlapddp/progress.py",
        "self._rank, self._size = 0, 1 => self._rank, self._size = 1, 1",
        DEFAULT_RANK_AND_SIZE,
    ),
    Equivalent(
        "overlapddp/progress.py",
        "self._rank, self._size = 0, 1 => self._rank, self._size = 0, 2",
        DEFAULT_RANK_AND_SIZE,
    ),
    Equivalent(
        "overlapddp/progress.py",
        "self._rank, self._size = 0, 1 => self._rank, self._size = 0, 0",
        DEFAULT_RANK_AND_SIZE,
    ),
    Equivalent(
        "overlapddp/testing.py",
        'if self.stage == "production": => if self.stage >= "production":',
        "the stage is one of STAGES (checked at construction), and no other sorts after 'production'",
    ),
    Equivalent(
        "overlapddp/testing.py",
        "g.copy_(flat.narrow(0, offset, g.numel()).view_as(g)) => g.copy_(flat.narrow( -1, offset, g.numel()).view_as(g))",
        "flat is 1-D (a torch.cat of reshape(-1) pieces): its dim -1 is dim 0",
    ),
    Equivalent(
        "overlapddp/testing.py",
        'khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 2_000_000) => '
        'khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 1999999)',
        "the default goes through max(khz, 2_000_000) on the next line, which lifts 1999999 to 2_000_000",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "if self._reducer.reductions == self._stepped_at: => if self._reducer.reductions <= self._stepped_at:",
        "the reducer's count only grows and _stepped_at is set from it, so it is never above the count",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "changed = [i for i, (grad, version) in enumerate(self._versions) if grad._version != version] => "
        "changed = [i for i, (grad, version) in enumerate(self._versions) if grad._version > version]",
        "a tensor's version counter only grows, so a version that differs is a larger one",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "first_device = norms[0].device => first_device = norms[ -1].device",
        "mixed device types are refused at construction: every norm is on devices of one type, where the "
        "stacked norm is the same kernel on any of them",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "for p, norm in zip(grads, foreach_norm([p.grad for p in grads], self.norm_type), strict=True): => "
        "for p, norm in zip(grads, foreach_norm([p.grad for p in grads], self.norm_type), strict=False):",
        "foreach_norm returns one norm per tensor it is given: the lengths are equal",
    ),

    Equivalent(
        "overlapddp/optim/overlap.py",
        "if self._reducer.reductions == self._stepped_at: => if self._reducer.reductions is self._stepped_at:",
        STEPPED_AT_ALIASES,
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "self._taking = False  # a bucket of the current backward was taken => "
        "self._taking = True  # a bucket of the current backward was taken",
        "it only skips the first backward's check of an owed step(), and nothing is owed then: _used is None until "
        "all_taken sets it, and all_taken sets _taking back to False first",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "self._taking = True => self._taking = False",
        "every bucket then checks for an owed step(), not only a backward's first: the first check leaves _used None "
        "(it was None, or it is cleared as it raises) and only all_taken sets it again, so the later checks do nothing",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "if scaler is not None and scaler is not ours: => if scaler is not None and scaler != ours:",
        "GradScaler defines no __eq__: != compares identity, as is not does",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        "if frame.f_code is _SCALER_STEP: => if frame.f_code == _SCALER_STEP:",
        "code objects are equal only with the same name, first line, bytecode, constants and names: no other "
        "function's code on a stack equals GradScaler._maybe_opt_step's",
    ),
    Equivalent(
        "overlapddp/optim/overlap.py",
        'for key, value in group.items() if key != "params"} => for key, value in group.items() if key is not "params"}',
        "a group's \"params\" key is a literal (torch's or the user's), which CPython interns; and were it not, the "
        "snapshot would hold the group's own params list, equal to itself at step()",
    ),
    Equivalent(
        "overlapddp/construction.py",
        "sparse_names = [n for (n, _), s in zip(trainable, sparse, strict=True) if s] => "
        "sparse_names = [n for (n, _), s in zip(trainable, sparse, strict=False) if s]",
        "sparse is built from trainable one entry per parameter, the line before",
    ),

    Equivalent(
        "overlapddp/construction.py",
        'tuned_plan=args.bucket_plan == "tuned", => tuned_plan=args.bucket_plan >= "tuned",',
        "the recipe is built after bucket_plan is checked against BUCKET_PLANS, and 'ddp' sorts before 'tuned'",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'Feature.TUNED_PLAN: args.bucket_plan == "tuned", => Feature.TUNED_PLAN: args.bucket_plan >= "tuned",',
        "resolve asks the refusal table for the features only after _check_arguments checked bucket_plan against "
        "BUCKET_PLANS, and 'ddp' sorts before 'tuned'",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'single_gpu = len(devices) == 1 and next(iter(devices)).type != "cpu" => single_gpu = len(devices) <= 1 and next(iter(devices)).type != "cpu"',
        "a module with no parameter that requires grad is refused before the devices are resolved: there is always one",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'single_gpu = len(devices) == 1 and next(iter(devices)).type != "cpu" => single_gpu = len(devices) == 1 and next(iter(devices)).type > "cpu"',
        "every device type torch names other than 'cpu' (cuda, hip, xpu, mps, meta, hpu, mtia, xla, privateuseone, ...) sorts after it",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'refuse_unsupported(group, trainable[0][1].device, sparse_names) => refuse_unsupported(group, trainable[ -1][1].device, sparse_names)',
        _ONE_TRAINABLE_DEVICE,
    ),
    Equivalent(
        "overlapddp/construction.py",
        'return self.trainable[0][1].device => return self.trainable[ -1][1].device',
        _ONE_TRAINABLE_DEVICE,
    ),
    Equivalent(
        "overlapddp/construction.py",
        'if len(device_types) != 1: => if len(device_types) > 1:',
        "the module has a parameter that requires grad (checked first): there is at least one device type",
    ),
    Equivalent(
        "overlapddp/construction.py",
        "if len(where) > 1:  # one fence orders one device's streams => if len(where) != 1:  # one fence orders one device's streams",
        "the module has a parameter that requires grad (checked first): there is at least one device",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'out = ids[0] if output_device is None else output_device => out = ids[ -1] if output_device is None else output_device',
        "device_ids of more than one element are refused first: ids has one",
    ),
    Equivalent(
        "overlapddp/construction.py",
        'if (args.delay_all_reduce_named_params is None) != (args.param_to_hook_all_reduce is None): => if (args.delay_all_reduce_named_params is None) is not (args.param_to_hook_all_reduce is None):',
        "both sides are the bool singletons True and False: 'is not' and '!=' agree on them",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if TYPE_CHECKING: => if not TYPE_CHECKING:',
        "the guarded import names a type used only in annotations, which this module never evaluates (from __future__ "
        "import annotations); the reducer never imports this module, so importing it at run time opens no cycle",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'elif isinstance(saved, int) and _frames_compiled() > saved: => elif isinstance(saved, int) and _frames_compiled() is not saved:',
        "Dynamo's frame count only grows: read back unchanged it is the very object stored in its counter, and a "
        "changed count is a new, larger int",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if node.op == "placeholder": => if node.op >= "placeholder":',
        "of fx's six node ops (placeholder, get_attr, call_function, call_method, call_module, output) only "
        "'placeholder' sorts at or after 'placeholder'",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if node.op == "get_attr": => if node.op <= "get_attr":',
        "the call_* ops that sort before 'get_attr' have a function, a method name or a submodule's name as their "
        "target: none of them is an attribute of the graph module that holds a parameter, so the lookup finds no parameter",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if node.op == "get_attr": => if node.op is "get_attr":',
        "fx sets node.op from its own literals, which CPython interns: the one 'get_attr' string is this one",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if cast(object, _DDP._active_ddp_module) is not self: => if cast(object, _DDP._active_ddp_module) != self:',
        "neither a GraphSplitter nor an nn.Module defines __eq__: != is identity",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if len(pieces) <= 1: => if len(pieces) == 1:',
        "_with_outputs always ends with the piece that reaches the last node: there is at least one piece",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if buckets == self._buckets: => if buckets is self._buckets:',
        "the early return only saves work: for buckets equal to the current ones every compiled frame's cuts are "
        "recomputed equal to those it recorded, so no frame is dropped and the buckets adopted are equal",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        "_WARNED.append(True) => _WARNED.append(False)",
        "_WARNED is only read for being non-empty (the warning was given): [False] is as non-empty as [True]",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'elif _MISSING is not None or get_optimize_ddp_mode() != "ddp_optimizer": => '
        'elif _MISSING is not None or get_optimize_ddp_mode() > "ddp_optimizer":',
        "get_optimize_ddp_mode refuses any mode outside Dynamo's four (ddp_optimizer, python_reducer, "
        "python_reducer_without_compiled_forward, no_optimization), and the other three all sort after 'ddp_optimizer'",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        "if end == len(nodes) or any(u not in inside for n in nodes[start:end] for u in n.users): => "
        "if end >= len(nodes) or any(u not in inside for n in nodes[start:end] for u in n.users):",
        "the ends walked are the cuts, node positions below len(nodes), then len(nodes) itself: end never exceeds it",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if node.op == "get_attr": => if node.op >= "get_attr":',
        "placeholders returned on the line before; of the ops left, only 'output' also sorts after 'get_attr', and the "
        "output node has no users, so whatever its lookup finds records no first use",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        'if node.op == "placeholder": => if node.op is "placeholder":',
        "fx sets node.op from its own literals, which CPython interns: the one 'placeholder' string is this one",
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "self._usage = UsageMap(len(self.params), self.params[0].device) if tracks_usage else None => "
        "self._usage = UsageMap(len(self.params), self.params[ -1].device) if tracks_usage else None",
        _ONE_TRAINABLE_DEVICE,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "if self.mode is not GraphMode.OVERLAP and not self._final_now(index): => "
        "if self.mode != GraphMode.OVERLAP and not self._final_now(index):",
        "GraphMode members are singletons without a custom __eq__: identity and equality agree",
    ),
    Equivalent(
        "overlapddp/compile_split.py",
        "elif isinstance(saved, int) and _frames_compiled() > saved: => "
        "elif isinstance(saved, int) and _frames_compiled() != saved:",
        "Dynamo's frame count only grows: a count that differs from the one saved is larger",
    ),
    Equivalent(
        "overlapddp/wrapper.py",
        "replaced = dict(zip(map(id, leaves), _EndOfBackward.apply(reducer, *leaves), strict=True)) => "
        "replaced = dict(zip(map(id, leaves), _EndOfBackward.apply(reducer, *leaves), strict=False))",
        "the autograd function returns one output per tensor it is given, so the two sequences are always equally long",
    ),
    Equivalent(
        "overlapddp/integrations/torchft.py",
        "if dist.get_world_size() == 1: => if dist.get_world_size() <= 1:",
        "a process group has at least one rank",
    ),
    Equivalent(
        "overlapddp/integrations/torchft.py",
        'if given is not None and not (name == "bucket_plan" and given == "ddp"): => '
        'if given is not None and not (name is "bucket_plan" and given == "ddp"):',
        "name is a key of REFUSED, a literal of this module like the one it is compared with: CPython interns both "
        "(identifier-like constants), so they are one object",
    ),
    Equivalent(
        "overlapddp/integrations/torchft.py",
        'if given is not None and not (name == "bucket_plan" and given == "ddp"): => '
        'if given is not None and not (name <= "bucket_plan" and given == "ddp"):',
        "name is a key of REFUSED, and no other key sorts before 'bucket_plan'",
    ),
    Equivalent(
        "overlapddp/integrations/torchft.py",
        "if known is default_hooks.allreduce_hook: => if known == default_hooks.allreduce_hook:",
        "functions compare equal only to themselves",
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if self.mode is not GraphMode.STATIC: => if self.mode != GraphMode.STATIC:',
        _ENUM_MEMBERS,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if self.mode is GraphMode.LEARNING_STATIC: => if self.mode == GraphMode.LEARNING_STATIC:',
        _ENUM_MEMBERS,
    ),

    Equivalent(
        "overlapddp/reducer.py",
        'if self.state is not ReducerState.IDLE or current.in_flight(): => if self.state != ReducerState.IDLE or current.in_flight():',
        _ENUM_MEMBERS,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if self.reductions or self.state is not ReducerState.IDLE or self.layouts.changed: => '
        'if self.reductions or self.state != ReducerState.IDLE or self.layouts.changed:',
        _ENUM_MEMBERS,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if self.state is ReducerState.IDLE: => if self.state == ReducerState.IDLE:',
        _ENUM_MEMBERS,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "dropped = self.state is ReducerState.ARMED  # the previous forward's backward never came => dropped = self.state == ReducerState.ARMED  # the previous forward's backward never came",
        _ENUM_MEMBERS,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'iteration.unused = [i for i, fires in enumerate(iteration.fires) if fires == 0] => iteration.unused = [i for i, fires in enumerate(iteration.fires) if fires <= 0]',
        _FIRES,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'iteration.unused = [] if learned is None else [i for i, fires in enumerate(learned) if fires == 0] => iteration.unused = [] if learned is None else [i for i, fires in enumerate(learned) if fires <= 0]',
        _FIRES,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if expected == 0: => if expected <= 0:',
        _FIRES,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'while iteration.next_launch < len(self.pipelines) and not iteration.missing[iteration.next_launch]: => '
        'while iteration.next_launch != len(self.pipelines) and not iteration.missing[iteration.next_launch]:',
        _NEXT_LAUNCH,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "if bucket != iteration.next_launch and not self.stages.check_nonfinite: => "
        "if bucket > iteration.next_launch and not self.stages.check_nonfinite:",
        "a bucket completes once per backward (a second gradient for a member is refused before it counts), and "
        "every bucket below next_launch launched complete: the bucket completing now is never below next_launch",
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'return iteration.next_launch == len(self.pipelines) => return iteration.next_launch >= len(self.pipelines)',
        _NEXT_LAUNCH,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'if iteration.next_launch == len(self.pipelines) and self.options.searches_unused_each_forward: => if iteration.next_launch >= len(self.pipelines) and self.options.searches_unused_each_forward:',
        _NEXT_LAUNCH,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'return BucketPipeline(index, members, storage, self.stages, is_last=index == len(self.plan.buckets) - 1) => '
        'return BucketPipeline(index, members, storage, self.stages, is_last=index >= len(self.plan.buckets) - 1)',
        _BUCKET_INDEX,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'return [p.index for p in self.pipelines if missing[p.index] < len(p.members)] => '
        'return [p.index for p in self.pipelines if missing[p.index] != len(p.members)]',
        _MISSING,
    ),

    Equivalent(
        "overlapddp/reducer.py",
        'if self._sparse_gradient[members[0]]: => if self._sparse_gradient[members[ -1]]:',
        _SPARSE_ALONE,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'storage = SparseBucketStorage(index, [self.params[members[0]]], self.names[members[0]]) => storage = SparseBucketStorage(index, [self.params[members[ -1]]], self.names[members[0]])',
        _SPARSE_ALONE,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        'storage = SparseBucketStorage(index, [self.params[members[0]]], self.names[members[0]]) => storage = SparseBucketStorage(index, [self.params[members[0]]], self.names[members[ -1]])',
        _SPARSE_ALONE,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "iteration.unused_marked = True => iteration.unused_marked = False",
        "at the end of a counting backward the flag is read by no one: every parameter is counted right there and "
        "finalize replaces the iteration before another gradient can arrive",
    ),

    Equivalent(
        "overlapddp/reducer.py",
        "device = self.pipelines[0].storage.buffer.device => device = self.pipelines[ -1].storage.buffer.device",
        _ONE_BUFFER_DEVICE,
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "self._iteration.fires[index] += 1 => self._iteration.fires[index] += 2",
        "every firing adds the same step in the learning backward and in the later ones, and the counts are "
        "compared only with each other and with 0",
    ),
    Equivalent(
        "overlapddp/reducer.py",
        "if index >= 0:  # the delayed all-reduce (a negative key) renews its own buffer => "
        "if index >= -1:  # the delayed all-reduce (a negative key) renews its own buffer",
        "the keys in flight are bucket indices and the delayed all-reduce's FENCE_KEY, -2; -1 only marks the end "
        "of backward in the fence's logs",
    ),
    Equivalent(
        "overlapddp/wrapper.py",
        "target = torch.device(self.device_type, self.device_ids[0]) => "
        "target = torch.device(self.device_type, self.device_ids[ -1])",
        "construction refuses more than one device id, so the first is the last",
    ),
    Equivalent(
        "overlapddp/wrapper.py",
        "return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0 => "
        "return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) != 0",
        "a length is never negative",
    ),
    Equivalent(
        "overlapddp/wrapper.py",
        "@staticmethod => ",
        "(the autograd function's forward and backward; the ignore-list setter's removal is killed) torch calls "
        "them through the class, where a plain function takes the same arguments",
    ),

    Equivalent(
        "overlapddp/refusals.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "a Refusal is built once in the table and only read: nothing assigns to one",
    ),
    *(
        Equivalent("overlapddp/refusals.py", change,
                   "every row's pair holds one or two features (test_refusals_unit checks it): a pair of two is one of "
                   "at least two, of one is one of at most one, and a one-feature pair that holds ``adding`` is it")
        for change in (
            "applies = len(refusal.pair) == 2 and refusal.pair <= set(in_force) => "
            "applies = len(refusal.pair) >= 2 and refusal.pair <= set(in_force)",
            "elif len(refusal.pair) == 1: => elif len(refusal.pair) <= 1:",
            "applies = refusal.pair == {adding} and adding in in_force  # the same feature a second time => "
            "applies = refusal.pair >= {adding} and adding in in_force  # the same feature a second time",
            "applies = refusal.pair == {adding} and adding in in_force  # the same feature a second time => "
            "applies = refusal.pair <= {adding} and adding in in_force  # the same feature a second time",
        )
    ),
    Equivalent(
        "overlapddp/bucket/consumer.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "a ReducedBucket is made by the pipeline and only read by the consumers: nothing assigns to one",
    ),
    Equivalent(
        "overlapddp/bucket/reduction.py",
        "value = value[0] => value = value[ -1]",
        "the line runs only for a list or tuple of exactly one element, whose first is its last",
    ),
    Equivalent(
        "overlapddp/optim/takeover.py",
        "for group, params in zip(groups, everything, strict=True): => "
        "for group, params in zip(groups, everything, strict=False):",
        "(both zips of narrowed) everything is built from groups, one list per group: their lengths are equal",
    ),
    Equivalent(
        "overlapddp/clock.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "a LaunchStamps is made by BucketStamps.launch and only read by the tuner: nothing assigns to one",
    ),
    Equivalent(
        "overlapddp/attachment.py",
        "@dataclass(frozen=True) => @dataclass(frozen=False)",
        "an AttachTo or Switches is made by attach_optimizer and only read by attach: nothing assigns to or "
        "hashes one (an AttachTo holds a dict, a set and a list, so it cannot be hashed either way)",
    ),
    Equivalent(
        "overlapddp/attachment.py",
        '"allow_unsynced": switches.allow_unsynced, "scaler": switches.scaler is not None, => '
        '"allow_unsynced": switches.allow_unsynced, "scaler": switches.scaler is None,',
        "check_shardable reads a request's switches only under REFUSED_SWITCHES' names (overlap, max_grad_norm, "
        "allow_unsynced), and nothing else reads them: the 'scaler' entry is never read (a sharded step takes a scaler)",
    ),
)
