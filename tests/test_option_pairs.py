"""Every pair of options (tests/support/option_pairs.py): generated all-pairs rows, each bit-equal to stock DDP
after every step at the world size the row names. Needs allpairspy (the ``test`` extra)."""

from __future__ import annotations

import itertools

import pytest

from tests.support import option_pairs
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks


def _needs_allpairspy() -> None:
    pytest.importorskip("allpairspy", reason="the option-pair matrix needs allpairspy: python3 -m pip install -e '.[test]'")


def _excluded(a: str, x: object, b: str, y: object) -> bool:
    left_out = option_pairs.NO_REFERENCE + option_pairs.REFUSED
    return any({(a, x), (b, y)} == {(p, v), (q, w)} for p, v, q, w, _ in left_out)


def test_every_pair_of_values_occurs_in_a_row_unless_it_has_no_reference():
    _needs_allpairspy()
    rows = option_pairs.rows()
    missing = [
        (a, x, b, y)
        for a, b in itertools.combinations(option_pairs.FACTORS, 2)
        for x in option_pairs.FACTORS[a]
        for y in option_pairs.FACTORS[b]
        if not _excluded(a, x, b, y) and not any(row[a] == x and row[b] == y for row in rows)
    ]
    assert not missing, missing
    excluded = [row for row in rows if any(row[a] == x and row[b] == y
                                           for a, x, b, y, _ in option_pairs.NO_REFERENCE + option_pairs.REFUSED)]
    assert not excluded, excluded


@pytest.mark.parametrize("a, x, b, y, message", option_pairs.REFUSED)
def test_every_refused_pair_raises_a_clear_error_at_its_first_use(one_rank, a, x, b, y, message):
    base = {name: values[0] for name, values in option_pairs.FACTORS.items()}
    error = option_pairs.first_step_error(dict(base, world_size=1, **{a: x, b: y}))
    assert error is not None and message in error, error


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_row_is_bit_equal_to_stock_ddp_every_step(world_size):
    _needs_allpairspy()
    chosen = [row for row in option_pairs.rows() if row["world_size"] == world_size]
    per_rank = run_ranks(world_size, option_pairs.run_rows, chosen, timeout_s=SLOW_TIMEOUT_S)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(chosen)
        bad = {name: found for name, found in results.items() if found != {"reference_error": None, "ours_error": None,
                                                                            "difference": None}}
        assert not bad, f"rank {rank}: {bad}"


RACE_REPEATS = 10  # each planted race made about half of the 4-run spawns fail: 10 runs catch it far more often


def test_collectives_started_between_a_hooks_callbacks_keep_one_order_on_every_rank():
    """PowerSGD issues collectives from its callbacks. The delayed all-reduce (started at the hook
    parameter's gradient) and the unused-parameter flags' all-reduce (started with the last bucket)
    used to land between them in a different order on each rank, and gloo aborted ("Received data
    size doesn't match expected size"). Ten runs of three steps of each at 3 ranks, bit-equal to
    stock DDP with the same options every step."""
    base = {name: values[0] for name, values in option_pairs.FACTORS.items()}
    rows = [dict(base, world_size=3, hook="powerSGD/sync", delay_all_reduce=True),
            dict(base, world_size=3, hook="powerSGD/sync", find_unused_parameters=True)]
    for rank, results in enumerate(run_ranks(3, option_pairs.run_rows, [row for row in rows for _ in range(RACE_REPEATS)])):
        assert results == {option_pairs.name(row): {"reference_error": None, "ours_error": None, "difference": None}
                           for row in rows}, f"rank {rank}: {results}"
