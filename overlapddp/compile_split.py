"""How a compiled backward keeps the overlap: Dynamo graphs split where OverlapDDP's buckets close.

A graph compiled by ``torch.compile`` runs its backward as one autograd node, so every gradient
becomes ready at its end and no bucket could launch earlier. Dynamo lets stock DDP avoid that
(Note [DDPOptimizer] in ``torch/_dynamo/backends/distributed.py``): while DDP's forward runs,
each frame Dynamo converts is handed to a splitting compiler that cuts the forward graph into
pieces, each compiled by the user's backend; each piece's backward is then its own autograd node,
and the gradients of its parameters become ready (and their hooks fire) when it ends.

DDP's splitter cuts by byte counts. This one cuts where the wrapper's current buckets close: a
bucket is complete once backward has passed the earliest use of each of its parameters, so the
graph is cut just before that node. When the buckets change (the rebuild after the first
iteration, a tuned re-plan) the frames compiled with other cuts are dropped and traced again.

This module owns every use of Dynamo's private API; if that API moved, it warns once and the
compiled model runs unsplit (correct, not overlapped).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
from torch import fx

from overlapddp.frames import PACKAGE, TORCH, stacklevel_outside
from overlapddp.layout.plan import DEFAULT_FIRST_BUCKET_BYTES

if TYPE_CHECKING:
    from overlapddp.reducer import Reducer

try:  # the private hooks Dynamo offers DDP (checked on torch 2.14)
    import torch._dynamo.backends.distributed as _dynamo_distributed
    from torch._C._dynamo.eval_frame import reset_code as _reset_code
    from torch._dynamo.backends.distributed import SubmodCompiler, propagate_dynamo_source, propagate_metadata
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.utils import detect_fake_mode, get_optimize_ddp_mode
    from torch.nn.parallel.distributed import DistributedDataParallel as _DDP

    _MISSING: str | None = (
        None if hasattr(_DDP, "_active_ddp_module") else "no DistributedDataParallel._active_ddp_module"
    )
    _ORIGINAL_OPTIMIZER = _dynamo_distributed.DDPOptimizer
except ImportError as error:  # pragma: no cover - depends on the torch version
    _MISSING = str(error)


@dataclass
class _CompiledGraph:
    """One graph this splitter compiled: the frame's code and, per parameter, its earliest use."""

    code: Any
    first_use: dict[int, int]
    cuts: tuple[int, ...] | None  # None: cut by DDP's splitter, by byte counts


