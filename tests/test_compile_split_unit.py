"""The graph splitter's parts without a compile or a spawn: where it cuts, how pieces merge, what it
swaps into Dynamo while a forward runs and puts back after, which frames a new layout drops, and
the one warning when it cannot split (the compiled runs are in tests/test_compile.py)."""

from __future__ import annotations

import sys
import types
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch._dynamo.backends.distributed as dynamo_distributed
from torch import fx
from torch.nn.parallel.distributed import DistributedDataParallel

from overlapddp import compile_split
from overlapddp.compile_split import GraphSplitter, _CompiledGraph, _real_value, _with_outputs, cut_points


class FakeReducer:
    """What the splitter reads of a reducer: its parameters, whether it rebuilt, and its buckets."""

    def __init__(self, buckets: list[tuple[int, ...]], rebuilt: bool = True, params: int = 4) -> None:
        self.params = [torch.zeros(1) for _ in range(params)]
        self.layouts = SimpleNamespace(rebuilt=rebuilt)
        self.plan = SimpleNamespace(buckets=buckets)


def _code(name: str) -> types.CodeType:
    namespace: dict[str, Any] = {}
    exec(f"def {name}():\n    return 0\n", namespace)  # a frame's code of its own for each name
    return namespace[name].__code__


@pytest.fixture
def resets(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The frames the splitter drops (Dynamo's reset_code replaced: these codes were never compiled)."""
    dropped: list[Any] = []
    monkeypatch.setattr(compile_split, "_reset_code", dropped.append)
    return dropped


# -- where the cuts go -------------------------------------------------------------------------------


def test_a_bucket_closes_at_the_earliest_use_of_the_parameters_this_graph_holds() -> None:
    first_use = {0: 7, 1: 3, 2: 5}
    # Parameter 9 is not in this graph: its bucket closes at its other members' earliest use.
    assert cut_points(first_use, [[9, 0], [2, 1]]) == (7,)
    assert cut_points(first_use, [[0], [2], [1]]) == (5, 7), "sorted, the earliest cut dropped"


def test_buckets_closing_at_the_same_node_give_one_cut() -> None:
    first_use = {0: 1, 1: 6, 2: 6, 3: 9}
    assert cut_points(first_use, [[3], [1], [2], [0]]) == (6, 9)


def test_a_graph_holding_one_bucket_or_none_is_not_cut() -> None:
    assert cut_points({0: 2, 1: 4}, [[0, 1], [5]]) == ()
    assert cut_points({}, [[0], [1]]) == ()


def _nodes(function: Any) -> list[fx.Node]:
    graph = fx.symbolic_trace(function).graph
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def _chain(x: torch.Tensor) -> torch.Tensor:
    a = x + 1
    b = a * 2
    return b - 3


def _dead_end(x: torch.Tensor) -> torch.Tensor:
    x + 1  # noqa: B018  # traced, used by nothing
    return x * 2


def test_pieces_run_between_the_cuts_when_each_hands_a_value_on() -> None:
    nodes = _nodes(_chain)
    assert len(nodes) == 3
    assert _with_outputs(nodes, (1, 2)) == [(0, 1), (1, 2), (2, 3)]
    assert _with_outputs(nodes, (2,)) == [(0, 2), (2, 3)]
    assert _with_outputs(nodes, ()) == [(0, 3)]


def test_a_piece_that_hands_nothing_on_is_merged_into_the_next() -> None:
    nodes = _nodes(_dead_end)
    assert len(nodes) == 2
    assert _with_outputs(nodes, (1,)) == [(0, 2)]


# -- what a forward swaps into Dynamo ------------------------------------------------------------------


def test_a_forward_hands_dynamo_the_splitter_and_puts_dynamos_own_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", True)
    active, optimizer = DistributedDataParallel._active_ddp_module, dynamo_distributed.DDPOptimizer
    splitter = GraphSplitter(FakeReducer([(1, 0), (3, 2)]), bucket_bytes_cap=1234)  # type: ignore[arg-type]
    with splitter:
        assert DistributedDataParallel._active_ddp_module is splitter
        assert dynamo_distributed.DDPOptimizer == splitter._optimizer_for
        with splitter:  # a nested call (a module that calls itself) restores only what it replaced
            assert DistributedDataParallel._active_ddp_module is splitter
        assert DistributedDataParallel._active_ddp_module is splitter
        assert dynamo_distributed.DDPOptimizer == splitter._optimizer_for
    assert DistributedDataParallel._active_ddp_module is active and dynamo_distributed.DDPOptimizer is optimizer
    assert splitter._saved == []


@pytest.mark.parametrize("rebuilt", [False, True])
def test_before_the_rebuild_the_cuts_are_ddps_and_after_it_the_buckets(monkeypatch: pytest.MonkeyPatch, rebuilt: bool) -> None:
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", True)
    splitter = GraphSplitter(FakeReducer([(1, 0), (3, 2)], rebuilt=rebuilt), bucket_bytes_cap=1)  # type: ignore[arg-type]
    splitter._buckets = [[0]]  # an earlier layout: each forward adopts the current one, or DDP's byte cuts
    with splitter:
        assert splitter._buckets == ([[1, 0], [3, 2]] if rebuilt else None)


def test_a_disabled_splitter_swaps_nothing_and_never_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_split, "_WARNED", [])
    frames = iter([0, 5])
    monkeypatch.setattr(compile_split, "_frames_compiled", lambda: next(frames))
    active = DistributedDataParallel._active_ddp_module
    splitter = GraphSplitter(FakeReducer([(0,)]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    splitter.enabled = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with splitter:
            assert DistributedDataParallel._active_ddp_module is active
    assert splitter._saved == []


@pytest.mark.parametrize("missing", [None, "no DistributedDataParallel._active_ddp_module"])
def test_without_the_hooks_a_compiled_forward_warns_once_naming_why(monkeypatch: pytest.MonkeyPatch, missing: str | None) -> None:
    monkeypatch.setattr(compile_split, "_WARNED", [])
    monkeypatch.setattr(compile_split, "_MISSING", missing)
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", missing is not None)  # off, or hooks missing
    counts = {"frames": 3}
    monkeypatch.setattr(compile_split, "_frames_compiled", lambda: counts["frames"])
    active = DistributedDataParallel._active_ddp_module
    splitter = GraphSplitter(FakeReducer([(0,)]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with splitter:  # nothing compiled inside: no warning
            assert DistributedDataParallel._active_ddp_module is active
    reason = missing or "torch._dynamo.config.optimize_ddp is False, not True"
    with pytest.warns(UserWarning, match=rf"cannot split compiled graphs at its buckets with torch .* \({reason}\)") as caught:
        with splitter:
            counts["frames"] += 1
    assert [w.filename for w in caught] == [__file__]  # past torch's disable wrapper: the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with splitter:
            counts["frames"] += 1  # once per process
    assert splitter._saved == []


# -- which frames a new layout drops ---------------------------------------------------------------------


def test_a_new_layout_drops_each_frame_whose_cuts_it_moves_once(resets: list[Any]) -> None:
    splitter = GraphSplitter(FakeReducer([]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    moved, kept = _code("moved"), _code("kept")
    splitter._follow([[0], [1]])
    assert splitter._record(moved, {0: 4, 1: 2}) == (4,)
    assert splitter._record(moved, {0: 1, 1: 8}) == (8,)  # the same frame, another graph of it
    assert splitter._record(kept, {0: 3}) == ()
    splitter._follow([[0], [1]])  # the same buckets: nothing dropped
    assert resets == [] and splitter.recompiles == 0
    splitter._follow([[1, 0]])
    assert resets == [moved] and splitter.recompiles == 1
    assert [g.code for g in splitter._compiled] == [kept]
    splitter._follow(None)
    assert resets == [moved, kept] and splitter.recompiles == 2, "counted over every layout change"


def test_a_frame_whose_cuts_a_new_layout_keeps_is_not_traced_again(resets: list[Any]) -> None:
    """Its cuts recomputed equal the recorded ones (a new tuple, equal by value): the frame stays."""
    splitter = GraphSplitter(FakeReducer([]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    code = _code("kept")
    splitter._follow([[0], [1]])
    assert splitter._record(code, {0: 4, 1: 2}) == (4,)
    splitter._follow([[2], [0], [1]])  # another bucket, of a parameter this frame does not use
    assert resets == [] and splitter.recompiles == 0 and [g.code for g in splitter._compiled] == [code]


def test_going_back_to_ddps_byte_cuts_drops_every_frame(resets: list[Any]) -> None:
    splitter = GraphSplitter(FakeReducer([]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    first, second = _code("first"), _code("second")
    splitter._follow([[0]])
    splitter._record(first, {0: 1})
    splitter._record(second, {0: 1})
    splitter._follow(None)
    assert resets == [first, second] and splitter.recompiles == 2 and splitter._compiled == []


def test_a_frame_compiled_before_the_rebuild_has_no_cuts_of_its_own(resets: list[Any]) -> None:
    splitter = GraphSplitter(FakeReducer([]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    code = _code("early")
    assert splitter._record(code, {0: 1, 1: 5}) is None
    assert splitter._compiled == [_CompiledGraph(code, {0: 1, 1: 5}, None)]
    splitter._follow([[0], [1]])  # its byte-count cuts are not the buckets': traced again
    assert resets == [code] and splitter.recompiles == 1


def test_parameters_are_known_by_identity() -> None:
    reducer = FakeReducer([], params=3)
    splitter = GraphSplitter(reducer, bucket_bytes_cap=1)  # type: ignore[arg-type]
    assert [splitter.parameter_index(p) for p in reducer.params] == [0, 1, 2]
    assert splitter.parameter_index(torch.zeros(1)) is None and splitter.parameter_index(None) is None


# -- the compiler Dynamo is handed ---------------------------------------------------------------------


def test_a_nested_stock_ddp_gets_dynamos_own_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(compile_split, "_ORIGINAL_OPTIMIZER", lambda **kwargs: made.append(kwargs) or "dynamo's")
    splitter = GraphSplitter(FakeReducer([]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    backend = object()
    monkeypatch.setattr(DistributedDataParallel, "_active_ddp_module", splitter)
    ours = splitter._optimizer_for(99, backend, first_bucket_cap=5)
    assert isinstance(ours, compile_split._SplittingCompiler) and made == []
    assert ours._splitter is splitter and ours._backend is backend
    monkeypatch.setattr(DistributedDataParallel, "_active_ddp_module", object())
    assert splitter._optimizer_for(99, backend, first_bucket_cap=5) == "dynamo's"
    assert made == [{"bucket_bytes_cap": 99, "backend_compile_fn": backend, "first_bucket_cap": 5}]


def test_a_graph_input_is_read_back_as_the_tensor_it_stands_for() -> None:
    weight = torch.ones(2)
    gm = fx.symbolic_trace(lambda x: x + 1)
    graph = fx.Graph()
    lifted = graph.placeholder("lifted")
    lifted.meta["grapharg"] = SimpleNamespace(example=weight)
    plain = graph.placeholder("plain")
    gm.held = weight
    held = graph.get_attr("held")
    gone = graph.get_attr("gone")
    added = graph.call_function(torch.add, (lifted, plain))
    assert _real_value(gm, lifted) is weight
    assert _real_value(gm, plain) is None
    assert _real_value(gm, held) is weight
    assert _real_value(gm, gone) is None
    assert _real_value(gm, added) is None


def test_compiled_autograd_is_seen_only_while_its_region_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "torch._dynamo.compiled_autograd"
    for region in (False, True):
        monkeypatch.setitem(sys.modules, name, SimpleNamespace(in_compiled_autograd_region=region))
        assert compile_split.in_compiled_autograd() is region
    monkeypatch.setitem(sys.modules, name, SimpleNamespace())
    assert compile_split.in_compiled_autograd() is False
    monkeypatch.delitem(sys.modules, name)
    assert compile_split.in_compiled_autograd() is False


def test_the_last_piece_is_kept_in_a_graph_past_the_small_int_cache() -> None:
    class Unused:
        users: dict[Any, None] = {}

    nodes = [Unused() for _ in range(300)]  # nothing is used: one piece, to the end
    assert _with_outputs(nodes, (100,)) == [(0, 300)]  # type: ignore[arg-type]


def test_the_ddp_optimizer_mode_is_read_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", "".join(["ddp_", "optimizer"]))  # built at run time
    splitter = GraphSplitter(FakeReducer([(0,)]), bucket_bytes_cap=1)  # type: ignore[arg-type]
    with splitter:
        assert DistributedDataParallel._active_ddp_module is splitter


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(2))
        self.b = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a).tanh() * self.b


def _compile(monkeypatch: pytest.MonkeyPatch, gm: fx.GraphModule, params: list[torch.Tensor],
             buckets: list[list[int]], inputs: list[torch.Tensor] | None = None,
             fake_modes: list[Any] | None = None) -> list[fx.GraphModule]:
    """Run the splitting compiler on ``gm`` with the given buckets; the graphs the backend was given
    (Dynamo's piece compiler stands in as one backend call per piece: fx traces carry no Dynamo sources)."""
    monkeypatch.setattr(compile_split, "InstructionTranslator",
                        SimpleNamespace(current_tx=lambda: SimpleNamespace(f_code=_code("frame"))))
    monkeypatch.setattr(compile_split, "propagate_dynamo_source", lambda gm, split: None)
    monkeypatch.setattr(compile_split, "propagate_metadata", lambda gm, split: None)

    class EachPiece:
        def __init__(self, split: fx.GraphModule, backend: Any, fake_mode: Any, **configs: Any) -> None:
            self.split, self.backend = split, backend
            if fake_modes is not None:
                fake_modes.append(fake_mode)

        def run(self, *inputs: torch.Tensor) -> None:
            for piece in self.split.children():
                self.backend(piece, list(inputs))

    monkeypatch.setattr(compile_split, "SubmodCompiler", EachPiece)
    reducer = FakeReducer([])
    reducer.params = params
    splitter = GraphSplitter(reducer, bucket_bytes_cap=1)  # type: ignore[arg-type]
    splitter._follow(buckets)
    compiled: list[fx.GraphModule] = []

    def backend(graph: fx.GraphModule, inputs: list[torch.Tensor], **configs: Any) -> Any:
        compiled.append(graph)
        return graph.forward

    compile_split._SplittingCompiler(splitter, backend).compile_fn(gm, [torch.ones(2)] if inputs is None else inputs)
    return compiled


def test_a_graph_with_one_piece_goes_to_the_backend_whole_and_two_pieces_each_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    net = _TwoLayers()
    gm = fx.symbolic_trace(net)
    params = [gm.a, gm.b]
    assert _compile(monkeypatch, gm, params, [[0, 1]]) == [gm]
    pieces = _compile(monkeypatch, gm, params, [[1], [0]])
    assert len(pieces) == 2 and gm not in pieces


def test_the_pieces_are_traced_in_the_inputs_fake_mode_or_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo hands fake inputs: their mode traces the pieces; real ones get a fresh mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    net = _TwoLayers()
    gm = fx.symbolic_trace(net)
    modes: list[Any] = []
    _compile(monkeypatch, gm, [gm.a, gm.b], [[1], [0]], fake_modes=modes)
    inputs_mode = FakeTensorMode()
    _compile(monkeypatch, gm, [gm.a, gm.b], [[1], [0]], [inputs_mode.from_tensor(torch.ones(2))], modes)
    assert isinstance(modes[0], FakeTensorMode) and modes[1] is inputs_mode


def test_a_parameter_input_no_node_uses_closes_no_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.ones(2)
    graph = fx.Graph()
    unused = graph.placeholder("unused")
    unused.meta["grapharg"] = SimpleNamespace(example=weight)
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.mul, (x, 2)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert _compile(monkeypatch, gm, [weight], [[0]]) == [gm]


def test_dynamo_never_traces_the_splitters_entry_or_exit() -> None:
    """Under torch.compile(OverlapDDP(model)) the swap and the restore run as written, not traced."""
    for method in (GraphSplitter.__enter__, GraphSplitter.__exit__):
        assert getattr(method, "_torchdynamo_disable", False) is True, method.__qualname__


def test_a_torch_without_dynamos_ddp_hooks_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module loads on a torch without the private hooks, and the warning's reason names them."""
    import importlib.util

    monkeypatch.setitem(sys.modules, "torch._dynamo.backends.distributed", None)  # its import now fails
    spec = importlib.util.spec_from_file_location("compile_split_without_hooks", compile_split.__file__)
    assert spec is not None and spec.loader is not None
    without = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, without)  # its dataclasses look it up there
    spec.loader.exec_module(without)
    assert "torch._dynamo.backends.distributed" in str(without._MISSING)
