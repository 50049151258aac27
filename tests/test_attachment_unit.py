"""attachment.py on its own, without a process group: what ``Switches`` holds when a keyword is not given
(the wrapper passes all six, so only a direct caller sees the defaults)."""

from __future__ import annotations

import dataclasses
import inspect

from overlapddp import OverlapDDP
from overlapddp.attachment import Switches


def test_switches_default_to_attach_optimizers_own_defaults() -> None:
    signature = inspect.signature(OverlapDDP.attach_optimizer).parameters
    fields = dataclasses.fields(Switches)
    assert [f.name for f in fields] == [n for n in signature if n not in ("self", "optimizer")]
    for field in fields:
        assert field.default == signature[field.name].default, field.name
    assert Switches() == Switches(overlap=False, shard=False, max_grad_norm=None, scaler=None, strict=False,
                                  allow_unsynced=False)
