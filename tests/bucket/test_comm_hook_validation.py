"""check_comm_hook and builtin_hook on their own: what DDP accepts passes, what it rejects raises
the exception DDP raises, naming the hook. Spawn-free (the mutation run leans on it)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from overlapddp.bucket.comm_hook import Bucket
from overlapddp.bucket.comm_hook_validation import CommHookSignatureError, builtin_hook, check_comm_hook


def annotated(name, bucket=None, returns=None):
    """A hook whose annotations are the objects given (this module's own annotations are strings)."""

    def hook(state, bucket):
        return bucket

    hook.__qualname__ = name
    if bucket is not None:
        hook.__annotations__["bucket"] = bucket
    if returns is not None:
        hook.__annotations__["return"] = returns
    return hook


def no_bucket(state, grads):
    return grads


plain = annotated("plain")
grad_bucket = annotated("grad_bucket", dist.GradBucket, torch.futures.Future[torch.Tensor])
own_bucket = annotated("own_bucket", Bucket, "torch.futures.Future[torch.Tensor]")
string_bucket = annotated("string_bucket", "dist.GradBucket")
wrong_bucket = annotated("wrong_bucket", int)
wrong_return = annotated("wrong_return", None, int)


@pytest.mark.parametrize("hook", [plain, grad_bucket, own_bucket, string_bucket, default_hooks.allreduce_hook])
def test_hooks_ddp_accepts_are_accepted(hook):
    check_comm_hook(hook, None)


@pytest.mark.parametrize(
    "hook, error, words",
    [
        (wrong_bucket, ValueError, ["wrong_bucket", "bucket annotation", "int"]),
        (wrong_return, ValueError, ["wrong_return", "return annotation", "int"]),
        (no_bucket, CommHookSignatureError, ["no_bucket", "'bucket'", "['state', 'grads']"]),
        (42, TypeError, ["must be callable", "42"]),
    ],
)
def test_hooks_ddp_rejects_raise_its_exception_naming_the_hook(hook, error, words):
    with pytest.raises(error) as raised:
        check_comm_hook(hook, None)
    for word in words:
        assert word in str(raised.value)


def test_a_hook_without_bucket_is_caught_as_ddps_key_error_and_as_a_type_error():
    for caught in (KeyError, TypeError):
        with pytest.raises(caught):
            check_comm_hook(no_bucket, None)


def test_builtin_hooks_are_torchs_python_hooks_of_the_same_type():
    assert builtin_hook(dist.BuiltinCommHookType.ALLREDUCE) is default_hooks.allreduce_hook
    assert builtin_hook(dist.BuiltinCommHookType.FP16_COMPRESS) is default_hooks.fp16_compress_hook
    with pytest.raises(ValueError, match="Unknown built-in communication hook type 'nope'"):
        builtin_hook("nope")  # type: ignore[arg-type]


def test_a_copied_or_unpickled_hook_type_selects_the_same_hook():
    """Configs are copied and pickled (launchers, framework strategies): a copy of the enum is equal
    to the original but not the same object, so the selection must compare values."""
    for kind, hook in (
        (dist.BuiltinCommHookType.ALLREDUCE, default_hooks.allreduce_hook),
        (dist.BuiltinCommHookType.FP16_COMPRESS, default_hooks.fp16_compress_hook),
    ):
        for copied in (copy.deepcopy(kind), pickle.loads(pickle.dumps(kind))):
            assert copied is not kind and builtin_hook(copied) is hook
