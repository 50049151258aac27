"""Which bucket layout is in force, and when does it change? Initial, DDP's one rebuild, tuning, final.

DDP builds its buckets in reverse parameter order and rebuilds them once from rank 0's
gradient-ready order, at the forward after the first synchronized backward (the second with a static
graph; never when it searches unused parameters on a dynamic graph), then keeps them. With
``bucket_plan="tuned"`` the tuner (``layout/``) then measures, models and selects among layouts for a
few iterations before the layout is final. A checkpoint's layout (``bucket_state``) can be restored
instead. The reducer asks this object one question per step and installs the layout it answers. The
tuner is made and driven only here; it observes a measured iteration through the stamps the fence
takes (``BucketStamps``, attached to the fence for that iteration), never through the reducer's calls.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from overlapddp.fence import Fence
from overlapddp.layout.plan import BucketCaps, BucketPlan, explicit_plan, initial_plan, rebuilt_plan
from overlapddp.layout.tuner import TUNING_ITERATIONS, PlanTuner
from overlapddp.module_sync import broadcast_from
from overlapddp.options import ReducerOptions


class LayoutPhase(enum.Enum):
    """Where the layout is in its lifecycle."""

    AWAITING_REBUILD = "awaiting rebuild"  # the constructor's layout; DDP's rebuild from the ready order follows
    TUNING = "tuning"  # rebuilt or restored; the tuner measures and selects among layouts between iterations
    FINAL = "final"  # no further change (also the constructor's layout when DDP never rebuilds)


class LayoutLifecycle:
    """Answers, per step, which layout the reducer installs; records what the rebuild and the tuner need."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        sparse_gradient: Sequence[bool],
        caps: BucketCaps,
        options: ReducerOptions,
    ) -> None:
        self._params = list(params)
        self._sparse_gradient = list(sparse_gradient)
        self._caps = caps
        self._options = options
        self._tuner = PlanTuner(self._params, self._sparse_gradient) if options.tuned_plan else None
        # This rank's gradient-ready order, appended to by the reducer during synchronized backwards
        # while the rebuild is awaited; broadcast from rank 0 and consumed by the rebuild.
        self._ready_order: list[int] = []
        self._rebuilt_from: list[int] = []  # rank 0's ready order the layout in force was built from
        self._stamping: Fence | None = None  # the fence taking the tuner's stamps this iteration
        self.phase = self._first_phase()

    def _first_phase(self) -> LayoutPhase:
        # DDP rebuilds once, unless it searches unused parameters each forward.
        if not self._options.searches_unused_each_forward:
            return LayoutPhase.AWAITING_REBUILD
        return self._after_rebuild()

    def _after_rebuild(self) -> LayoutPhase:
        return LayoutPhase.TUNING if self._tuner is not None and not self._tuner.done else LayoutPhase.FINAL

    def initial_plan(self) -> BucketPlan:
        """The constructor's layout: DDP's, from the parameters' reverse order."""
        return initial_plan(self._params, self._sparse_gradient, self._caps, self._options.searches_unused_each_forward)

    @property
    def changed(self) -> bool:
        """Whether the layout was ever rebuilt, restored or tuned (a static graph can no longer be enabled)."""
        return bool(self._rebuilt_from) or (self._tuner is not None and self._tuner.done)

    def enable_static_graph(self) -> None:
        """``_set_static_graph`` before anything ran: the rebuild now waits for the second backward."""
        self._options = dataclasses.replace(self._options, static_graph=True)
        self.phase = self._first_phase()

    @property
    def rebuilt(self) -> bool:
        """True once the ready-order rebuild has happened (or will never happen)."""
        return self.phase is not LayoutPhase.AWAITING_REBUILD

    @property
    def final_iteration(self) -> int:
        """The first synchronized iteration (from 0) whose buckets stay: DDP's rebuild is in force from
        iteration 1 (2 with a static graph); the tuned plan, measured and selected after it, at the
        latest this many later."""
        ddp = 2 if self._options.static_graph else 1
        return ddp + (TUNING_ITERATIONS if self._tuner is not None else 0)

    @property
    def tuned(self) -> bool:
        """Whether the layout in force is the tuned one (selected, or restored from a checkpoint)."""
        return self._tuner is not None and self._tuner.done

    def bucket_order(self) -> list[int] | None:
        """The gradient-ready order the layout was rebuilt from (None before, or without, a rebuild)."""
        return list(self._rebuilt_from) or None

    # -- the reducer's questions, one per step ------------------------------------------------

    def at_forward(
        self,
        process_group: dist.ProcessGroup,
        device: torch.device,
        in_force: BucketPlan,
        adopt: Callable[[BucketPlan], None],
    ) -> None:
        """At every grad-enabled forward (every rank): apply the one rebuild once the ready order is
        known, or let the tuner switch layouts; ``adopt`` installs a new layout."""
        if self.phase is LayoutPhase.AWAITING_REBUILD:
            if not self._ready_order:
                return
            order = torch.tensor(self._ready_order, dtype=torch.int64, device=device)
            broadcast_from(order, 0, process_group)
            self._ready_order = []
            self._rebuilt_from = order.tolist()
            self.phase = self._after_rebuild()
            adopt(rebuilt_plan(self._params, self._sparse_gradient, self._caps, self._rebuilt_from))
        elif self._tuner is not None:
            self._tuner.between_iterations(process_group, device, self._rebuilt_from, in_force, adopt)
            self.phase = self._after_rebuild()

    def start_iteration(self, fence: Fence, in_force: BucketPlan) -> Callable[[int], None] | None:
        """A synchronized backward follows: where to record each fired gradient's index while the
        rebuild is awaited (else None). While the tuner measures, ``fence`` stamps this iteration."""
        if self.phase is LayoutPhase.AWAITING_REBUILD:
            return self._ready_order.append
        if self._tuner is not None:
            fence.stamps = self._tuner.start_iteration(in_force)
            self._stamping = fence if fence.stamps is not None else None
        return None

    def _stamps_taken(self) -> None:
        """The measured iteration is over: the fence stops stamping."""
        if self._stamping is not None:
            self._stamping.stamps, self._stamping = None, None

    def iteration_reduced(self, unused: Sequence[int]) -> None:
        """Every bucket was completed (finalize); ``unused``: the parameters that never fired."""
        if self.phase is LayoutPhase.AWAITING_REBUILD and self._options.static_graph and self._ready_order:
            # DDP appends the parameters that never fired to the recorded order at finalize.
            self._ready_order += list(unused)
        self._stamps_taken()
        if self._tuner is not None:
            self._tuner.end_iteration()

    def iteration_shadowed(self) -> None:
        """A joined rank shadowed a synchronized iteration: every parameter counts as ready in order."""
        if self.phase is LayoutPhase.AWAITING_REBUILD:
            if not self._ready_order:
                self._ready_order = list(range(len(self._params)))
        elif self._tuner is not None:
            self._tuner.shadow_iteration()

    def iteration_abandoned(self) -> None:
        """The iteration failed: forget its ready order and partial timings."""
        self._ready_order = []
        self._stamps_taken()
        if self._tuner is not None:
            self._tuner.discard_iteration()

    def restore(self, order: list[int], tuned: list[list[int]] | None) -> BucketPlan:
        """A checkpoint's layout: rebuilt from ``order``, or ``tuned`` as it was selected. A refused
        one changes nothing, so the run can go on with DDP's own rebuild."""
        tuner = None if tuned is None else self._tuner_for(tuned)
        plan = rebuilt_plan(self._params, self._sparse_gradient, self._caps, order)
        self._ready_order = []
        self._rebuilt_from = list(order)
        self.phase = self._after_rebuild()
        if tuner is not None and tuned is not None:
            tuner.restored()
            self.phase = LayoutPhase.FINAL
            plan = explicit_plan(self._params, tuned)
        return plan

    def _tuner_for(self, tuned: list[list[int]]) -> PlanTuner:
        """The tuner that will run a checkpoint's tuned layout, once the layout is known to be whole."""
        if self._tuner is None:
            raise ValueError("This bucket state holds a tuned layout; construct with bucket_plan='tuned'.")
        if sorted(i for b in tuned for i in b) != list(range(len(self._params))):
            raise ValueError(f"The tuned layout must hold each of the {len(self._params)} parameters once.")
        return self._tuner
