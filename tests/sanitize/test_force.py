"""``--force``: a clean loop's parameters are bit-equal with and without it; a racy one's change (NaN
where the value read early is used), even where the detector cannot see the read (numpy)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sanitize import zoo
from tests.support.multiprocess import SLOW_TIMEOUT_S, run_ranks

CLEAN = ["manual_waits", "ddp_plain", "ddp_allreduce_hook", "ddp_powersgd", "overlap_default", "overlap_optimizer",
         "overlap_sharded", "overlap_powersgd", "zero"]
RACY = ["manual_step", "manual_clip", "ddp_delayed", "gather", "numpy_read"]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(2, zoo.bare_and_forced, CLEAN + RACY, timeout_s=SLOW_TIMEOUT_S)


@pytest.mark.parametrize("loop", CLEAN)
def test_a_clean_loop_is_bit_equal_under_force(runs, loop):
    for results in runs:
        bare, forced, findings = results[loop]
        assert findings == 0
        assert forced == bare  # every parameter's shape and bytes
        assert not zoo.has_nan(bare)


@pytest.mark.parametrize("loop", RACY)
def test_a_racy_loop_changes_its_numbers_under_force(runs, loop):
    # A value read before completion is NaN and spreads; a clip's scaling written before completion is
    # overwritten by the result (its NaN norm never reaches the parameters, but the clip is lost).
    for results in runs:
        bare, forced, _ = results[loop]
        assert not zoo.has_nan(bare) and forced != bare
        assert zoo.has_nan(forced) is (loop != "manual_clip")


def test_a_read_the_detector_cannot_see_shows_only_in_the_numbers(runs):
    for results in runs:
        assert results["numpy_read"][2] == 0  # numpy reads no op: nothing found
