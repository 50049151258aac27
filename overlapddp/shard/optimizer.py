"""How does a sharded optimizer step? Each rank updates the parameters it owns, then sends them to all.

Attached with ``OverlapDDP.attach_optimizer(optimizer, shard=True)``. Backward is DDP's: every rank
holds DDP's reduced gradients in ``param.grad``. The optimizer's ``step()`` then:

1. checks that the gradients are reduced and final (as the guard does; no collective);
2. walks one schedule that is the same on every rank, the owners taking turns: at each entry the
   owner runs the user's own optimizer over that entry's parameters alone (each
   ``param_group["params"]`` briefly lists only them), then every rank launches their broadcast
   from the owner. An owner's broadcast is thus in flight while the later updates run. An entry is
   one parameter of at least ``SMALL`` elements (broadcast in place), or several smaller ones of one
   dtype sent as one flat copy (one collective instead of many: gloo's cost is per call);
3. waits for every broadcast, so the parameters are final when ``step()`` returns.

Hyperparameters are always the user's (its groups are the ones stepped), and state exists only for
the parameters this rank owns: 1/N of DDP's, balanced by each update's cost (shard/ownership.py).
Parameters whose gradients the wrapper does not reduce are updated by every rank itself, as DDP's
optimizer does. ``state_dict()`` and ``load_state_dict()`` speak the plain optimizer's format
(shard/state.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from overlapddp.optim.takeover import narrowed, take_over_step
from overlapddp.reducer import Reducer
from overlapddp.shard.checks import ShardRequest
from overlapddp.shard.ownership import Ownership, plan_ownership, update_cost
from overlapddp.shard.state import consolidate, owned_part
from overlapddp.shard.step_record import StepRecord

# Parameters of fewer elements share one broadcast (a flat copy) with their neighbours of the schedule.
SMALL = 1 << 16


def broadcast_from(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup) -> Any:
    """Launch the broadcast of ``tensor`` from rank ``owner`` of ``group``, in place on every rank."""
    return dist.broadcast(tensor, group=group, group_src=owner, async_op=True)


class ShardedOptimizer:
    """Runs ``optimizer``'s update of each parameter on its owner only, then sends it to every rank."""

    def __init__(
        self, reducer: Reducer, optimizer: torch.optim.Optimizer, request: ShardRequest, group: dist.ProcessGroup,
        strict: bool = False, scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self._reducer = reducer
        self.optimizer = optimizer
        self.process_group = group
        self.rank, self.world_size = request.rank, request.world_size
        self.strict = strict
        # The optimizer's parameters in its state dict's order: (group index, parameter).
        self._held = [(g, p) for g, group_ in enumerate(optimizer.param_groups) for p in group_["params"]]
        self.param_names = [request.names.get(id(p), f"group {g} parameter {i} (not the model's)")
                            for i, (g, p) in enumerate(self._held)]
        sharded = [i for i, (_, p) in enumerate(self._held) if id(p) in request.reduced]
        costs = [update_cost(optimizer, optimizer.param_groups[self._held[i][0]], self._held[i][1]) for i in sharded]
        self.ownership: Ownership = plan_ownership(costs, self.world_size)
        # Per held parameter: its owner, or None where every rank updates it (its gradient is not reduced).
        self._owners: list[int | None] = [None] * len(self._held)
        for i, owner in zip(sharded, self.ownership.owners, strict=True):
            self._owners[i] = owner
        self._schedule = _interleaved(sharded, self._owners, costs, [p for _, p in self._held], self.world_size)
        self._local = [i for i, owner in enumerate(self._owners) if owner is None]
        # Where each rank is, for the error of a broadcast that fails (shard/step_record.py).
        self._record = StepRecord(group, on_host=all(p.device.type == "cpu" for _, p in self._held))
        # Launches one parameter's broadcast from its owner -> work; overlapddp.testing delays it.
        self.gather_start: Callable[[torch.Tensor, int], Any] = lambda tensor, owner: broadcast_from(
            tensor, owner, group)
        # The user's own methods, called over narrowed groups (step) or wrapped (the state dicts).
        self._plain_state_dict = optimizer.state_dict
        self._plain_load_state_dict = optimizer.load_state_dict
        self._update = take_over_step(optimizer, self.step)
        optimizer.state_dict = self.state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self.load_state_dict  # type: ignore[method-assign]
        optimizer.add_param_group = self._refuse_new_group  # type: ignore[method-assign]
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if self._scaler is not None:
            self._unguarded_unscale = self._scaler.unscale_
            self._scaler.unscale_ = self._unscale  # type: ignore[method-assign]
        for index, holder in enumerate(self._owners):  # state of a parameter another rank owns is dropped
            if holder not in (None, self.rank):
                optimizer.state.pop(self._held[index][1], None)

    # -- what is where ---------------------------------------------------------------------------

    @property
    def owners(self) -> dict[str, int | None]:
        """Which rank updates each parameter, by name (None: every rank, its gradient is not reduced)."""
        return dict(zip(self.param_names, self._owners, strict=True))

    @property
    def loads(self) -> tuple[float, ...]:
        """Each rank's estimated update cost (Newton-Schulz FLOPs for Muon, elements otherwise)."""
        return self.ownership.loads

    def owner_of(self, index: int) -> int | None:
        """The owner of the optimizer's ``index``-th parameter (its state dict's index)."""
        return self._owners[index]

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank."""
        return sum(v.numel() * v.element_size() for entry in self.optimizer.state.values()
                   for v in entry.values() if isinstance(v, torch.Tensor))

    # -- the step -------------------------------------------------------------------------------

    def step(self, closure: Any = None, **kwargs: Any) -> None:
        """Update the owned parameters and send each to every rank; return when all have arrived."""
        if closure is not None:
            raise ValueError(
                f"{type(self.optimizer).__name__}.step(closure) cannot be sharded: a closure re-evaluates the loss "
                "on every rank, but each rank updates only its own parameters. Call the closure before step()."
            )
        self._check("optimizer.step()")
        if self._record.entered == 0:
            self._agree()
        self._record.enter()
        launched: list[tuple[list[int], int, torch.Tensor | None, Any]] = []
        for indices, owner in self._schedule:
            if owner == self.rank:
                self._update_only(indices, kwargs)
            params = [self._held[i][1].detach() for i in indices]
            if not any(p.numel() for p in params):
                continue
            # One parameter is sent in place; several as one flat copy, unpacked once it arrived.
            flat = _packed(params, owner == self.rank) if len(params) > 1 else None
            launched.append((indices, owner, flat, self.gather_start(params[0] if flat is None else flat, owner)))
        if self._local:
            self._update_only(self._local, kwargs)
        self._wait(launched)

    def _update_only(self, indices: list[int], kwargs: dict[str, Any]) -> None:
        """The user's step over these parameters alone (its groups briefly list only them)."""
        with narrowed(self.optimizer.param_groups, {id(self._held[i][1]) for i in indices}):
            self._update(**kwargs)

    def _wait(self, launched: list[tuple[list[int], int, torch.Tensor | None, Any]]) -> None:
        """Complete every broadcast (unpacking a flat one); a failed one names its parameters and owner."""
        for indices, owner, flat, work in launched:
            try:
                work.wait()
            except Exception as error:
                names = ", ".join(self.param_names[i] for i in indices[:3]) + (", ..." if len(indices) > 3 else "")
                raise RuntimeError(
                    f"The broadcast of {names} from its owner, rank {owner}, failed "
                    f"on rank {self.rank} in step() ({error}). Where the ranks are: {self._record.others()}. A rank "
                    "that died or lags is one not in this step, or one whose broadcasts failed on every other rank. "
                    "The parameters may now differ between ranks: resume from a checkpoint."
                ) from error
            if flat is not None and owner != self.rank:
                _unpack(flat, [self._held[i][1].detach() for i in indices])

    def _check(self, action: str) -> None:
        """Raise unless DDP's reduced gradients are all in ``param.grad`` (no collective)."""
        busy = self._reducer.unfinished_buckets()
        if busy:
            raise RuntimeError(
                f"{action} was called while buckets {busy} of the current backward are still being reduced on rank "
                f"{self.rank}; their gradients are not final until loss.backward() returns."
            )
        if self._reducer.local_gradients_since_reduction:
            raise RuntimeError(
                f"{action} would read gradients accumulated under no_sync() on rank {self.rank} that were never "
                "reduced: with shard=True each owner would send its local update to every rank. Run the last "
                "micro-batch's backward outside no_sync()."
            )
        gradients = [p.grad for _, p in self._held if p.grad is not None]
        self._reducer.fence.make_visible(strict=self.strict, gradients=gradients)

    def _agree(self) -> None:
        """Before the first step's broadcasts: every rank must have planned the same owners for the
        same parameters, or the broadcasts would pair wrongly (one gather of the plans, once)."""
        mine = [(name, tuple(p.shape), owner) for name, (_, p), owner in zip(self.param_names, self._held, self._owners,
                                                                              strict=True)]
        plans: list[Any] = [None] * self.process_group.size()
        dist.all_gather_object(plans, mine, group=self.process_group)
        differ = [rank for rank, plan in enumerate(plans) if plan != mine]
        if differ:
            raise ValueError(
                f"The sharded {type(self.optimizer).__name__} differs between ranks {differ} and rank {self.rank}: "
                f"{_first_difference(mine, plans[differ[0]], self.rank, differ[0])}. Build the optimizer with the same "
                "parameters and groups, in the same order, on every rank."
            )

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.optimizer:
            self._check("GradScaler.unscale_()")
        self._unguarded_unscale(optimizer)

    def _refuse_new_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            f"{type(self.optimizer).__name__}.add_param_group() after attach_optimizer(..., shard=True): the owners "
            "were planned from the groups at attach. Create the optimizer with all its groups, then attach it."
        )

    # -- the state, in the plain optimizer's format ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state dict the same optimizer returns under DDP, gathered from the owners (a collective)."""
        devices = [p.device for _, p in self._held]
        return consolidate(self._plain_state_dict(), self._owners, devices, self.rank, self.process_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the plain format (DDP's optimizer's, or ``state_dict()``'s): each rank keeps its owned entries."""
        self._plain_load_state_dict(owned_part(state_dict, self._owners, self.rank))

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state dict: entries for the parameters it owns and those every rank updates."""
        return self._plain_state_dict()

    def parameters(self) -> list[torch.Tensor]:
        """The optimizer's parameters, in its state dict's order."""
        return [p for _, p in self._held]


def _first_difference(mine: list[Any], theirs: list[Any], rank: int, other: int) -> str:
    """Where two ranks' plans (name, shape, owner per parameter) first part."""
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return f"parameter {index} is (name, shape, owner) {a} on rank {rank}, {b} on rank {other}"
    return f"rank {rank} holds {len(mine)} parameters, rank {other} {len(theirs)}"


def _interleaved(sharded: list[int], owners: list[int | None], costs: list[float], params: list[torch.Tensor],
                 world_size: int) -> list[tuple[list[int], int]]:
    """The order every rank walks: each rank's entries (see ``_entries``) taken in turns, its most
    expensive parameters first, so each owner's broadcasts overlap the others' later updates and the
    last ones are small. Parameters of 0 elements are updated with their neighbours, never sent."""
    cost_of = dict(zip(sharded, costs, strict=True))
    queues = [_entries(sorted((i for i in sharded if owners[i] == r), key=lambda i: (-cost_of[i], i)), params)
              for r in range(world_size)]
    order: list[tuple[list[int], int]] = []
    for turn in range(max((len(q) for q in queues), default=0)):
        order.extend((q[turn], rank) for rank, q in enumerate(queues) if turn < len(q))
    return order


def _entries(indices: list[int], params: list[torch.Tensor]) -> list[list[int]]:
    """One rank's parameters, in order, cut into entries: a parameter of ``SMALL`` elements or more
    alone; smaller ones of one dtype and device together until the entry holds ``SMALL`` elements."""
    entries: list[list[int]] = []
    open_entry: list[int] = []
    for index in indices:
        param = params[index]
        if param.numel() >= SMALL:
            entries.append([index])
            continue
        if open_entry and (params[open_entry[0]].dtype, params[open_entry[0]].device) != (param.dtype, param.device):
            entries.append(open_entry)
            open_entry = []
        open_entry.append(index)
        if sum(params[i].numel() for i in open_entry) >= SMALL:
            entries.append(open_entry)
            open_entry = []
    if open_entry:
        entries.append(open_entry)
    return entries


def _packed(params: list[torch.Tensor], mine: bool) -> torch.Tensor:
    """The flat buffer several parameters travel in: filled with them on their owner, empty elsewhere."""
    if mine:
        return torch.cat([p.reshape(-1) for p in params])
    return torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)


def _unpack(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy the arrived flat buffer into its parameters (each in its own memory layout)."""
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
