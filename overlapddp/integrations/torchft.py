"""torchft: OverlapDDP over a torchft ``Manager``, so that a dead replica group does not stop training.

::

    from overlapddp.integrations.torchft import DistributedDataParallel   # instead of torchft's

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1,
                              load_state_dict=load, state_dict=save)
    model = DistributedDataParallel(manager, net)
    optimizer = torchft.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))

    optimizer.zero_grad()        # starts the step's quorum (during the forward, by default)
    loss_fn(model(x), y).backward()
    optimizer.step()             # steps only if manager.should_commit()

Each bucket is reduced by the manager's fault-tolerant all-reduce (a SUM over the live quorum, then
a division by its number of participants). The hook returns a future at once, so the buckets reduce
while backward goes on; OverlapDDP's fence completes them at the end of backward, where a failed or
timed-out collective has already been reported to the manager (``should_commit()`` is then False on
every replica whose collective failed). Across replica groups, OverlapDDP's own work (construction,
buffer broadcast) runs in a process group of this rank alone.

The bucket layout never changes, and is DDP's layout for ``find_unused_parameters=True`` (as in
torchft's DDP, which forces it): it follows from the model and the arguments alone. With the
Manager's default ``use_async_quorum=True`` a recovering replica receives its peers' state only in
``should_commit()``, after its first backward, so its first buckets must already be its peers'.
The options that cannot go through the manager are refused by name: see ``REFUSED``.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
import weakref
from typing import Any, NamedTuple, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torchft.manager import Manager

from overlapddp.bucket.comm_hook import CommHook
from overlapddp.device_streams import CudaKit
from overlapddp.optim.guard import OptimizerGuard
from overlapddp.optim.overlap import OverlappedOptimizer
from overlapddp.shard.optimizer import ShardedOptimizer
from overlapddp.wrapper import OverlapDDP

# The arguments this wrapper refuses, and why: each would reduce across replicas outside the
# manager (so a dead peer hangs it and its failure never reaches should_commit), or let the bucket
# layout change, which a recovering replica could not follow (see the module's docstring). None of
# them works with torchft's own DDP either: it passes process_group and find_unused_parameters
# itself, its comm hook is the only one DDP accepts, and its process group reaches no other replica.
_LAYOUT_CHANGES = (
    "a recovering replica receives its peers' state only in should_commit(), after its first backward "
    "(with the Manager's default use_async_quorum=True), so every replica must reduce with the layout it "
    "built from the model; "
)
REFUSED = {
    "process_group": "the manager owns the process group across replica groups (pass it to Manager(pg=...))",
    "device_mesh": "the manager owns the process group across replica groups (pass it to Manager(pg=...))",
    "mixed_precision": (
        "its reduction is a communication hook bound to a process group, not to the manager; cast with "
        "torch.autocast, or compress the buckets with register_comm_hook(None, fp16_compress_hook)"
    ),
    "delay_all_reduce_named_params": (
        "the delayed parameters are all-reduced on the process group directly, outside the manager"
    ),
    "param_to_hook_all_reduce": "it only goes with delay_all_reduce_named_params, which is refused",
    "bucket_plan": (
        _LAYOUT_CHANGES + "bucket_plan='tuned' changes the layout after a few iterations, from each replica's own "
        "timings; only the default 'ddp' is accepted"
    ),
    "find_unused_parameters": (
        _LAYOUT_CHANGES + "DDP keeps its first layout only while it searches unused parameters each forward "
        "(torchft's DDP forces find_unused_parameters=True for this), so True is the only value"
    ),
    "static_graph": (
        _LAYOUT_CHANGES + "DDP rebuilds the buckets of a static graph after its second iteration (torchft's DDP "
        "too)"
    ),
}
# The one value each of these may be given (None, the default, is accepted for every name).
_ACCEPTED: dict[str, object] = {"bucket_plan": "ddp", "find_unused_parameters": True, "static_graph": False}
_COMPRESSION: dict[object, torch.dtype] = {
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}
_WRAPPER_ARGUMENTS = frozenset(inspect.signature(OverlapDDP.__init__).parameters) - {"self", "module"}


class _InFlight(NamedTuple):
    """One launched bucket, put by the hook (autograd's thread) and taken by ``_complete_in_order``."""

    work: Any  # the manager's work on ``sent``
    buffer: torch.Tensor  # the bucket's buffer, the future's value
    sent: torch.Tensor  # what the manager reduces: the buffer, or its copy in the wire dtype
    future: torch.futures.Future  # what OverlapDDP's fence waits on; set by _complete_in_order
    # CUDA: the kit and the stream current in the hook (the communication stream), where torchft's
    # work must be waited on; _complete_in_order queues the copy back and the future's event there.
    kit: CudaKit | None
    stream: Any


class ManagerReduction:
    """The comm hook's state: the manager, the dtype buckets are sent in (None: their own), and the
    thread that completes the buckets' futures (see [Note: a clean exit])."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self.wire_dtype: torch.dtype | None = None
        self.started = False  # set by the first bucket's hook; the dtype is fixed from then on
        # Put by the hook (autograd's thread), taken by the completion thread; None stops it.
        self._launched: queue.SimpleQueue[_InFlight | None] = queue.SimpleQueue()
        thread = threading.Thread(target=_complete_in_order, args=(self._launched,), daemon=True,
                                  name="overlapddp-torchft-completion")
        thread.start()
        # Runs when this state is collected or, at the latest, at interpreter exit (atexit).
        self.stop = weakref.finalize(self, _stop_and_join, self._launched, thread)

    def launch(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.started = True
        sent = buffer if self.wire_dtype is None else buffer.to(self.wire_dtype)
        work = self.manager.allreduce(sent)
        kit = CudaKit(buffer.device) if buffer.is_cuda else None
        # On CUDA the future records an event where it is set, which the fence's stream waits on.
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future() if kit is None else kit.new_future()
        self._launched.put(_InFlight(work, buffer, sent, future, kit, None if kit is None else kit.current_stream()))
        return future


def _stop_and_join(launched: queue.SimpleQueue, thread: threading.Thread) -> None:
    """Let the completion thread finish the buckets already launched, then end it, and wait for it.

    [Note: a clean exit]
    A collective's work must be freed while the interpreter is whole: gloo's work, released by a
    thread that the interpreter's teardown wakes, aborts the process ("terminate called without an
    active exception"). So the completion thread drops each work as soon as its bucket is complete
    (it holds none while it waits for the next), and it is stopped and joined when its state goes or
    at exit, from ``atexit`` (``weakref.finalize``), before teardown. The join waits for the buckets
    still in flight, each bounded by the manager's collective timeout.
    """
    launched.put(None)
    if thread is not threading.current_thread():
        thread.join()


def _complete_in_order(launched: queue.SimpleQueue) -> None:
    """Complete each launched bucket on this thread, in launch order, until told to stop.

    [Note: why a thread waits]
    The manager's work divides by the participants and reports errors in callbacks that it arms
    only once its collective has finished (``work.wait()`` does both; armed earlier, on a collective
    still running, they fail). Waiting here keeps backward free, as the hook must not wait inline.
    A failed or timed-out collective is reported to the manager by ``work.wait()``, and the bucket's
    future is still set (to the bucket, whose contents no replica will apply: should_commit() is
    False), so backward ends and the step is skipped instead of raising in the training loop.
    On CUDA this thread runs on the stream the work was made on: torchft's ``wait()`` asserts it, and
    queues its waits and division there, after which the copy back and the future's event go.
    """
    while _complete_next(launched):
        pass  # each bucket lives in _complete_next's frame only (see [Note: a clean exit])


def _complete_next(launched: queue.SimpleQueue) -> bool:
    """Wait for the next launched bucket and set its future; False once told to stop."""
    item: _InFlight | None = launched.get()
    if item is None:
        return False
    try:
        with contextlib.nullcontext() if item.kit is None else item.kit.use(item.stream):
            item.work.wait()
            if item.sent is not item.buffer:
                item.buffer.copy_(item.sent)  # back from the wire dtype (DDP's decompression)
            item.future.set_result(item.buffer)
    except Exception as error:  # the manager's own wait reports collective errors; this is ours
        item.future.set_exception(error)
    return True


def manager_allreduce_hook(state: ManagerReduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the live quorum with ``manager.allreduce``; return without waiting
    (see [Note: why a thread waits])."""
    return state.launch(bucket.buffer())


manager_allreduce_hook.issues_one_collective = True  # type: ignore[attr-defined]  # no chaining needed


class DistributedDataParallel(OverlapDDP):
    """OverlapDDP whose buckets are reduced by a torchft ``Manager``; torchft's DDP's arguments.

    ``ddp_kwargs`` are DDP's keyword arguments (those in ``REFUSED`` raise, naming why). As in
    torchft's DDP, unused parameters are searched each forward, which keeps DDP's first bucket
    layout for good (see the module's docstring).
    """

    def __init__(self, manager: Manager, module: nn.Module, **ddp_kwargs: Any) -> None:
        _check_arguments(manager, module, ddp_kwargs)
        fixed = {"process_group": _replica_local_group(), "find_unused_parameters": True}  # replace a given None
        super().__init__(module, **{**ddp_kwargs, **fixed})
        self.manager = manager
        self._manager_reduction = ManagerReduction(manager)
        super().register_comm_hook(self._manager_reduction, cast(CommHook, manager_allreduce_hook))

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Compression through the manager: torch's ``fp16_compress_hook`` and ``bf16_compress_hook``
        (``state`` is ignored: the manager is the group). Other hooks are refused: this wrapper's own
        hook reduces through the manager (torchft's DDP, too, takes no second hook)."""
        known: object = hook
        if known is default_hooks.allreduce_hook:
            return  # what the manager's all-reduce already does
        wire_dtype = _COMPRESSION.get(known)
        if wire_dtype is None:
            name = getattr(hook, "__qualname__", repr(hook))
            raise ValueError(
                f"overlapddp.integrations.torchft: the communication hook {name} cannot be registered: every bucket "
                "is already reduced through the torchft Manager by this wrapper's own hook (torchft's DDP accepts no "
                "other hook either), and another hook's collectives would go to a process group outside the Manager, "
                "so a dead replica would hang them and their failures would not reach should_commit(). Supported: "
                "fp16_compress_hook, bf16_compress_hook (through the manager's all-reduce), allreduce_hook (the "
                "default)."
            )
        if self._manager_reduction.started or self._manager_reduction.wire_dtype is not None:
            raise RuntimeError(
                "overlapddp.integrations.torchft: register_comm_hook must be called once, before the first backward "
                f"(found wire dtype {self._manager_reduction.wire_dtype}, started={self._manager_reduction.started})."
            )
        self._manager_reduction.wire_dtype = wire_dtype

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        _refuse("_register_builtin_comm_hook", "built-in hooks reduce on the process group, outside the manager")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *, overlap: bool = False, shard: bool = False,
                         **kwargs: Any) -> OptimizerGuard | OverlappedOptimizer | ShardedOptimizer:
        """The guard, as OverlapDDP's; ``overlap=True`` is refused: it would update the parameters
        during backward, before ``manager.should_commit()`` can say whether the step counts."""
        if overlap:
            _refuse("attach_optimizer(overlap=True)", "each bucket's update would run before should_commit() decides "
                    "whether the step is applied, and an update cannot be taken back")
        if shard:
            _refuse("attach_optimizer(shard=True)", "each replica group would own shards of a quorum that changes "
                    "from step to step, and a shard's update runs before should_commit() decides")
        return super().attach_optimizer(optimizer, **kwargs)

    def count_tokens(self, tokens: int) -> None:
        _refuse("count_tokens", "the global token count is an all-reduce outside the manager; divide by "
                "manager.num_participants() in the loss instead")

    def join(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("join()", "a replica that runs out of data leaves the quorum instead (torchft divides by the "
                "participants of each step)")

    def __getstate__(self) -> NoReturn:
        _refuse("pickling or copy.deepcopy", "a copy cannot hold the manager; wrap a copy of the module again")


def _refuse(what: str, why: str) -> NoReturn:
    raise ValueError(f"overlapddp.integrations.torchft: {what} is not supported: {why}.")


def _check_arguments(manager: object, module: object, ddp_kwargs: dict[str, Any]) -> None:
    if not isinstance(manager, Manager):
        raise TypeError(
            f"overlapddp.integrations.torchft.DistributedDataParallel(manager, module, ...): manager must be a "
            f"torchft.Manager, got {type(manager).__name__}."
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}.")
    unknown = sorted(set(ddp_kwargs) - _WRAPPER_ARGUMENTS)
    if unknown:
        raise TypeError(
            f"overlapddp.integrations.torchft: {', '.join(map(repr, unknown))} is not an argument of "
            f"DistributedDataParallel; it takes {', '.join(sorted(_WRAPPER_ARGUMENTS - set(REFUSED)))}."
        )
    for name, why in REFUSED.items():
        given = ddp_kwargs.get(name)
        if given is not None and not (name in _ACCEPTED and given == _ACCEPTED[name]):
            _refuse(f"{name}={given!r}" if isinstance(given, (str, bool)) else name, why)
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        _refuse(f"sparse gradients ({', '.join(sparse)} have sparse=True)",
                "sparse buckets are reduced on the process group, outside the manager; build them with sparse=False")


def _replica_local_group() -> dist.ProcessGroup:
    """A process group of this rank alone, for OverlapDDP's own collectives (init sync, buffer
    broadcast, the unused-parameter flags): across replica groups only the manager reduces.

    Without torch.distributed initialized (the usual torchft launch) this initializes a one-rank
    gloo group on an in-memory store; with several ranks per replica group each gets its own.
    """
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() == 1:
        return dist.group.WORLD  # type: ignore[return-value]
    own, _ = dist.new_subgroups(group_size=1)
    return own

