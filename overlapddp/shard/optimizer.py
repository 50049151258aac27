"""Optimizer state sharded across ranks: each rank updates only its shard of each bucket, then the
updated parameters are all-gathered, and the numbers stay DDP's.

Attached with ``OverlapDDP.attach_optimizer(optimizer, shard=True)``. Per bucket and iteration:

1. *backward*: the bucket is filled exactly as for DDP (each gradient times ``1 / world_size``
   while copying), padded with zeros to a multiple of the world size (shard/layout.py), and
   reduce-scattered (SUM) in place, launched when the bucket is complete: this rank's shard is its
   slice of the bucket's buffer (over gloo, the same bits from an all-reduce: shard/collectives.py).
2. *end of backward* (the reducer's finalize, bucket by bucket as each completes): this rank's
   pieces of the parameters, views of a flat parameter shard refreshed from the parameters, are
   updated by an optimizer of the user's class with the user's hyperparameters (mirrored before
   every update, so LR schedulers act as on the user's optimizer). Its state holds only these
   pieces: 1/N of DDP's, plus padding. The updated shard's all-gather into the bucket's buffer
   (free until the next backward fills it) is launched at once.
3. *start of the next forward* (a forward pre-hook on the wrapped module; ``model.state_dict()``
   and :meth:`ShardedOptimizer.gather_parameters` too): every all-gather is completed and copied
   into the parameters, bucket by bucket in launch order.

The user's optimizer keeps no state: its ``step()`` checks that a synchronized backward updated the
shards since the last step, and its ``state_dict()`` / ``load_state_dict()`` speak the unsharded
format (consolidated with one all-gather; loaded by slicing, no collective).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from overlapddp.bucket.comm_hook import Bucket
from overlapddp.layout.plan import BucketPlan
from overlapddp.reducer import Reducer
from overlapddp.shard.checks import ELEMENTWISE_STATE
from overlapddp.shard.collectives import gather_shards, reduce_to_shard
from overlapddp.shard.layout import BucketShard, Piece, plan_shards
from overlapddp.shard.relayout import HeldShard, moved_state
from overlapddp.torch_compat import foreach_copy_

if TYPE_CHECKING:
    from torch import nn


def memory_flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in memory order (how its bucket slot holds them)."""
    return tensor.detach().as_strided((tensor.numel(),), (1,), tensor.storage_offset())


@dataclass
class _BucketShardState:
    """One bucket's tensors on this rank under the current layout."""

    shard: BucketShard
    # This rank's flat parameter shard: refreshed from the parameters and updated in finalize, read
    # by the all-gather launched right after.
    params: torch.Tensor
    pieces: list[torch.Tensor]  # views of ``params``, one per Piece: the inner optimizer's parameters
    inner: torch.optim.Optimizer | None  # None when this rank owns only padding of the bucket
    # The reducer's padded buffer of this bucket, set at launch: reduced into by the collective (this
    # rank's slice is its reduced shard, read by the update once the fence completed the bucket),
    # then gathered into by the all-gather of every rank's updated shard.
    buffer: torch.Tensor | None = None

    def reduced_pieces(self, rank: int) -> list[torch.Tensor]:
        """This rank's reduced gradient of each piece: views of its slice of the buffer."""
        shard = cast(torch.Tensor, self.buffer).narrow(0, rank * self.shard.shard_length, self.shard.shard_length)
        return [shard.narrow(0, piece.shard_offset, piece.length) for piece in self.shard.pieces]


