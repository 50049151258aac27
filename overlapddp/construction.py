"""What does ``OverlapDDP(module, ...)`` resolve to? The constructor's steps: validate, resolve, synchronize.

:func:`resolve` checks every argument (each feature combination in the one refusal table,
refusals.py) and resolves DDP's arguments to what the wrapper keeps, without any collective, so that a
bad argument fails on every rank before any rank waits on another. :func:`synchronize` then runs the
init-time collectives (DDP's): the delayed parameters' broadcast, the parameter check and the
broadcast of rank 0's state. The wrapper builds its live parts from the result's recipe, the one way
its copies build them too (pickling.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from overlapddp.backend_support import refuse_unsupported
from overlapddp.delayed_reduction import check_delayed_parameters
from overlapddp.layout.plan import BucketCaps
from overlapddp.mixed_precision import MixedPrecision
from overlapddp.module_sync import broadcast_coalesced, broadcast_state, verify_same_parameters
from overlapddp.options import ReducerOptions
from overlapddp.pickling import ReducerRecipe
from overlapddp.refusals import Feature, refuse_pairs

# "ddp": DDP's exact layout (bit-equal at every world size); "tuned": the fastest of a modelled plan
# (layout/cost_model.py) and DDP's fixed layouts, by measurement (layout/selection.py).
BUCKET_PLANS = ("ddp", "tuned")
# Warnings are issued from here, two frames below the user's OverlapDDP(...) call.
_USER_FRAME = 3


@dataclass
class Arguments:
    """DDP's constructor arguments as given (and ``bucket_plan``), less the module."""

    device_ids: list[int | torch.device] | None = None
    output_device: int | torch.device | None = None
    dim: int = 0
    broadcast_buffers: bool | None = None
    init_sync: bool = True
    process_group: dist.ProcessGroup | None = None
    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    delay_all_reduce_named_params: list[tuple[str, nn.Parameter]] | None = None
    param_to_hook_all_reduce: nn.Parameter | None = None
    mixed_precision: Any | None = None
    device_mesh: Any | None = None
    skip_all_reduce_unused_params: bool = False
    bucket_cap_mb_list: list[int] | None = None
    batched_grad_copy: bool = False
    forward_sync_buffers: bool | None = None
    bucket_plan: str = "ddp"


@dataclass
class Construction:
    """What the arguments resolve to: everything the wrapper keeps and builds from."""

    process_group: dist.ProcessGroup
    ignored: set[str]  # names DDP leaves alone (the module's list, and the delayed parameters)
    trainable: list[tuple[str, torch.Tensor]]  # reduced in buckets, in module order
    delayed: list[tuple[str, torch.Tensor]]  # delay_all_reduce_named_params, checked
    buffers: list[torch.Tensor]
    device_ids: list[int] | None
    output_device: int | None
    forward_sync_buffers: bool
    init_sync_buffers: bool
    sparse_names: list[str]
    precision: MixedPrecision | None
    recipe: ReducerRecipe
    synchronized: list[torch.Tensor] = field(default_factory=list)  # parameters rank 0 broadcasts at init

    @property
    def device(self) -> torch.device:
        return self.trainable[0][1].device


def _features(args: Arguments, delayed: bool, sparse_names: list[str]) -> set[Feature]:
    """The constructor's features whose combinations the refusal table checks."""
    switched = {
        Feature.TUNED_PLAN: args.bucket_plan == "tuned",
        Feature.SPARSE_GRADIENTS: bool(sparse_names),
        Feature.UNUSED_SEARCH: _reducer_options(args).searches_unused_each_forward,
        Feature.MIXED_PRECISION: args.mixed_precision is not None,
        Feature.GRADIENT_AS_BUCKET_VIEW: args.gradient_as_bucket_view,
        Feature.DELAYED_ALL_REDUCE: delayed,
    }
    return {feature for feature, on in switched.items() if on}


