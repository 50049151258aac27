"""Which of DDP's behaviour switches are on? The reducer's options, and the rules derived from them.

Every module that asks "does this wrapper search unused parameters each forward?" reads it here,
so the rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReducerOptions:
    """DDP's behaviour switches that change when and how gradients are reduced."""

    find_unused_parameters: bool = False  # search each forward's graph; skip globally unused grads
    static_graph: bool = False  # learn the graph in iteration 1, reduce it all at its end
    gradient_as_bucket_view: bool = False  # param.grad is a view into its bucket, no copy-out
    batched_grad_copy: bool = False  # copy unscaled, then divide each bucket (true division)
    skip_all_reduce_unused_params: bool = False  # never reduce buckets holding only unused params
    tuned_plan: bool = False  # after DDP's rebuild, measure, model and select buckets (layout/tuner.py)

    @property
    def searches_unused_each_forward(self) -> bool:
        """DDP's dynamic unused-parameter search: ``find_unused_parameters`` without a static graph
        (a static graph learns its unused parameters once, in its first iteration). DDP never rebuilds
        its buckets then."""
        return self.find_unused_parameters and not self.static_graph
