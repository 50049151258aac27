"""Which features cannot go together, and why? One table, consulted wherever a feature is switched on.

A feature is switched on at construction (the constructor's arguments), by ``register_comm_hook``,
``count_tokens``, ``join()`` or ``attach_optimizer``. Each of those asks :func:`refuse_pairs` with the
features in force and the one being added; the first row whose pair is among them raises its error,
before any collective. A row whose pair is one feature refuses adding it a second time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection


class Feature(enum.Enum):
    """A switch whose combinations are checked; the value names it as the user wrote it."""

    TUNED_PLAN = "bucket_plan='tuned'"
    SPARSE_GRADIENTS = "sparse gradients"
    UNUSED_SEARCH = "find_unused_parameters=True"  # on a dynamic graph (no static_graph)
    MIXED_PRECISION = "mixed_precision"
    GRADIENT_AS_BUCKET_VIEW = "gradient_as_bucket_view=True"
    DELAYED_ALL_REDUCE = "delay_all_reduce_named_params"
    COMM_HOOK = "a communication hook"
    COUNT_TOKENS = "count_tokens"
    JOIN = "join()"
    OVERLAPPED_OPTIMIZER = "attach_optimizer(overlap=True)"
    SHARDED_OPTIMIZER = "attach_optimizer(shard=True)"


@dataclass(frozen=True)
class Refusal:
    """One refused pair: the error it raises and its message (``{sparse_names}``, ``{hook}`` and
    ``{rank}`` are filled from what the caller knows)."""

    pair: frozenset[Feature]
    error: type[Exception]
    message: str


def _mixed_precision_with(name: str) -> str:
    return (
        f"mixed_precision cannot be combined with {name}: gradients change dtype and storage at every "
        "forward and bucket (a bucket view cannot stay the gradient, a sparse bucket is the gradient; "
        "unused-parameter search and the delayed all-reduce track the full-precision accumulators)."
    )


def _refused(first: Feature, second: Feature, error: type[Exception], message: str) -> Refusal:
    return Refusal(frozenset((first, second)), error, message)


F = Feature
# Every refused combination, checked in this order.
REFUSALS: tuple[Refusal, ...] = (
    _refused(F.TUNED_PLAN, F.SPARSE_GRADIENTS, ValueError,
             "bucket_plan='tuned' groups gradients into flat buffers, but {sparse_names} produce sparse gradients, "
             "which DDP's layout keeps alone in their buckets; use bucket_plan='ddp'."),
    _refused(F.TUNED_PLAN, F.UNUSED_SEARCH, ValueError,
             "bucket_plan='tuned' re-plans the buckets after DDP's ready-order rebuild, which "
             "find_unused_parameters=True never does on a dynamic graph; use bucket_plan='ddp', or "
             "static_graph=True if the graph does not change."),
    _refused(F.MIXED_PRECISION, F.GRADIENT_AS_BUCKET_VIEW, ValueError,
             _mixed_precision_with("gradient_as_bucket_view=True")),
    _refused(F.MIXED_PRECISION, F.UNUSED_SEARCH, ValueError, _mixed_precision_with("find_unused_parameters=True")),
    _refused(F.MIXED_PRECISION, F.DELAYED_ALL_REDUCE, ValueError,
             _mixed_precision_with("delay_all_reduce_named_params")),
    _refused(F.MIXED_PRECISION, F.SPARSE_GRADIENTS, ValueError, _mixed_precision_with("sparse gradients")),
    # As DDP: mixed precision's reduction is the comm hook (the user never registered one, so say so).
    _refused(F.COMM_HOOK, F.MIXED_PRECISION, RuntimeError,
             "register_comm_hook or register_builtin_comm_hook can only be called once: mixed_precision registered "
             "its reduction as the comm hook (cast to reduce_dtype, sum, division by the world size), as stock "
             "DDP does; reduce without mixed_precision to use a hook of your own."),
    Refusal(frozenset((F.COMM_HOOK,)), RuntimeError,
            "register_comm_hook or register_builtin_comm_hook can only be called once."),
    _refused(F.COUNT_TOKENS, F.MIXED_PRECISION, ValueError,
             "count_tokens cannot be combined with mixed_precision (rank {rank}): its reduction (cast, sum and "
             "division by the world size in reduce_dtype) is a communication hook; nothing would divide their "
             "gradients by the global token count."),
    _refused(F.COUNT_TOKENS, F.DELAYED_ALL_REDUCE, ValueError,
             "count_tokens cannot be combined with delay_all_reduce_named_params (rank {rank}): the delayed "
             "parameters are all-reduced apart from the buckets and divided by the world size; nothing would "
             "divide their gradients by the global token count."),
    _refused(F.COUNT_TOKENS, F.COMM_HOOK, RuntimeError,
             "count_tokens cannot be combined with the communication hook {hook}: the hook reduces each bucket "
             "its own way, so nothing would divide by the global token count."),
    _refused(F.JOIN, F.DELAYED_ALL_REDUCE, ValueError,
             "join() cannot be used with delay_all_reduce_named_params: a joined rank cannot know where, among "
             "the buckets' collectives, the others start the delayed all-reduce (stock DDP does not shadow it)."),
    _refused(F.JOIN, F.COUNT_TOKENS, ValueError,
             "join() cannot be used with count_tokens (rank {rank}): a joined rank shadows the buckets' all-reduces "
             "but not the token count's, so the ranks' collectives would no longer pair; drop count_tokens or run "
             "equal numbers of micro-batches per rank."),
    _refused(F.JOIN, F.SHARDED_OPTIMIZER, ValueError,
             "join() cannot be used with a sharded optimizer (attach_optimizer(..., shard=True)): in step() every rank "
             "waits for the broadcasts of the parameters the others own, and a joined rank never sends its own."),
    _refused(F.SHARDED_OPTIMIZER, F.OVERLAPPED_OPTIMIZER, RuntimeError,
             "attach_optimizer(shard=True) and attach_optimizer(overlap=True) cannot be combined on one model "
             "(rank {rank}): an overlapped update runs during backward, a sharded one in step(); attach every "
             "optimizer of the model the same way (detach() the overlapped one first)."),
)


def refuse_pairs(in_force: Collection[Feature], adding: Feature | None = None, **known: object) -> None:
    """Raise the first refused combination among ``in_force`` (and ``adding``, which must be in every
    pair checked when given: at construction, every pair among the constructor's features counts)."""
    for refusal in REFUSALS:
        if adding is None:
            applies = len(refusal.pair) == 2 and refusal.pair <= set(in_force)
        elif len(refusal.pair) == 1:
            applies = refusal.pair == {adding} and adding in in_force  # the same feature a second time
        else:
            applies = adding in refusal.pair and refusal.pair - {adding} <= set(in_force)
        if applies:
            raise refusal.error(refusal.message.format_map(_Known(known)))


class _Known(dict):
    """What a caller knows for a message; a placeholder it did not fill reads as 'unknown' (a refusal
    must never fail on its own message)."""

    def __missing__(self, key: str) -> str:
        return "unknown"