def resolve(module: nn.Module, args: Arguments) -> Construction:
    """Validate and resolve every argument; no collective runs here."""
    if (args.delay_all_reduce_named_params is None) != (args.param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time.")
    precision = None if args.mixed_precision is None else MixedPrecision(args.mixed_precision)
    delayed = _delayed_parameters(module, args.delay_all_reduce_named_params, args.param_to_hook_all_reduce)
    if args.check_reduction:
        warnings.warn(
            "The `check_reduction` argument is deprecated (as in DDP) and has no effect.",
            FutureWarning,
            stacklevel=_USER_FRAME,
        )
    group = _resolve_group(args.process_group, args.device_mesh)
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    ignored |= {name for name, _ in delayed}  # as in DDP: they leave the buckets and the init sync
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module.named_parameters() if n not in ignored]
    trainable, sparse = _bucketed_parameters(module, ignored, {id(p) for _, p in delayed})
    _warn_ignored_root_parameters(module, ignored, {n for n, _ in delayed})
    if delayed and not trainable:
        raise NotImplementedError(
            "Every parameter that requires grad is in delay_all_reduce_named_params; OverlapDDP completes the "
            "delayed all-reduce at the end of its buckets' backward, so leave at least one parameter out of it."
        )
    _check_parameters(named, trainable)
    hook_name = _hook_parameter_name(module, args.param_to_hook_all_reduce) if delayed else None
    device_ids, output_device = _resolve_devices(args.device_ids, args.output_device, named)
    forward_sync, init_sync_buffers = _resolve_buffer_sync(args.broadcast_buffers, args.forward_sync_buffers)
    caps = BucketCaps.from_user(args.bucket_cap_mb, args.bucket_cap_mb_list)
    sparse_names = [n for (n, _), s in zip(trainable, sparse, strict=True) if s]
    refuse_unsupported(group, trainable[0][1].device, sparse_names)
    _check_arguments(args)
    refuse_pairs(_features(args, bool(delayed), sparse_names), sparse_names=", ".join(sparse_names))
    recipe = ReducerRecipe(
        tuple(n for n, _ in trainable), caps, tuple(sparse), _reducer_options(args),
        delayed_names=tuple(n for n, _ in delayed), hook_parameter=hook_name,
    )
    buffers = [b for n, b in module.named_buffers() if n not in ignored]
    return Construction(
        group, ignored, trainable, delayed, buffers, device_ids, output_device, forward_sync, init_sync_buffers,
        sparse_names, precision, recipe, synchronized=[p for _, p in named],
    )


def _reducer_options(args: Arguments) -> ReducerOptions:
    return ReducerOptions(
        find_unused_parameters=args.find_unused_parameters,
        static_graph=args.static_graph,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        batched_grad_copy=args.batched_grad_copy,
        skip_all_reduce_unused_params=args.skip_all_reduce_unused_params,
        tuned_plan=args.bucket_plan == "tuned",
    )


def _check_arguments(args: Arguments) -> None:
    if args.static_graph and args.find_unused_parameters:
        warnings.warn(
            "You passed find_unused_parameters=true to OverlapDDP with static_graph enabled; with a "
            "static graph unused parameters are found in the first iteration, so it is not needed.",
            UserWarning,
            stacklevel=_USER_FRAME + 1,
        )
    if args.bucket_plan not in BUCKET_PLANS:
        raise ValueError(
            f"bucket_plan must be one of {', '.join(map(repr, BUCKET_PLANS))}, got {args.bucket_plan!r}."
        )


def synchronize(construction: Construction, init_sync: bool) -> None:
    """DDP's init-time collectives: the delayed parameters from rank 0 (whatever ``init_sync`` says,
    as DDP does), then, with ``init_sync``, the parameter check and rank 0's state (buffers too
    unless ``forward_sync_buffers=False`` said otherwise)."""
    group = construction.process_group
    if construction.delayed:
        broadcast_coalesced([p.detach() for _, p in construction.delayed], 0, group)
    if init_sync:
        verify_same_parameters([n for n, _ in construction.trainable], [p for _, p in construction.trainable], group)
        buffers = construction.buffers if construction.init_sync_buffers else []
        broadcast_state(construction.synchronized, buffers, 0, group)


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
    return cast(dist.ProcessGroup, dist.group.WORLD)  # initialized, so never None


def _delayed_parameters(
    module: nn.Module, named: list[tuple[str, nn.Parameter]] | None, hook_param: nn.Parameter | None
) -> list[tuple[str, torch.Tensor]]:
    """The (name, parameter) pairs of ``delay_all_reduce_named_params``, checked against the module."""
    if named is None:
        return []
    if isinstance(named, (str, bytes)):
        raise TypeError("delay_all_reduce_named_params must be a list of (name, parameter) pairs.")
    by_name = dict(module.named_parameters())
    chosen: list[tuple[str, torch.Tensor]] = []
    for entry in named:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"delay_all_reduce_named_params must hold (name, parameter) pairs, got {entry!r}.")
        name, param = entry
        if by_name.get(name) is not param:
            raise ValueError(
                f"delay_all_reduce_named_params: {name!r} does not name that parameter in the module; pass entries "
                "of module.named_parameters()."
            )
        chosen.append((name, param))
    if not chosen:  # as in DDP, an empty list delays nothing
        return []
    check_delayed_parameters([p for _, p in chosen], [n for n, _ in chosen])
    if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad or not hook_param.is_leaf:
        raise ValueError("param_to_hook_all_reduce must be a parameter (a leaf tensor) that requires grad.")
    return chosen


