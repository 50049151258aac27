"""The mixed-precision pieces on one process, no ranks: the dtype checks, what each swap hands to
the fence to keep alive, and the end-of-backward restore queued once per backward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from overlapddp.bucket.comm_hook import is_unchained
from overlapddp.mixed_precision import MixedPrecision, ParameterCasts, ReduceInPrecision, reduce_in_precision_hook


@pytest.mark.parametrize("name", ["param_dtype", "reduce_dtype", "buffer_dtype"])
@pytest.mark.parametrize("bad", [torch.int32, torch.bool, "bfloat16"])
def test_each_dtype_must_be_floating_or_none(name: str, bad: object) -> None:
    config = SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=None, buffer_dtype=None)
    setattr(config, name, bad)
    with pytest.raises(TypeError, match=f"mixed_precision.{name} must be a floating torch.dtype or None"):
        MixedPrecision(config)


class _Keeper:
    """A fence stand-in: records the tensors each swap asks it to keep for the current stream."""

    def __init__(self) -> None:
        self.kept: list[list[torch.Tensor]] = []

    def __call__(self) -> "_Keeper":
        return self

    def keep_for_current_stream(self, tensors: list[torch.Tensor]) -> None:
        self.kept.append(list(tensors))


def test_a_swap_keeps_alive_only_the_copies_it_drops() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    full = param.data.data_ptr()  # .data is a new tensor object per read: compare storage
    keeper = _Keeper()
    casts = ParameterCasts([param], torch.bfloat16, fence=keeper)  # type: ignore[arg-type]
    casts.to_low()
    first_low = param.data.data_ptr()
    assert keeper.kept == [[]], "the full-precision data is held by the casts, not dropped"
    casts.to_low()  # still swapped (a forward without backward): the first copy is dropped
    assert [t.data_ptr() for t in keeper.kept[1]] == [first_low]
    second_low = param.data.data_ptr()
    casts.to_full()
    assert param.data.data_ptr() == full and [t.data_ptr() for t in keeper.kept[2]] == [second_low]


def test_the_end_of_backward_restore_is_queued_once_per_backward_and_never_outside() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    restores: list[int] = []
    casts = ParameterCasts([param], torch.bfloat16, fence=_Keeper())  # type: ignore[arg-type]
    casts.to_full = lambda params=None: restores.append(1)  # type: ignore[method-assign]
    config = MixedPrecision(SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=None, buffer_dtype=None))
    state = ReduceInPrecision(config, casts, process_group=None)  # type: ignore[arg-type]
    state.restore_at_end_of_backward()  # outside a backward: nothing to queue on
    x = torch.ones(2, requires_grad=True)

    def twice(grad: torch.Tensor) -> torch.Tensor:
        state.restore_at_end_of_backward()
        state.restore_at_end_of_backward()
        return grad

    x.register_hook(twice)
    (x * 2).sum().backward()
    assert restores == [1]


def test_without_param_dtype_forward_still_runs_on_a_copy_as_ddps() -> None:
    """DDP swaps in its own ``_mp_param`` tensor even in the parameter's dtype: a write into the
    parameter during forward does not reach the full-precision value."""
    param = torch.nn.Parameter(torch.ones(3))
    casts = ParameterCasts([param], None, fence=_Keeper())  # type: ignore[arg-type]
    casts.to_low()
    with torch.no_grad():
        param.data.mul_(5.0)
    casts.to_full()
    assert torch.equal(param.data, torch.ones(3))


def test_the_reduction_hook_issues_one_collective_so_buckets_need_no_chain() -> None:
    assert is_unchained(reduce_in_precision_hook)
