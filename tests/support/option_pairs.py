"""Every pair of options, generated: DDP's flags and OverlapDDP's extras, run against stock DDP.

``FACTORS`` lists each option and its values; ``rows()`` asks ``allpairspy`` for a set of
configurations in which every pair of values of every two options occurs at least once. Each row
trains its reference and OverlapDDP side by side (the same model, batches, optimizer and, where the
row has one, comm hook) for ``steps_of(row)`` SGD-momentum steps on rank-dependent batches and
compares every gradient and parameter with ``torch.equal`` after every step. The reference is stock
DDP with the same options, except under ``mixed_precision``, which stock DDP runs only on CUDA: there
it is DDP's casts written out by hand (tests/support/precision_reference.py). A row OverlapDDP refuses must
raise a clear error when it is built; one stock DDP refuses must be refused by both.
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

from overlapddp import OverlapDDP
from overlapddp.layout import tuner
from tests.support import hooks
from tests.support.parity import first_difference, first_grad_difference
from tests.support.precision_reference import HandWrittenCasts

STEPS = 3
# bucket_plan="tuned" tries every candidate layout and adopts one (a step later with static_graph).
TUNED_STEPS = 3 + tuner.TUNING_ITERATIONS
PRECISION = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
CAP_MB = 0.0005  # several buckets

# Each option and its values, the first being the default. ``world_size`` decides the spawn a row runs in.
FACTORS: dict[str, list[Any]] = {
    "world_size": [2, 3],
    "accumulate": [1, 2],  # micro-steps per step, all but the last under no_sync()
    "find_unused_parameters": [False, True],
    "static_graph": [False, True],
    "gradient_as_bucket_view": [False, True],
    "batched_grad_copy": [False, True],
    "hook": [None, "fp16_compress", "powerSGD/sync"],  # names in tests/support/hooks.py
    "delay_all_reduce": [False, True],  # delay_all_reduce_named_params=[mid.weight], hooked on first.weight
    "optimizer": ["plain", "guard", "overlap"],  # OverlapDDP.attach_optimizer(...), overlap=True
    "compile": [False, True],  # the module under torch.compile(backend="aot_eager") in both wrappers
    # OverlapDDP.count_tokens per micro-batch, sum losses, batches of 1 to 3 rows by rank and step;
    # stock DDP divides each bucket by the global count in a hook (tests/support/hooks.py: divide_by_total_hook).
    "count_tokens": [False, True],
    "mixed_precision": [False, True],  # PRECISION: bfloat16 parameters, float32 reduction
    "bucket_plan": ["ddp", "tuned"],  # tuned: every candidate layout in turn, then the fastest
}


# Pairs with no reference, left out of the generated rows (docs/testing.md says where each is tested
# instead): (option, value, option, value, why).
NO_REFERENCE = [
    ("static_graph", True, "accumulate", 2, "stock DDP fails an internal assert (expect_autograd_hooks_) under no_sync"),
    ("delay_all_reduce", True, "accumulate", 2, "a deliberate difference: inside no_sync OverlapDDP keeps the delayed "
     "gradients local, stock DDP reduces them at every micro-step (test_delayed.py compares with DDP without the delay)"),
    ("delay_all_reduce", True, "compile", True, "the compiled backward computes the hook parameter's gradient before the "
     "delayed one's: OverlapDDP raises at the first backward, naming the parameter; stock DDP does not check"),
    ("bucket_plan", "tuned", "world_size", 3, "the tuned layouts are not DDP's by design, and at 3 ranks gloo sums an "
     "element in an order set by its place in the bucket; at 2 ranks the order cannot change a sum (a + b = b + a)"),
]


# Pairs OverlapDDP refuses with a clear error, left out of the rows (test_option_pairs.py checks each
# refusal on one rank): (option, value, option, value, what the error says).
REFUSED = [
    ("hook", "fp16_compress", "count_tokens", True, "count_tokens cannot be combined with the communication hook"),
    ("hook", "powerSGD/sync", "count_tokens", True, "count_tokens cannot be combined with the communication hook"),
    ("delay_all_reduce", True, "count_tokens", True, "count_tokens cannot be combined with delay_all_reduce_named_params"),
    # mixed precision's reduction is the wrapper's one comm hook (stock DDP refuses a second the same way)
    ("hook", "fp16_compress", "mixed_precision", True, "mixed_precision registered its reduction as the comm hook"),
    ("hook", "powerSGD/sync", "mixed_precision", True, "mixed_precision registered its reduction as the comm hook"),
    ("gradient_as_bucket_view", True, "mixed_precision", True,
     "mixed_precision cannot be combined with gradient_as_bucket_view=True"),
    ("delay_all_reduce", True, "mixed_precision", True,
     "mixed_precision cannot be combined with delay_all_reduce_named_params"),
    ("count_tokens", True, "mixed_precision", True, "count_tokens cannot be combined with mixed_precision"),
    ("hook", "powerSGD/sync", "bucket_plan", "tuned", "PowerSGD keeps per-bucket state from iteration start_powerSGD_iter"),
]

# Three options together that OverlapDDP refuses, though each pair of them has rows:
# ({option: value}, what the error says).
REFUSED_TRIPLES = [
    ({"mixed_precision": True, "find_unused_parameters": True, "static_graph": False},
     "mixed_precision cannot be combined with find_unused_parameters=True"),
    ({"bucket_plan": "tuned", "find_unused_parameters": True, "static_graph": False},
     "bucket_plan='tuned' re-plans the buckets after DDP's ready-order rebuild"),
]


def has_reference(row: dict[str, Any]) -> bool:
    """Whether a row, or part of one (the options it sets so far), has a reference and is accepted."""
    pairs = any(row.get(a, object()) == x and row.get(b, object()) == y for a, x, b, y, _ in NO_REFERENCE + REFUSED)
    triples = any(all(k in row and row[k] == v for k, v in settings.items()) for settings, _ in REFUSED_TRIPLES)
    return not pairs and not triples


def _pairs(row: dict[str, Any]) -> set[tuple[str, Any, str, Any]]:
    names = list(FACTORS)
    return {(a, row[a], b, row[b]) for i, a in enumerate(names) for b in names[i + 1:]}


def wanted_pairs() -> set[tuple[str, Any, str, Any]]:
    """Every pair of values of two options (in ``FACTORS`` order) that has a reference."""
    names = list(FACTORS)
    return {(a, x, b, y) for i, a in enumerate(names) for b in names[i + 1:] for x in FACTORS[a] for y in FACTORS[b]
            if has_reference({a: x, b: y})}


def _complete(row: dict[str, Any], missing: set[tuple[str, Any, str, Any]]) -> dict[str, Any] | None:
    """``row`` with every other option set, each to the accepted value that covers most ``missing``
    pairs, trying the next value where a choice leaves no accepted row (None if none is)."""
    unset = [n for n in FACTORS if n not in row]
    if not unset:
        return {n: row[n] for n in FACTORS}
    option = unset[0]

    def covered(value: Any) -> int:
        full = {n: {**row, option: value}.get(n, FACTORS[n][0]) for n in FACTORS}
        return len(_pairs(full) & missing)

    for value in sorted(FACTORS[option], key=covered, reverse=True):
        if has_reference({**row, option: value}):
            found = _complete({**row, option: value}, missing)
            if found is not None:
                return found
    return None


def rows() -> list[dict[str, Any]]:
    """All-pairs configurations, the same on every call: allpairspy's (deterministic), then, since its
    filter can leave pairs out, one more row per pair still missing (``_complete``)."""
    from allpairspy import AllPairs

    names = list(FACTORS)
    generated = [dict(zip(names, values, strict=True))
                 for values in AllPairs([FACTORS[n] for n in names], filter_func=lambda v: has_reference(
                     dict(zip(names, v, strict=False))))]
    missing = wanted_pairs() - set().union(*(_pairs(r) for r in generated))
    while missing:
        a, x, b, y = min(missing, key=repr)
        row = _complete({a: x, b: y}, missing)
        assert row is not None, f"no accepted row has {a}={x} and {b}={y}"
        generated.append(row)
        missing -= _pairs(row)
    return generated


def steps_of(row: dict[str, Any]) -> int:
    return TUNED_STEPS if row["bucket_plan"] == "tuned" else STEPS


def name(row: dict[str, Any]) -> str:
    """The options a row sets away from their defaults."""
    changed = [f"{k}={v}" for k, v in row.items() if k != "world_size" and v != FACTORS[k][0]]
    return f"ws{row['world_size']}:" + (",".join(changed) or "defaults")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.first = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def _batch(rank: int, step: int, tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent data; with ``tokens``, also a rank- and step-dependent number of rows (1 to 3)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = 1 + (rank + step) % 3 if tokens else 4
    return torch.randn(rows, 8, generator=g) * (1 + rank), torch.randn(rows, 4, generator=g)


def _wrap(wrapper: type, row: dict[str, Any], token_state: dict[str, Any] | None = None) -> nn.Module:
    net = Net()
    kwargs: dict[str, Any] = {k: row[k] for k in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                                                  "batched_grad_copy")}
    module: nn.Module = torch.compile(net, backend="aot_eager") if row["compile"] else net
    if row["delay_all_reduce"]:
        prefix = "_orig_mod." if row["compile"] else ""  # the names as the wrapped module has them
        kwargs.update(delay_all_reduce_named_params=[(f"{prefix}mid.weight", net.mid.weight)],
                      param_to_hook_all_reduce=net.first.weight)  # its gradient comes after mid's
    # Stock DDP's graph splitter under torch.compile asserts its first bucket (1 MiB) is no larger than
    # bucket_cap_mb ("First bucket should be smaller/equal to other buckets"): compiled rows use 1 MiB.
    if row["mixed_precision"]:
        kwargs.update(mixed_precision=PRECISION)
    if wrapper is OverlapDDP:
        kwargs.update(bucket_plan=row["bucket_plan"])
    wrapped = wrapper(module, bucket_cap_mb=1.0 if row["compile"] else CAP_MB, **kwargs)
    if row["hook"] is not None:
        hooks.register(wrapped, hooks.HOOKS[row["hook"]], is_reference=wrapper is DistributedDataParallel)
    if token_state is not None:  # stock DDP with count_tokens' reference hook
        wrapped.register_comm_hook(token_state, hooks.divide_by_total_hook)
    return wrapped


def _loss(wrapper: nn.Module, row: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss; with token counting, the sum (the reducer divides by the global count)."""
    if not row["count_tokens"]:
        return nn.functional.mse_loss(wrapper(x), y)
    if isinstance(wrapper, OverlapDDP):
        wrapper.count_tokens(y.numel())
    return nn.functional.mse_loss(wrapper(x), y, reduction="sum")


