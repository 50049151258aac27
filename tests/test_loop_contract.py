"""The loop contract matrix (tests/support/loop_contract.py): every loop line in every mode is bit-equal to
stock DDP running the same loop, raises at that line naming the operation and the fix, or differs
exactly as the mode's docstring states. One spawn per world size runs every cell; each cell is a test."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from overlapddp import OverlapDDP
from tests.support import loop_contract
from tests.support.loop_contract import CONTRACT, MODES, WORLD_SIZES, Cell, cells, expected, judge
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

DOC = Path(__file__).resolve().parent.parent / "docs" / "loop_contract.md"
ALL_CELLS = [cell for world_size in WORLD_SIZES for cell in cells(world_size)]


@functools.cache
def results(world_size: int) -> list[dict[str, dict]]:
    """Every cell at ``world_size``, one spawn; per rank, per cell name, what was found."""
    return run_ranks(world_size, loop_contract.run_cells, cells(world_size), timeout_s=SLOW_TIMEOUT_S)


def _outcomes(cell: Cell) -> list[tuple[str, str]]:
    return [judge(cell, rank, found[cell.name]) for rank, found in enumerate(results(cell.world_size))]


@pytest.mark.parametrize("cell", [c for c in ALL_CELLS if c.planted is None], ids=lambda c: c.name)
def test_every_loop_line_keeps_its_meaning_or_raises_there(cell: Cell) -> None:
    want = expected(cell)
    for rank, (outcome, why) in enumerate(_outcomes(cell)):
        assert outcome == want, f"{cell.name}, rank {rank}: expected {want}, found {outcome}: {why}"


@pytest.mark.parametrize("cell", [c for c in ALL_CELLS if c.planted is not None], ids=lambda c: c.name)
def test_a_planted_fault_turns_its_cell_silent(cell: Cell) -> None:
    """The matrix can fail: the library broken on purpose makes an equal, a raising and a contract cell silent."""
    assert [outcome for outcome, _ in _outcomes(cell)] == ["silent"] * cell.world_size, _outcomes(cell)


def test_every_line_runs_in_the_core_modes_at_every_world_size() -> None:
    for mode in ("default", "guard", "overlap", "shard"):
        assert MODES[mode].lines == tuple(loop_contract.LINES)
        assert MODES[mode].world_sizes == WORLD_SIZES
    named = {(line, mode) for line, mode in [*loop_contract.RAISES, *CONTRACT]}
    assert named <= {(c.line, c.mode) for c in ALL_CELLS}, "a table entry names no cell"


def test_each_contract_is_stated_in_the_modes_docstring() -> None:
    docstring = " ".join((OverlapDDP.attach_optimizer.__doc__ or "").replace("``", "").split()).lower()
    for cell, sentence in CONTRACT.items():
        assert sentence.lower() in docstring, f"{cell}: {sentence!r} is not in attach_optimizer's docstring"


def test_the_docs_table_is_the_one_the_cells_are_checked_against() -> None:
    text = DOC.read_text()
    table = re.search(r"<!-- loop-contract-table -->\n(.*?)\n<!-- /loop-contract-table -->", text, re.S)
    assert table is not None and table.group(1) == loop_contract.doc_table(), (
        "docs/loop_contract.md's table is stale: paste tests.support.loop_contract.doc_table() between its markers")


def _raised(at: str, message: str, differences: list[str]) -> dict:
    error = {"type": "RuntimeError", "message": message, "step": 1, "at": at, "where": ""}
    return {"error": error, "reference_error": None, "steps": (1, 4), "differences": differences,
            "reads_hold_new_values": False}


RAISING = Cell("lr_after_backward", "overlap", 2)
GOOD_MESSAGE = ("optimizer.step() on rank 1: param_groups[0]['lr'] is 0.05, but ... set hyperparameters (an lr, an LR "
                "scheduler's step()) before backward, or ...")


@pytest.mark.parametrize("found, outcome", [
    (_raised("opt.step()", GOOD_MESSAGE, []), "raises"),
    (_raised("opt.zero_grad()", GOOD_MESSAGE, []), "silent"),  # at another line
    (_raised("opt.step()", "optimizer.step() failed", []), "silent"),  # says neither the operation nor the fix
    (_raised("opt.step()", GOOD_MESSAGE.replace("rank 1", "rank 0"), []), "silent"),  # names another rank
    (_raised("opt.step()", GOOD_MESSAGE, ["step 0: module.out.weight"]), "silent"),  # differed before it raised
])
def test_a_raise_counts_only_at_its_line_with_its_message_after_equal_steps(found: dict, outcome: str) -> None:
    assert judge(RAISING, 1, found)[0] == outcome