class ShardedOptimizer:
    """Runs ``optimizer``'s update on this rank's shard of each bucket as soon as it is reduced."""

    def __init__(
        self, reducer: Reducer, module: nn.Module, optimizer: torch.optim.Optimizer, backend: str,
        max_grad_norm: float | None = None,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}.")
        self._reducer = reducer
        self.optimizer = optimizer
        # Clipping: the updates wait for the global norm, summed from every rank's pieces (see _clip).
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None  # the total norm of the last synchronized backward
        self._squares: list[torch.Tensor] = []  # per reduced bucket: the sum of squares of this rank's pieces
        self._waiting: list[int] = []  # buckets reduced, their update waiting for the norm
        self._group = reducer.process_group
        self.world_size, self.rank = self._group.size(), reducer.rank
        self._params = reducer.params
        index_of = {id(p): i for i, p in enumerate(self._params)}
        # Per reduced parameter: its optimizer group, and its index in the unsharded state dict.
        self._group_of: dict[int, int] = {}
        self._user_index: dict[int, int] = {}
        for position, (g, p) in enumerate((g, p) for g, group in enumerate(optimizer.param_groups)
                                         for p in group["params"]):
            if id(p) in index_of:
                self._group_of[index_of[id(p)]] = g
                self._user_index[index_of[id(p)]] = position
        self._elementwise = ELEMENTWISE_STATE[type(optimizer)]
        stepped = optimizer.state_dict() if optimizer.state else None
        # The layout the shards follow; rebuilt (state moved along) when the reducer's plan changes.
        self._plan: BucketPlan = reducer.plan
        self._buckets = self._build(self._plan)
        # All-gather of each updated bucket: (work, gathered flat parameters). Produced by the update
        # in finalize, waited on by gather_parameters (the next forward's pre-hook at the latest).
        self._gathers: dict[int, tuple[Any, torch.Tensor]] = {}
        # Starts one bucket's all-gather (gathered, shard) -> work; overlapddp.testing delays it.
        self.gather_start: Callable[[torch.Tensor, torch.Tensor], Any] = functools.partial(
            gather_shards, group=self._group, backend=backend
        )
        self._backend = backend  # which collectives reduce and gather a shard (shard/collectives.py)
        self._holds_state = False  # whether any shard has optimizer state (equal on every rank)
        self._stepped_at = 0  # reducer.reductions that the user's step() has acknowledged
        # Refuses before anything is rebound.
        reducer.set_sharded(self._reduce_scatter, self._bucket_reduced, self._abandoned)
        # Bound to the optimizer (an LR scheduler rebinds step's function to it), calling ours.
        optimizer.step = types.MethodType(lambda _optimizer, closure=None: self._step(closure), optimizer)  # type: ignore[method-assign]
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self.load_state_dict  # type: ignore[method-assign]
        optimizer.add_param_group = self._refuse_new_group  # type: ignore[method-assign]
        self._handles = [
            module.register_forward_pre_hook(lambda _module, _inputs: self._before_forward()),
            module.register_state_dict_pre_hook(lambda _module, _prefix, _keep_vars: self.gather_parameters()),
            # A pending all-gather would overwrite the loaded values at the next forward.
            module.register_load_state_dict_pre_hook(lambda *_: self.gather_parameters()),
        ]
        reducer.set_reduction_callbacks(None, self._all_reduced)
        if stepped is not None:  # resharded: the state it has is cut into this rank's pieces
            optimizer.state.clear()
            self.load_state_dict(stepped)

    # -- layout ---------------------------------------------------------------------------------

    def _build(self, plan: BucketPlan) -> list[_BucketShardState]:
        numels = [p.numel() for p in self._params]
        return [self._bucket_state(shard) for shard in plan_shards(plan.buckets, numels, self.world_size, self.rank)]

    def _bucket_state(self, shard: BucketShard) -> _BucketShardState:
        first = self._params[self._plan.buckets[shard.bucket][0]]
        params = torch.zeros(shard.shard_length, dtype=first.dtype, device=first.device)
        pieces = [params.narrow(0, piece.shard_offset, piece.length) for piece in shard.pieces]
        inner = None
        if pieces:
            groups = [{**_hyperparameters(group), "params": []} for group in self.optimizer.param_groups]
            for piece, view in zip(shard.pieces, pieces, strict=True):
                groups[self._group_of[piece.param]]["params"].append(view)
            inner = type(self.optimizer)(groups)  # type: ignore[call-arg]  # SGD, Adam, AdamW take groups alone
        return _BucketShardState(shard, params, pieces, inner)

    def _relayout_if_replanned(self) -> None:
        """The reducer changed its buckets (DDP's rebuild after the first iteration, a restored layout):
        move the state into the new shards (shard/relayout.py)."""
        if self._reducer.plan is self._plan:
            return
        held = [HeldShard(state.shard, self._plan.buckets[state.shard.bucket], self._entries(state))
                for state in self._buckets]
        # The old shards were last read by their all-gathers (waited by this stream) and their state
        # is read below, on this stream: they may be freed only once it has run that far.
        self._reducer.fence.keep_for_current_stream(
            [state.params for state in self._buckets]
            + [value for bucket in held for _, entry in bucket.entries for value in entry.values()
               if isinstance(value, torch.Tensor)]
        )
        self._plan = self._reducer.plan
        self._buckets = self._build(self._plan)
        if self._holds_state:
            device = self._params[0].device
            moved = moved_state(held, self.local_pieces(), self._elementwise, device, self._group, self._backend)
            self.install(self.packed_groups(), lambda piece: moved.get(piece.param), True)

    # -- the iteration ------------------------------------------------------------------------

    def _reduce_scatter(self, bucket: Bucket) -> torch.futures.Future:
        """The bucket's collective: the scaled, padded buffer summed into this rank's slice of it."""
        index = bucket.index()
        buffer = bucket.buffer()
        if self._reducer.plan is not self._plan and self._reducer.plan.buckets != self._plan.buckets:
            raise self._layout_changed()  # (identity first: the buckets are compared only after a change)
        state = self._buckets[index]
        state.buffer = buffer
        return reduce_to_shard(buffer, self.rank, self._group, self._backend)

    def _bucket_reduced(self, index: int, written: list[bool]) -> None:
        """Bucket ``index``'s shard is reduced: update this rank's pieces, then all-gather them."""
        state = self._buckets[index]
        members = self._plan.buckets[index]
        slot_of = {param: slot for slot, param in enumerate(members)}
        for piece, view, reduced in zip(state.shard.pieces, state.pieces, state.reduced_pieces(self.rank), strict=True):
            view.grad = self._piece_gradient(piece, reduced, written[slot_of[piece.param]])
        for slot, param in enumerate(members):
            if written[slot]:
                self._params[param].grad = None  # the reduced gradient lives in the shards only
        if self.max_grad_norm is None:
            self._update(index)
            return
        with torch.no_grad():  # this bucket's share of the norm, while later buckets still reduce
            grads = [view.grad for view in state.pieces if view.grad is not None]
            self._squares += [torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in grads]
        self._waiting.append(index)

    def _all_reduced(self) -> None:
        """After the last bucket: with clipping, the global norm, then every waiting update in order."""
        if self.max_grad_norm is None:
            return
        self._clip(self.max_grad_norm)
        for index in self._waiting:
            self._update(index)
        self._waiting = []

    def _abandoned(self) -> None:
        """The reducer dropped the iteration (a failed reduction): the buckets waiting for the norm and
        their shares of it go with it, so the next backward's norm and updates are its own, and their
        pieces' gradients (views of buckets the reducer may have replaced) are let go. Without
        clipping, buckets updated before the failure keep their update; their all-gathers complete at
        the next forward."""
        for index in self._waiting:
            for view in self._buckets[index].pieces:
                view.grad = None
        self._waiting, self._squares = [], []

    def _clip(self, max_norm: float) -> None:
        """Scale every piece's gradient as ``clip_grad_norm_`` would, with the norm of all gradients: the
        sum of squares of each rank's pieces (in float64), summed over ranks, its root rounded once to
        the parameters' promoted dtype (the dtype ``clip_grad_norm_`` returns the norm in)."""
        device = self._buckets[0].params.device
        no_squares = torch.zeros((), dtype=torch.float64, device=device)  # this rank has only padding
        local = torch.stack(self._squares).sum() if self._squares else no_squares
        self._squares = []
        dist.all_reduce(local, group=self._group)
        total = local.sqrt().to(functools.reduce(torch.promote_types, (state.params.dtype for state in self._buckets)))
        self.last_grad_norm = total
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [view.grad for state in self._buckets for view in state.pieces if view.grad is not None]
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient.to(grad.device))

    def _update(self, index: int) -> None:
        """Update this rank's pieces of bucket ``index`` (their gradients set), then launch its all-gather."""
        state = self._buckets[index]
        with torch.no_grad():
            if state.pieces:
                current = [_piece_of(self._params[piece.param], piece) for piece in state.shard.pieces]
                foreach_copy_(state.pieces, current)  # the parameters are the one source of truth
            if state.inner is not None:
                for inner_group, group in zip(state.inner.param_groups, self.optimizer.param_groups, strict=True):
                    inner_group.update(_hyperparameters(group))
                state.inner.step()
                self._holds_state = True
        for view in state.pieces:
            view.grad = None
        gathered = cast(torch.Tensor, state.buffer)  # its reduced values are spent: every rank's shard goes there
        self._gathers[index] = (self.gather_start(gathered, state.params), gathered)

    def _piece_gradient(self, piece: Piece, reduced: torch.Tensor, written: bool) -> torch.Tensor | None:
        """The gradient DDP's optimizer would see for this piece: the reduced one, or for a parameter no
        rank used, its untouched local ``.grad`` (None is skipped, as by the optimizer)."""
        if written:
            return reduced
        local = self._params[piece.param].grad
        if local is None:
            return None
        if local.stride() != self._params[piece.param].stride():
            local = torch.empty_like(self._params[piece.param]).copy_(local)
        return _piece_of(local, piece)

    def gather_parameters(self) -> None:
        """Complete every launched all-gather and copy the updated values into the parameters."""
        for index in sorted(self._gathers):
            work, gathered = self._gathers.pop(index)
            try:
                work.wait()  # NCCL: the current stream waits for the all-gather's end
            except Exception as error:
                raise self._gather_failed(index, error) from error
            if gathered.is_cuda:  # a buffer dropped since (a relayout, an abandoned iteration) is freed here
                gathered.record_stream(torch.cuda.current_stream(gathered.device))
            shard = self._buckets[index].shard
            members = self._plan.buckets[index]
            with torch.no_grad():
                foreach_copy_(
                    [memory_flat(self._params[i]) for i in members],
                    [gathered.narrow(0, offset, self._params[i].numel()) for i, offset in
                     zip(members, shard.offsets, strict=True)],
                )

    def _layout_changed(self) -> RuntimeError:
        """The error for a backward whose buckets are not those the shards were cut from, naming the
        first bucket that differs (the one launching may be unchanged). Both layouts hold every reduced
        parameter, so two that differ differ at an index below both lengths."""
        now, built = self._reducer.plan.buckets, self._plan.buckets
        index = next(i for i, (a, b) in enumerate(zip(now, built, strict=False)) if a != b)
        return RuntimeError(
            f"Bucket {index} on rank {self.rank} holds {self._listed(now[index])}, but the shard layout was built "
            f"for {self._listed(built[index])}: the buckets changed without a forward in between."
        )

    def _listed(self, members: Sequence[int]) -> str:
        """A bucket's parameters for an error: how many, and the first four names."""
        names = [self._reducer.names[i] for i in members]
        return f"{len(names)} parameters: " + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")

    def _gather_failed(self, index: int, error: Exception) -> RuntimeError:
        """The error for a failed all-gather: the bucket, this rank, and (from the progress records)
        the ranks behind."""
        return RuntimeError(
            f"The all-gather of the updated parameters of bucket {index} ({self._listed(self._plan.buckets[index])}) "
            f"failed on rank {self.rank}: {error}. Another rank may have died or timed out."
            f"{self._reducer.progress.behind(index, after_reduction=True)} These parameters hold their values "
            "from before the last update on this rank; the process group may no longer be usable."
        )

    @torch.compiler.disable  # under torch.compile(OverlapDDP(...)) the module's pre-hooks are traced: run eagerly
    def _before_forward(self) -> None:
        self.gather_parameters()
        self._relayout_if_replanned()

    def _refuse_new_group(self, param_group: dict[str, Any]) -> None:
        """The shards and their optimizers were cut from the groups at attach: a later group has no shard."""
        raise ValueError(
            f"add_param_group() on rank {self.rank}: a sharded optimizer's parameter groups are fixed when it is "
            "attached (every rank's shards are built from them). Create the optimizer with all its groups "
            "before attach_optimizer(optimizer, shard=True)."
        )

    def _step(self, closure: Any = None) -> None:
        """The updates ran at the end of backward: check that one did since the last step."""
        if closure is not None:
            raise NotImplementedError("A sharded optimizer cannot re-evaluate a closure.")
        if self._reducer.reductions == self._stepped_at:
            raise RuntimeError(
                f"optimizer.step() on rank {self.rank}: with shard=True the update runs during a synchronized "
                "backward, and none has run since the last step (a no_sync backward, or no backward at all)."
            )
        self._stepped_at = self._reducer.reductions

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its pieces only)."""
        return sum(
            value.numel() * value.element_size()
            for state in self._buckets if state.inner is not None
            for entry in state.inner.state.values() for value in entry.values() if isinstance(value, torch.Tensor)
        )

    # -- the unsharded format -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state in the unsharded format (what the user's optimizer would return under
        DDP), assembled from every rank's pieces: a collective, call it on every rank."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, self.local_state(), group=self._group)
        parts: dict[int, list[tuple[Piece, dict[str, Any]]]] = {}
        for rank_parts in everyone:
            for piece, entry in rank_parts:
                parts.setdefault(piece.param, []).append((piece, entry))
        packed: dict[int, dict[str, Any]] = {}
        for param, index in sorted(self._user_index.items(), key=lambda item: item[1]):
            if param in parts:
                packed[index] = self._assemble(param, parts[param])
        return {"state": packed, "param_groups": self.packed_groups()}

    def local_state(self) -> list[tuple[Piece, dict[str, Any]]]:
        """This rank's pieces that have optimizer state, each with its state entry."""
        return [held for state in self._buckets for held in self._entries(state)]

    @staticmethod
    def _entries(state: _BucketShardState) -> list[tuple[Piece, dict[str, Any]]]:
        """This rank's pieces of one bucket that have optimizer state, each with its state entry."""
        if state.inner is None:
            return []
        return [(piece, dict(entry)) for piece, view in zip(state.shard.pieces, state.pieces, strict=True)
                if (entry := state.inner.state.get(view))]

    def local_pieces(self) -> list[Piece]:
        """This rank's pieces of every bucket, in bucket order."""
        return [piece for state in self._buckets for piece in state.shard.pieces]

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group the shards are spread over (the wrapper's)."""
        return self._group

    def param_numel(self, param: int) -> int:
        """The number of elements of reduced parameter ``param`` (``Piece.param``)."""
        return self._params[param].numel()

    @property
    def elementwise_keys(self) -> frozenset[str]:
        """The state entries that hold one value per element (the rest hold one per parameter)."""
        return self._elementwise

    @property
    def param_names(self) -> list[str]:
        """The reduced parameters' names, indexed as ``Piece.param``."""
        return list(self._reducer.names)

    def packed_groups(self) -> list[dict[str, Any]]:
        """The parameter groups as ``Optimizer.state_dict()`` writes them: settings, parameter indices."""
        groups, start = [], 0
        for group in self.optimizer.param_groups:
            groups.append({**_hyperparameters(group), "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return groups

    def _assemble(self, param: int, parts: list[tuple[Piece, dict[str, Any]]]) -> dict[str, Any]:
        """One parameter's unsharded state from its pieces (per-element state stitched, the rest shared)."""
        target = self._params[param]
        covered = sum(piece.length for piece, _ in parts)
        if covered != target.numel() or any(entry.keys() != parts[0][1].keys() for _, entry in parts):
            raise RuntimeError(
                f"The optimizer state of {self._reducer.names[param]} covers {covered} of its {target.numel()} "
                "elements with differing entries across ranks; its pieces were not all updated alike."
            )
        entry: dict[str, Any] = {}
        for key, value in parts[0][1].items():
            if key in self._elementwise and isinstance(value, torch.Tensor):
                whole = torch.empty_strided(target.shape, target.stride(), dtype=value.dtype, device=value.device)
                for piece, piece_entry in parts:
                    _piece_of(whole, piece).copy_(piece_entry[key])
                entry[key] = whole
            else:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return entry

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the unsharded format (a plain optimizer's under DDP, or
        :meth:`state_dict`'s): each rank keeps the slices of its pieces. No collective."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("Expected an optimizer state dict with 'state' and 'param_groups'.")
        ours = self.optimizer.param_groups
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in ours]:
            raise ValueError(
                f"The loaded state dict has parameter groups of sizes {[len(g['params']) for g in groups]}, but "
                f"this optimizer's are {[len(g['params']) for g in ours]}."
            )
        saved_state = state_dict["state"]

        def sliced(piece: Piece) -> dict[str, Any] | None:
            entry = saved_state.get(self._user_index[piece.param])
            return {key: self._slice(key, value, piece) for key, value in entry.items()} if entry else None

        self.install(groups, sliced, bool(saved_state))

    def install(
        self, groups: list[dict[str, Any]], entry_of: Callable[[Piece], dict[str, Any] | None], any_state: bool
    ) -> None:
        """Take the settings of the saved ``groups`` and, for each of this rank's pieces, the state
        ``entry_of(piece)`` (already cut to the piece; None: no state), as ``load_state_dict`` would.
        ``any_state``: whether the saved state is not empty (the same on every rank)."""
        ours = self.optimizer.param_groups
        for group, saved in zip(ours, groups, strict=True):
            group.update(_hyperparameters(saved))
        for state in self._buckets:
            if state.inner is None:
                continue
            piece_of = {id(view): piece for piece, view in zip(state.shard.pieces, state.pieces, strict=True)}
            order = [view for group in state.inner.param_groups for view in group["params"]]
            inner_state = {}
            for position, view in enumerate(order):
                entry = entry_of(piece_of[id(view)])
                if entry:
                    inner_state[position] = entry
            packed_groups = state.inner.state_dict()["param_groups"]
            for packed, group in zip(packed_groups, ours, strict=True):
                packed.update(_hyperparameters(group))
            state.inner.load_state_dict({"state": inner_state, "param_groups": packed_groups})
        self._holds_state = any_state  # decides whether a relayout moves state (a collective): rank-independent

    def _slice(self, key: str, value: Any, piece: Piece) -> Any:
        """This piece's part of one saved state entry (per-element), or the entry itself (per-parameter)."""
        if key not in self._elementwise or not isinstance(value, torch.Tensor):
            return value.clone() if isinstance(value, torch.Tensor) else value
        target = self._params[piece.param]
        if value.shape != target.shape:
            raise ValueError(
                f"The loaded state {key!r} of {self._reducer.names[piece.param]} has shape {tuple(value.shape)}, "
                f"expected {tuple(target.shape)}."
            )
        laid_out = torch.empty_strided(target.shape, target.stride(), dtype=value.dtype, device=value.device)
        laid_out.copy_(value)
        return _piece_of(laid_out, piece).clone()


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings (lr, weight decay, foreach, ...): everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def _piece_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The elements of ``tensor`` (laid out as its parameter) that ``piece`` holds."""
    return memory_flat(tensor).narrow(0, piece.start, piece.length)
