"""Every pair of options, generated: DDP's flags and OverlapDDP's extras, run against stock DDP.

``FACTORS`` lists each option and its values; ``rows()`` asks ``allpairspy`` for a set of
configurations in which every pair of values of every two options occurs at least once. Each row
trains stock DDP and OverlapDDP side by side (the same model, batches, optimizer and, where the row
has one, comm hook) for ``STEPS`` SGD-momentum steps on rank-dependent batches and compares every
gradient and parameter with ``torch.equal`` after every step. A row OverlapDDP refuses must raise a
clear error when it is built; one stock DDP refuses must be refused by both.
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from overlapddp import OverlapDDP
from tests import hooks
from tests.parity import first_difference, first_grad_difference

STEPS = 3
CAP_MB = 0.0005  # several buckets

# Each option and its values, the first being the default. ``world_size`` decides the spawn a row runs in.
FACTORS: dict[str, list[Any]] = {
    "world_size": [2, 3],
    "accumulate": [1, 2],  # micro-steps per step, all but the last under no_sync()
    "find_unused_parameters": [False, True],
    "static_graph": [False, True],
    "gradient_as_bucket_view": [False, True],
    "batched_grad_copy": [False, True],
    "hook": [None, "fp16_compress", "powerSGD/sync"],  # names in tests/hooks.py
    "delay_all_reduce": [False, True],  # delay_all_reduce_named_params=[mid.weight], hooked on first.weight
    "optimizer": ["plain", "guard", "overlap"],  # OverlapDDP.attach_optimizer(...), overlap=True
    "compile": [False, True],  # the module under torch.compile(backend="aot_eager") in both wrappers
    # OverlapDDP.count_tokens per micro-batch, sum losses, batches of 1 to 3 rows by rank and step;
    # stock DDP divides each bucket by the global count in a hook (tests/hooks.py: divide_by_total_hook).
    "count_tokens": [False, True],
}


# Pairs with no stock-DDP reference, left out of the generated rows (docs/testing.md says where
# each is tested instead): (option, value, option, value, why).
NO_REFERENCE = [
    ("static_graph", True, "accumulate", 2, "stock DDP fails an internal assert (expect_autograd_hooks_) under no_sync"),
    ("delay_all_reduce", True, "accumulate", 2, "a deliberate difference: inside no_sync OverlapDDP keeps the delayed "
     "gradients local, stock DDP reduces them at every micro-step (test_delayed.py compares with DDP without the delay)"),
    ("delay_all_reduce", True, "compile", True, "the compiled backward computes the hook parameter's gradient before the "
     "delayed one's: OverlapDDP raises at the first backward, naming the parameter; stock DDP does not check"),
]


# Pairs OverlapDDP refuses with a clear error, left out of the rows (test_option_pairs.py checks each
# refusal on one rank): (option, value, option, value, what the error says).
REFUSED = [
    ("hook", "fp16_compress", "count_tokens", True, "count_tokens cannot be combined with the communication hook"),
    ("hook", "powerSGD/sync", "count_tokens", True, "count_tokens cannot be combined with the communication hook"),
    ("delay_all_reduce", True, "count_tokens", True, "count_tokens cannot be combined with delay_all_reduce_named_params"),
]


def _has_reference(values: list[Any]) -> bool:
    """allpairspy's filter: ``values`` is a row's prefix, in ``FACTORS`` order."""
    row = dict(zip(FACTORS, values, strict=False))
    return not any(row.get(a) == x and row.get(b) == y for a, x, b, y, _ in NO_REFERENCE + REFUSED)


def _pairs(row: dict[str, Any]) -> set[tuple[str, Any, str, Any]]:
    names = list(FACTORS)
    return {(a, row[a], b, row[b]) for i, a in enumerate(names) for b in names[i + 1:]}


def wanted_pairs() -> set[tuple[str, Any, str, Any]]:
    """Every pair of values of two options (in ``FACTORS`` order) that has a reference."""
    names = list(FACTORS)
    return {
        (a, x, b, y)
        for i, a in enumerate(names) for b in names[i + 1:] for x in FACTORS[a] for y in FACTORS[b]
        if _has_reference([{a: x, b: y}.get(n, FACTORS[n][0]) for n in names])
    }


def rows() -> list[dict[str, Any]]:
    """All-pairs configurations, the same on every call: allpairspy's (deterministic), then, since its
    filter can leave pairs out, one more row per pair still missing, from the defaults, each other
    option set to the value that covers most missing pairs."""
    from allpairspy import AllPairs

    names = list(FACTORS)
    generated = [dict(zip(names, values, strict=True))
                 for values in AllPairs([FACTORS[n] for n in names], filter_func=_has_reference)]
    missing = wanted_pairs() - set().union(*(_pairs(r) for r in generated))
    while missing:
        a, x, b, y = min(missing, key=repr)
        row = {a: x, b: y}
        for c in names:
            if c in row:
                continue
            options = [v for v in FACTORS[c] if _has_reference([{**row, c: v}.get(n, FACTORS[n][0]) for n in names])]
            row[c] = max(options, key=lambda v: len(_pairs({n: {**row, c: v}.get(n, FACTORS[n][0]) for n in names})
                                                   & missing))
        row = {n: row[n] for n in names}
        generated.append(row)
        missing -= _pairs(row)
    return generated


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


def run_row(rank: int, row: dict[str, Any]) -> dict[str, Any]:
    """What happened: each wrapper's error (None if it ran) and, where both ran, the first step
    and tensor that differed (None if every step was equal)."""
    found: dict[str, Any] = {"ddp_error": None, "ours_error": None, "difference": None}
    token_state = {"batched": row["batched_grad_copy"], "total": 0.0} if row["count_tokens"] else None
    try:
        reference = _wrap(DistributedDataParallel, row, token_state)
    except Exception as error:
        found["ddp_error"] = _error(error)
        reference = None
    try:
        candidate = _wrap(OverlapDDP, row)
        opt = torch.optim.SGD(candidate.parameters(), lr=0.1, momentum=0.9)
        if row["optimizer"] != "plain":
            candidate.attach_optimizer(opt, overlap=row["optimizer"] == "overlap")
    except Exception as error:
        found["ours_error"] = _error(error)
        return found
    if reference is None:
        return found
    pairs = [(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), "ddp_error"),
             (candidate, opt, "ours_error")]
    for step in range(STEPS):
        if token_state is not None:
            token_state["total"] = _token_total(row, step, dist.get_world_size())
        for wrapper, _, key in pairs:
            try:
                for micro in range(row["accumulate"]):
                    x, y = _batch(rank, step * row["accumulate"] + micro, tokens=row["count_tokens"])
                    with wrapper.no_sync() if micro < row["accumulate"] - 1 else nullcontext():
                        _loss(wrapper, row, x, y).backward()
            except Exception as error:
                found[key] = f"step {step}: " + _error(error)
        if found["ddp_error"] or found["ours_error"]:
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
