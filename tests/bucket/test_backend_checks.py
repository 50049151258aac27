"""Which backend reduces a device's tensors, what is refused before the first collective for it, and
the write watch and non-finite check on one bucket: each alone, no spawn (the backends by name, so
NCCL's refusals are checked on a CPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlapddp import backend_support
from overlapddp.bucket import gradient_checks
from overlapddp.bucket.gradient_checks import GradientWriteWatch, nonfinite_error

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def backend_named(monkeypatch):
    """Make the process group report ``name`` as torch does (``dist.Backend``: its constant for a known name)."""
    def use(name: str) -> None:
        monkeypatch.setattr(backend_support.dist, "get_backend", lambda group: dist.Backend("".join(name)))
    return use


@pytest.mark.parametrize("name, device, expected", [
    ("gloo", CPU, "gloo"),
    ("cpu:gloo,cuda:nccl", CPU, "gloo"),
    ("cpu:gloo,cuda:nccl", CUDA, "nccl"),
    ("cuda:nccl, cpu:gloo", CPU, "gloo"),  # an earlier entry whose device sorts after this one
    ("cuda:nccl", CPU, "cuda:nccl"),  # no entry for the device: the name as given
])
def test_backend_for_a_device(backend_named, name, device, expected):
    backend_named(name)
    assert backend_support.backend_for(None, device) == expected


def test_nccl_with_async_error_handling_2_is_refused(backend_named, monkeypatch):
    backend_named("nccl")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "".join("2"))
    with pytest.raises(ValueError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=2"):
        backend_support.refuse_unsupported(None, CUDA, [])


def test_nccl_of_a_mixed_group_with_async_error_handling_2_is_refused(backend_named, monkeypatch):
    backend_named("cpu:gloo,cuda:nccl")  # torch's default group on a CUDA machine: the name is split, not a literal
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    with pytest.raises(ValueError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=2"):
        backend_support.refuse_unsupported(None, CUDA, [])


def test_sparse_gradients_are_refused_on_nccl_only(backend_named, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    backend_named("nccl")
    with pytest.raises(ValueError, match="emb.weight produce sparse gradients"):
        backend_support.refuse_unsupported(None, CUDA, ["emb.weight"])
    for other in ("gloo", "ucc", "xccl"):  # names that sort before and after "nccl"
        backend_named(other)
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        backend_support.refuse_unsupported(None, CUDA, ["emb.weight"])


def _params(*grads: torch.Tensor | None) -> list[torch.Tensor]:
    params = [torch.zeros(2, requires_grad=True) for _ in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


def test_the_write_watch_ignores_a_gradient_whose_version_is_high_but_unchanged():
    params = _params(torch.zeros(2), None)
    for _ in range(300):  # past CPython's cached small integers: versions compare by value
        params[0].grad.add_(0)
    watch = GradientWriteWatch(["a", "b"], params, rank=0)
    watch.taken(0, [0, 1], params)
    watch.check(0)
    watch.taken(0, [0, 1], params)
    params[0].grad.mul_(2)
    with pytest.raises(RuntimeError, match="gradients of a .bucket 0. were changed on rank 0"):
        watch.check(0)


def test_a_bucket_with_no_gradients_is_finite(one_rank):
    assert nonfinite_error(4, [0, 1], _params(None, None), ["a", "b"], CPU, dist.group.WORLD) is None


def test_a_non_finite_gradient_is_named(one_rank):
    params = _params(torch.tensor([1.0, float("nan")]), None, torch.ones(2))
    error = nonfinite_error(2, [0, 1, 2], params, ["a", "b", "c"], CPU, dist.group.WORLD)
    assert error is not None and "in bucket 2" in str(error) and "rank 0: a" in str(error) and ", c" not in str(error)


def test_a_rank_without_gradients_in_the_bucket_names_the_rank_that_has_a_non_finite_one(one_rank, monkeypatch):
    """Another rank's NaN as this rank sees it: the summed count is 1, and the gathered names are theirs."""
    monkeypatch.setattr(gradient_checks.dist, "all_reduce", lambda count, group=None: count.add_(1))
    monkeypatch.setattr(gradient_checks, "gather_objects", lambda bad, group, device: [bad, ["w"]])
    error = nonfinite_error(1, [0], _params(None), ["a"], CPU, dist.group.WORLD)
    assert error is not None and "rank 1: w" in str(error) and "rank 0" not in str(error)