def _hook_parameter_name(module: nn.Module, hook_param: nn.Parameter | None) -> str:
    """The module's name for ``param_to_hook_all_reduce`` (a copy of the wrapper finds it by name)."""
    for name, param in module.named_parameters():
        if param is hook_param:
            return name
    raise ValueError(
        "param_to_hook_all_reduce must be a parameter of the wrapped module (its gradient starts the delayed "
        "all-reduce during this module's backward); pass one of module.parameters()."
    )


def _bucketed_parameters(
    module: nn.Module, ignored: set[str], delayed: set[int]
) -> tuple[list[tuple[str, torch.Tensor]], list[bool]]:
    """The parameters DDP reduces in buckets, in its order, and DDP's ``expect_sparse_gradient`` for
    each: each module's own parameters that require grad, an alias admitted unless the name it is
    matched by is ignored, the first admission kept. So a tied weight ignored under one name is
    reduced under another (sparse if that module is an ``Embedding`` or ``EmbeddingBag`` built with
    ``sparse=True``), and a root parameter is matched as ``".w"`` (DDP's spelling), so ``"w"`` in
    the ignore list does not stop it. Delayed parameters are left out by identity: DDP, matching
    names only, would also bucket a delayed root or tied parameter it all-reduces apart."""
    admitted: dict[int, tuple[str, torch.Tensor, bool]] = {}
    for module_name, owner in module.named_modules():
        sparse = isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and bool(owner.sparse)
        for param_name, param in owner.named_parameters(recurse=False):
            matched_as = f"{module_name}.{param_name}"
            if param.requires_grad and matched_as not in ignored and id(param) not in delayed:
                admitted.setdefault(id(param), (matched_as.removeprefix("."), param, sparse))
    return [(name, param) for name, param, _ in admitted.values()], [s for _, _, s in admitted.values()]


def _warn_ignored_root_parameters(module: nn.Module, ignored: set[str], delayed: set[str]) -> None:
    """DDP silently reduces a root parameter listed to be ignored (it matches ``".w"``, not ``"w"``);
    OverlapDDP reduces it too, for DDP's numbers, but says so."""
    listed = [n for n, p in module.named_parameters(recurse=False) if n in ignored - delayed and p.requires_grad]
    if listed:
        warnings.warn(
            f"The parameters to ignore name {', '.join(listed)}, parameters of the wrapped module itself: DDP matches "
            "ignored names as '<submodule>.<parameter>', so it still reduces them (it would skip "
            f"{', '.join(repr('.' + n) for n in listed)}); OverlapDDP reduces them too, to give DDP's numbers.",
            UserWarning,
            stacklevel=_USER_FRAME + 1,  # called from resolve()
        )


def _check_parameters(named: list[tuple[str, torch.Tensor]], trainable: list[tuple[str, torch.Tensor]]) -> None:
    # A root parameter ignored by its plain name is still reduced (see _bucketed_parameters): check both lists.
    lazy = list(dict.fromkeys(n for n, p in [*named, *trainable] if isinstance(p, nn.parameter.UninitializedParameter)))
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
    where: dict[torch.device, list[str]] = {}
    for name, param in trainable:
        where.setdefault(param.device, []).append(name)
    if len(where) > 1:  # one fence orders one device's streams
        listed = "; ".join(
            f"{d}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" for d, names in where.items()
        )
        raise ValueError(
            f"OverlapDDP reduces a module that lives on one device, but its parameters are on {len(where)} "
            f"devices ({listed}). Move the module to one GPU (one process per GPU); stock "
            "torch.nn.parallel.DistributedDataParallel accepts such a module (device_ids=None) and reduces it "
            "without overlap guarantees across devices."
        )
    sparse = [n for n, p in trainable if p.is_sparse]
    if sparse:
        raise ValueError(
            f"Parameters {', '.join(sparse)} are sparse tensors; OverlapDDP, like DDP, reduces dense parameters "
            "(their gradients may be sparse: nn.Embedding(sparse=True)). Make the parameters dense."
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
            stacklevel=_USER_FRAME + 1,
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective
