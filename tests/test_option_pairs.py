"""Every pair of options (tests/option_pairs.py): generated all-pairs rows, each bit-equal to stock DDP
after every step at the world size the row names. Needs allpairspy (the ``test`` extra)."""

from __future__ import annotations

import itertools

import pytest

from tests import option_pairs
from tests.multiprocess import SLOW_TIMEOUT_S, run_ranks

pytest.importorskip("allpairspy", reason="the option-pair matrix needs allpairspy: python3 -m pip install -e '.[test]'")


def _excluded(a: str, x: object, b: str, y: object) -> bool:
    return any({(a, x), (b, y)} == {(p, v), (q, w)} for p, v, q, w, _ in option_pairs.NO_REFERENCE)


def test_every_pair_of_values_occurs_in_a_row_unless_it_has_no_reference():
    rows = option_pairs.rows()
    missing = [
        (a, x, b, y)
        for a, b in itertools.combinations(option_pairs.FACTORS, 2)
        for x in option_pairs.FACTORS[a]
        for y in option_pairs.FACTORS[b]
        if not _excluded(a, x, b, y) and not any(row[a] == x and row[b] == y for row in rows)
    ]
    assert not missing, missing
    excluded = [row for row in rows if any(row[a] == x and row[b] == y for a, x, b, y, _ in option_pairs.NO_REFERENCE)]
    assert not excluded, excluded


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_row_is_bit_equal_to_stock_ddp_every_step(world_size):
    chosen = [row for row in option_pairs.rows() if row["world_size"] == world_size]
    per_rank = run_ranks(world_size, option_pairs.run_rows, chosen, timeout_s=SLOW_TIMEOUT_S)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(chosen)
        bad = {name: found for name, found in results.items() if found != {"ddp_error": None, "ours_error": None,
                                                                            "difference": None}}
        assert not bad, f"rank {rank}: {bad}"