def _token_total(row: dict[str, Any], step: int, world_size: int) -> float:
    """This step's element count over every rank and micro-batch (stock DDP's hook divides by it)."""
    micro = range(step * row["accumulate"], (step + 1) * row["accumulate"])
    return float(sum(_batch(r, m, tokens=True)[1].numel() for r in range(world_size) for m in micro))


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def first_step_error(row: dict[str, Any]) -> str | None:
    """OverlapDDP alone with the row's options, one micro-batch: the error it raised (None: it ran)."""
    try:
        candidate = _wrap(OverlapDDP, row)
        _loss(candidate, row, *_batch(0, 0, tokens=row["count_tokens"])).backward()
    except Exception as error:
        return _error(error)
    return None


class _CastsByHand:
    """The reference of a mixed-precision row: DDP's casts by hand, reduced in the candidate's layout."""

    def __init__(self, candidate: OverlapDDP) -> None:
        self.replica = HandWrittenCasts(Net(), PRECISION)
        self.module = self.replica.net
        self.candidate = candidate

    def parameters(self) -> Any:
        return self.module.parameters()

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
        self.replica.forward_backward((x,), y, nn.functional.mse_loss, sync_buffers=True)
        if last:  # after the candidate's step: the layout it reduced in (a new one is adopted at a forward)
            self.replica.reduce(self.candidate.bucket_indices())


