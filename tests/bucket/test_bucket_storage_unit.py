"""A dense bucket's storage on its own, without a process group: its layout (offsets, padding, views
that keep a parameter's strides), the copy-in's scaling in each mode, the gradients it writes back,
and the refusal that names the bucket. One rank cannot tell these apart from DDP's when they slip,
and a spawn per mutant costs minutes: here each is a direct check of what the buffer holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapddp.bucket.storage import BucketStorage, is_dense_permutation, strided_view


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(shape)) for shape in shapes]


def _grads(params: list[nn.Parameter], first: float = 1.0) -> list[torch.Tensor]:
    """Distinct values per element and parameter, so a misplaced copy shows."""
    grads, start = [], first
    for p in params:
        grads.append(torch.arange(start, start + p.numel()).reshape(p.shape))
        start += p.numel()
    return grads


def test_a_bucket_refuses_parameters_of_two_dtypes_naming_both() -> None:
    mixed = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="bucket 4 must share one device and dtype; found torch.float32 on cpu "
                                         "and torch.float64 on cpu"):
        BucketStorage(4, mixed)
    late = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1, dtype=torch.float16))]
    with pytest.raises(ValueError, match="found torch.float32 on cpu and torch.float16"):
        BucketStorage(4, late)
    elsewhere = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match="found torch.float32 on cpu and torch.float32 on meta"):
        BucketStorage(4, elsewhere)


def test_parameters_lie_back_to_back_in_one_flat_buffer() -> None:
    params = _params((2, 3), (1,), (4,))
    storage = BucketStorage(1, params)
    assert storage.index == 1 and storage.params == params
    assert storage.lengths == [6, 1, 4] and storage.offsets == [0, 6, 7]
    assert storage.buffer.numel() == 11 and storage.buffer.dtype == params[0].dtype
    for view, offset, p in zip(storage.views, storage.offsets, params, strict=True):
        assert view.shape == p.shape and view.data_ptr() == storage.buffer[offset:].data_ptr()


def test_a_view_keeps_a_dense_permuted_parameters_strides_and_reshapes_any_other() -> None:
    channels_last = torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    assert is_dense_permutation(channels_last) and is_dense_permutation(torch.zeros(3, 1, 4))
    flat = torch.arange(30.0)
    view = strided_view(flat, channels_last, 5)
    assert view.stride() == channels_last.stride() and view.storage_offset() == 5
    every_other = torch.zeros(4, 6)[:, ::2]
    assert not is_dense_permutation(every_other)
    reshaped = strided_view(flat, every_other, 3)
    assert reshaped.is_contiguous() and torch.equal(reshaped, torch.arange(3.0, 15.0).reshape(4, 3))
    size_one_dims = torch.zeros(1, 5, 1)
    assert is_dense_permutation(size_one_dims.as_strided((1, 5, 1), (7, 1, 9)))
    assert not is_dense_permutation(torch.zeros(12).as_strided((2, 5), (6, 1)))
    assert not is_dense_permutation(torch.zeros(12).as_strided((2, 1, 5), (6, 1, 1))), "a size-1 dimension ends nothing"
    assert not is_dense_permutation(torch.zeros(1).expand(4)), "overlapping elements are not dense"
    assert is_dense_permutation(torch.zeros(2, 300)) and is_dense_permutation(torch.zeros(300, 2).t()), (
        "strides past the small-int cache compare by value")


def test_copy_in_multiplies_each_element_by_the_factor_and_zeros_a_missing_gradient() -> None:
    params = _params((3,), (2,), (2,))
    storage = BucketStorage(0, params)
    storage.buffer.fill_(float("nan"))
    grads = _grads(params)
    storage.copy_in([grads[0], None, grads[2]], 1 / 3, None)
    expected = torch.cat([grads[0] * (1 / 3), torch.zeros(2), grads[2] * (1 / 3)])
    assert torch.equal(storage.buffer, expected)


def test_copy_in_without_a_factor_copies_and_divides_the_whole_buffer_when_told() -> None:
    params = _params((2,), (3,))
    storage = BucketStorage(0, params)
    grads = _grads(params)
    storage.copy_in(grads, None, None)
    assert torch.equal(storage.buffer, torch.cat(grads))
    storage.copy_in(grads, None, 3.0)
    assert torch.equal(storage.buffer, torch.cat(grads) / 3.0), "true division, as DDP's batched copy"
    storage.copy_in(grads, 0.5, 3.0)
    assert torch.equal(storage.buffer, torch.cat(grads) * 0.5 / 3.0)


def test_a_gradient_that_is_its_view_is_divided_in_place_and_the_others_multiplied() -> None:
    params = _params((2,), (3,))
    storage = BucketStorage(0, params)
    storage.views[0].copy_(torch.tensor([6.0, 9.0]))
    aliased = storage.views[0]
    other = torch.tensor([3.0, 6.0, 12.0])
    assert storage.aliases(0, aliased) and not storage.aliases(1, other) and not storage.aliases(0, None)
    storage.copy_in([aliased, other], 0.25, None, 3.0)
    assert torch.equal(storage.buffer, torch.tensor([2.0, 3.0, 0.75, 1.5, 3.0]))
    storage.copy_in([aliased, None], 0.25, None, None)
    assert torch.equal(storage.buffer, torch.tensor([2.0, 3.0, 0.0, 0.0, 0.0])), "an alias alone is left as it is"


def test_a_copy_of_the_buffer_is_not_its_views_alias() -> None:
    storage = BucketStorage(0, _params((2,), (2,)))
    same_start = storage.buffer.clone()[:2]
    elsewhere = torch.zeros(8)[2:4]
    assert not storage.aliases(0, same_start) and not storage.aliases(0, elsewhere)
    assert not storage.aliases(1, storage.views[0]) and not storage.aliases(0, storage.views[1]), (
        "another slot's view is not this slot's")


def test_dropping_aliased_gradients_sets_only_those_to_none() -> None:
    params = _params((2,), (2,))
    storage = BucketStorage(0, params)
    own = torch.ones(2)
    params[0].grad, params[1].grad = storage.views[0], own
    storage.drop_aliased_grads()
    assert params[0].grad is None and params[1].grad is own


def test_pointing_gradients_at_views_leaves_missing_ones_missing() -> None:
    params = _params((2,), (2,), (1,))
    storage = BucketStorage(0, params)
    params[0].grad = torch.ones(2)
    params[2].grad = storage.views[2]
    storage.point_grads_at_views()
    assert params[0].grad is storage.views[0] and params[1].grad is None and params[2].grad is storage.views[2]


def test_copy_out_writes_only_the_marked_gradients_from_the_buffer_or_another_result() -> None:
    params = _params((2,), (3,))
    storage = BucketStorage(0, params)
    storage.buffer.copy_(torch.arange(1.0, 6.0))
    kept = torch.full((3,), 7.0)
    params[1].grad = kept
    storage.copy_out(storage.buffer, [True, False], as_view=False)
    assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0])) and params[0].grad.data_ptr() != storage.buffer.data_ptr()
    assert params[1].grad is kept and torch.equal(kept, torch.full((3,), 7.0))
    written = params[0].grad
    storage.copy_out(torch.arange(10.0, 15.0), [True, True], as_view=False)
    assert params[0].grad is written and torch.equal(written, torch.tensor([10.0, 11.0]))
    assert torch.equal(kept, torch.tensor([12.0, 13.0, 14.0])), "an existing gradient is written in place"
    assert torch.equal(storage.buffer, torch.arange(1.0, 6.0)), "another result leaves the buffer alone"
    storage.copy_out(storage.buffer, [False, False], as_view=False)
    assert torch.equal(kept, torch.tensor([12.0, 13.0, 14.0]))


def test_a_new_gradient_has_a_dense_parameters_strides_and_any_other_is_contiguous() -> None:
    channels_last = nn.Parameter(torch.zeros(1, 2, 2, 2).to(memory_format=torch.channels_last))
    strided = nn.Parameter(torch.zeros(2, 6)[:, ::2])
    storage = BucketStorage(0, [channels_last, strided])
    storage.copy_out(torch.arange(14.0), [True, True], as_view=False)
    assert channels_last.grad.stride() == channels_last.stride()
    assert strided.grad.is_contiguous() and torch.equal(strided.grad, torch.arange(8.0, 14.0).reshape(2, 3))


def test_copy_out_as_views_makes_missing_gradients_their_views_and_copies_another_result_in() -> None:
    params = _params((2,), (2,))
    storage = BucketStorage(0, params)
    storage.buffer.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    storage.copy_out(storage.buffer, [True, False], as_view=True)
    assert params[0].grad is storage.views[0] and params[1].grad is None
    storage.copy_out(torch.tensor([5.0, 6.0, 7.0, 8.0]), [False, True], as_view=True)
    assert params[1].grad is storage.views[1]
    assert torch.equal(storage.buffer, torch.tensor([1.0, 2.0, 7.0, 8.0])), "only the marked slot is copied in"


def test_copy_out_as_views_of_another_result_with_nothing_marked_writes_nothing() -> None:
    """A bucket no rank used, under a hook that returns a new tensor: nothing to copy, no error."""
    params = _params((2,), (1,))
    storage = BucketStorage(0, params)
    storage.buffer.copy_(torch.tensor([1.0, 2.0, 3.0]))
    storage.copy_out(torch.zeros(3), [False, False], as_view=True)
    assert params[0].grad is None and params[1].grad is None
    assert torch.equal(storage.buffer, torch.tensor([1.0, 2.0, 3.0]))
