"""Inputs and outputs DDP users feed: int64 and bool tensors, keyword arguments, nested containers,
named tuples and dataclasses, ``None`` outputs, an output the loss never reaches; in every mode that
touches them, bit-equal to stock DDP every step (see tests/support/user_inputs.py for each scenario)."""

from __future__ import annotations

import pytest

from tests.support import user_inputs
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

NAMES = [s.name for s in user_inputs.SCENARIOS]


def test_scenario_names_are_unique():
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("world_size", [2, 3])
def test_user_inputs_and_outputs_are_bit_equal_to_ddp_in_every_mode(world_size):
    per_rank = run_ranks(world_size, user_inputs.run_all, NAMES, timeout_s=SLOW_TIMEOUT_S)
    for rank, found in enumerate(per_rank):
        differing = {name: what for name, what in found.items() if what is not None}
        assert not differing, f"rank {rank}: {differing}"
