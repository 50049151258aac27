"""The sparse bucket's storage on its own, without a process group: adopting the gradient, dividing it,
writing the reduced value back only where told, and the errors that name the parameter."""

from __future__ import annotations

import pytest
import torch

from overlapddp.bucket.sparse_storage import SparseBucketStorage


def _sparse(values: list[float], rows: list[int], shape: tuple[int, int] = (4, 1)) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([rows]), torch.tensor(values).unsqueeze(1), shape, check_invariants=True)


def _storage() -> tuple[SparseBucketStorage, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.zeros(4, 1))
    return SparseBucketStorage(2, [param], "emb.weight"), param


@pytest.mark.parametrize("count", (0, 2))
def test_a_sparse_bucket_holds_exactly_one_parameter(count: int) -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 1)) for _ in range(count)]
    with pytest.raises(ValueError, match=f"Bucket 5 .* exactly one parameter, got {count}"):
        SparseBucketStorage(5, params, "emb.weight")


def test_before_any_gradient_the_buffer_is_an_empty_sparse_tensor_of_the_parameters_shape() -> None:
    storage, _ = _storage()
    assert storage.buffer.is_sparse and storage.buffer.shape == (4, 1) and storage.buffer._nnz() == 0
    assert storage.offsets == [] and storage.lengths == [] and storage.views == []


def test_copy_in_adopts_the_gradient_and_divides_it_in_place_by_the_divisor_given() -> None:
    storage, _ = _storage()
    grad = _sparse([3.0, 6.0], [0, 2])
    storage.copy_in([grad], 0.5, 3.0)
    assert storage.buffer is grad and grad.to_dense().flatten().tolist() == [1.0, 0.0, 2.0, 0.0]
    other = _sparse([3.0], [1])
    storage.copy_in([other], None, None, 3.0)
    assert storage.buffer is other and other.to_dense().flatten().tolist() == [0.0, 1.0, 0.0, 0.0]
    hooked = _sparse([3.0], [1])
    storage.copy_in([hooked], None, None)
    assert hooked.to_dense().flatten().tolist() == [0.0, 3.0, 0.0, 0.0], "with a hook: no division"


def test_copy_in_names_the_parameter_without_a_sparse_gradient() -> None:
    storage, _ = _storage()
    with pytest.raises(RuntimeError, match=r"sparse gradient of emb\.weight \(bucket 2\) to be defined"):
        storage.copy_in([None], None, 2.0)
    with pytest.raises(RuntimeError, match=r"emb\.weight \(bucket 2\) to have a sparse gradient, got a torch\.strided"):
        storage.copy_in([torch.ones(4, 1)], None, 2.0)


def test_an_abandoned_reduction_drops_only_a_gradient_that_is_the_bucket() -> None:
    storage, param = _storage()
    grad = _sparse([1.0], [0])
    storage.copy_in([grad], None, None)
    param.grad = grad
    storage.drop_aliased_grads()
    assert param.grad is None
    replaced = _sparse([1.0], [3])
    param.grad = replaced
    storage.drop_aliased_grads()
    assert param.grad is replaced, "a gradient that is not the bucket stays"


def test_copy_out_writes_the_result_into_the_adopted_gradient_only_when_told() -> None:
    storage, _ = _storage()
    grad = _sparse([1.0], [0])
    storage.copy_in([grad], None, None)
    storage.copy_out(_sparse([5.0], [3]), [False], as_view=False)
    assert grad.to_dense().flatten().tolist() == [1.0, 0.0, 0.0, 0.0], "told not to write"
    storage.copy_out(grad, [True], as_view=False)
    assert grad.to_dense().flatten().tolist() == [1.0, 0.0, 0.0, 0.0], "the result is the gradient"
    storage.copy_out(_sparse([5.0], [3]), [True], as_view=False)
    assert storage.buffer is grad and grad.to_dense().flatten().tolist() == [0.0, 0.0, 0.0, 5.0]


def test_a_dense_result_for_a_sparse_bucket_is_refused_naming_it() -> None:
    storage, _ = _storage()
    storage.copy_in([_sparse([1.0], [0])], None, None)
    with pytest.raises(ValueError, match=r"sparse bucket 2 \(emb\.weight\) returned a torch\.strided"):
        storage.copy_out(torch.ones(4, 1), [True], as_view=False)