def _backward(wrapper: Any, row: dict[str, Any], rank: int, step: int) -> None:
    """One step's micro-batches, all but the last under no_sync()."""
    for micro in range(row["accumulate"]):
        x, y = _batch(rank, step * row["accumulate"] + micro, tokens=row["count_tokens"])
        last = micro == row["accumulate"] - 1
        if isinstance(wrapper, _CastsByHand):
            wrapper.micro_step(x, y, last)
            continue
        with wrapper.no_sync() if not last else nullcontext():
            _loss(wrapper, row, x, y).backward()


def run_row(rank: int, row: dict[str, Any]) -> dict[str, Any]:
    """What happened: each wrapper's error (None if it ran) and, where both ran, the first step
    and tensor that differed (None if every step was equal)."""
    found: dict[str, Any] = {"reference_error": None, "ours_error": None, "difference": None}
    token_state = {"batched": row["batched_grad_copy"], "total": 0.0} if row["count_tokens"] else None
    reference: Any = None
    if not row["mixed_precision"]:
        try:
            reference = _wrap(DistributedDataParallel, row, token_state)
        except Exception as error:
            found["reference_error"] = _error(error)
    try:
        candidate = _wrap(OverlapDDP, row)
        opt = torch.optim.SGD(candidate.parameters(), lr=0.1, momentum=0.9)
        if row["optimizer"] != "plain":
            candidate.attach_optimizer(opt, overlap=row["optimizer"] == "overlap")
    except Exception as error:
        found["ours_error"] = _error(error)
        return found
    if row["mixed_precision"]:
        reference = _CastsByHand(candidate)
    if reference is None:
        return found
    pairs = [(candidate, opt, "ours_error"),
             (reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), "reference_error")]
    for step in range(steps_of(row)):
        if token_state is not None:
            token_state["total"] = _token_total(row, step, dist.get_world_size())
        for wrapper, _, key in pairs:
            try:
                _backward(wrapper, row, rank, step)
                if isinstance(wrapper, DistributedDataParallel) and row["delay_all_reduce"]:
                    # Stock DDP never waits for its delayed all-reduce (it drops the work handle); gloo's
                    # barrier waits for every collective before it, so the comparison reads the result.
                    dist.barrier()
            except Exception as error:
                found[key] = f"step {step}: " + _error(error)
        if found["reference_error"] or found["ours_error"]:
            return found
        difference = first_grad_difference(reference.module, candidate.module)
        for _, optimizer, _ in pairs:
            optimizer.step()
            optimizer.zero_grad()
        difference = difference or first_difference(reference.module, candidate.module)
        if difference is not None:
            found["difference"] = f"step {step}: {difference}"
            return found
    return found


def run_rows(rank: int, world_size: int, chosen: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rows for this world size, in one spawn."""
    results = {}
    for row in chosen:
        try:
            results[name(row)] = run_row(rank, row)
        except Exception:
            results[name(row)] = {"crash": traceback.format_exc()[-1500:]}
    return results