def cut_points(first_use: dict[int, int], buckets: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Node positions (forward order) before which to cut so each bucket's graph piece ends it.

    A bucket completes when backward has passed its parameters' earliest use in this graph. The
    earliest cut of all is dropped: the piece before it is the end of backward anyway.
    """
    closes = {min(first_use[i] for i in members if i in first_use) for members in buckets
              if any(i in first_use for i in members)}
    return tuple(sorted(closes)[1:])


class GraphSplitter:
    """Splits the graphs Dynamo compiles inside one wrapper's forward at the reducer's buckets.

    Used as a context manager around the wrapped module's call. Until DDP's rebuild the graphs are
    cut as DDP's own splitter cuts them, by byte counts: the order in which that backward hands
    out gradients is what DDP rebuilds its buckets from, so both wrappers rebuild the same buckets.
    ``enabled`` is a private switch (tests and benchmarks turn splitting off to see the difference).
    """

    def __init__(self, reducer: Reducer, bucket_bytes_cap: int) -> None:
        self._reducer = reducer
        self._index = {id(p): i for i, p in enumerate(reducer.params)}
        self.bucket_bytes_cap = bucket_bytes_cap  # Dynamo reads it from the "active DDP module"
        self.enabled = True
        self._buckets: list[list[int]] | None = None  # None: cut by bytes, as DDP's splitter
        self._compiled: list[_CompiledGraph] = []
        # Per open __enter__: what it replaced (restored by __exit__), a frame count to warn by, or None.
        self._saved: list[tuple[Any, Any] | int | None] = []
        self.recompiles = 0  # frames dropped because the buckets moved their cuts (read by tests)

    # Disabled so that under torch.compile(OverlapDDP(model)) Dynamo never traces the splitter itself.
    @torch.compiler.disable
    def __enter__(self) -> None:
        if not self.enabled:
            self._saved.append(None)
        elif _MISSING is not None or get_optimize_ddp_mode() != "ddp_optimizer":
            self._saved.append(_frames_compiled())  # warn in __exit__ if Dynamo compiled anything
        else:
            follow = self._reducer.layouts.rebuilt
            self._follow([list(members) for members in self._reducer.plan.buckets] if follow else None)
            self._saved.append((_DDP._active_ddp_module, _dynamo_distributed.DDPOptimizer))
            # Dynamo's hooks for DDP, handed stand-ins: it reads only bucket_bytes_cap and calls compile_fn.
            _DDP._active_ddp_module = self  # type: ignore[assignment]
            _dynamo_distributed.DDPOptimizer = self._optimizer_for  # type: ignore[misc, assignment]

    @torch.compiler.disable
    def __exit__(self, *exc: object) -> None:
        saved = self._saved.pop()
        if isinstance(saved, tuple):
            _DDP._active_ddp_module, _dynamo_distributed.DDPOptimizer = saved  # type: ignore[misc]
        elif isinstance(saved, int) and _frames_compiled() > saved:
            _warn_unsplit()

    def _follow(self, buckets: list[list[int]] | None) -> None:
        """Adopt ``buckets``; drop compiled frames whose cuts they move (Dynamo traces them again)."""
        if buckets == self._buckets:
            return
        self._buckets = buckets
        stale = {
            id(g.code): g.code
            for g in self._compiled
            if buckets is None or cut_points(g.first_use, buckets) != g.cuts
        }
        for code in stale.values():
            _reset_code(code)
        self.recompiles += len(stale)
        self._compiled = [g for g in self._compiled if id(g.code) not in stale]

    def _optimizer_for(self, bucket_bytes_cap: int, backend_compile_fn: Callable, **kwargs: Any) -> Any:
        """Stands in for ``DDPOptimizer`` while our forward runs; stock DDP nested in it keeps its own."""
        if cast(object, _DDP._active_ddp_module) is not self:
            return _ORIGINAL_OPTIMIZER(
                bucket_bytes_cap=bucket_bytes_cap, backend_compile_fn=backend_compile_fn, **kwargs
            )
        return _SplittingCompiler(self, backend_compile_fn)

    def _record(self, code: Any, first_use: dict[int, int]) -> tuple[int, ...] | None:
        """Note a frame compiled now; its cuts (None: DDP's byte-count cuts)."""
        cuts = None if self._buckets is None else cut_points(first_use, self._buckets)
        self._compiled.append(_CompiledGraph(code, first_use, cuts))
        return cuts

    def parameter_index(self, value: Any) -> int | None:
        return self._index.get(id(value))


class _SplittingCompiler:
    """The compiler Dynamo calls for one frame: cut the graph, compile each piece with the user's backend."""

    def __init__(self, splitter: GraphSplitter, backend: Callable) -> None:
        self._splitter = splitter
        self._backend = backend

    def compile_fn(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor], **configs: Any) -> Callable:
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        position = {n: k for k, n in enumerate(nodes)}
        first_use: dict[int, int] = {}
        for node in gm.graph.nodes:
            index = self._splitter.parameter_index(_real_value(gm, node))
            uses = [position[u] for u in node.users if u in position]
            if index is not None and uses:
                first_use[index] = min(first_use.get(index, len(nodes)), min(uses))
        cuts = self._splitter._record(InstructionTranslator.current_tx().f_code, first_use)
        if cuts is None:
            cap = self._splitter.bucket_bytes_cap
            ddp = _ORIGINAL_OPTIMIZER(cap, self._backend, first_bucket_cap=min(cap, DEFAULT_FIRST_BUCKET_BYTES))
            return ddp.compile_fn(gm, example_inputs, **configs)
        pieces = _with_outputs(nodes, cuts)
        if len(pieces) <= 1:
            return self._backend(gm, example_inputs, **configs)
        piece_of: dict[fx.Node, int] = {}
        for k, (start, end) in enumerate(pieces):
            piece_of.update((nodes[p], k) for p in range(start, end))
        # No root module: typed as required, but None is what torch's own DDPOptimizer passes.
        split = fx.passes.split_module.split_module(gm, None, lambda node: piece_of[node])  # type: ignore[arg-type]
        propagate_dynamo_source(gm, split)
        propagate_metadata(gm, split)
        fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
        with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
            SubmodCompiler(split, self._backend, fake_mode, **configs).run(*example_inputs)
        split.recompile()
        return split


def _real_value(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The real tensor behind a graph input (Dynamo lifts parameters to inputs) or a ``get_attr``."""
    if node.op == "placeholder":
        grapharg = node.meta.get("grapharg")
        return None if grapharg is None else grapharg.example
    if node.op == "get_attr":
        return getattr(gm, str(node.target), None)
    return None


def _with_outputs(nodes: list[fx.Node], cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The pieces ``[start, end)`` between cuts, each merged into the next until some node of it is
    used after it (a piece must hand something on to be split off)."""
    pieces: list[tuple[int, int]] = []
    start = 0
    for end in (*cuts, len(nodes)):
        inside = set(nodes[start:end])
        if end == len(nodes) or any(u not in inside for n in nodes[start:end] for u in n.users):
            pieces.append((start, end))
            start = end
    return pieces


def in_compiled_autograd() -> bool:
    """Whether a compiled-autograd backward is running now (it never runs callbacks queued on the
    autograd engine, so the end of backward must be noticed another way)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


_WARNED: list[bool] = []


def _warn_unsplit() -> None:
    """Once: this torch lacks the hooks (or DDP optimization is off), so compiled graphs stay whole."""
    if _WARNED:
        return
    _WARNED.append(True)
    reason = _MISSING or f"torch._dynamo.config.optimize_ddp is {torch._dynamo.config.optimize_ddp!r}, not True"
    warnings.warn(
        f"OverlapDDP cannot split compiled graphs at its buckets with torch {torch.__version__} ({reason}); "
        "the compiled model is reduced correctly, but its buckets launch only at the end of its backward.",
        UserWarning,
        stacklevel=stacklevel_outside((PACKAGE, TORCH)),  # the user's forward call
    )

