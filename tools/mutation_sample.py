"""Which mutants does CI run? A fixed sample of tools/mutation_run.py's, each with the cheapest tests
that kill it (tests/test_mutation_sample.py runs them).

Chosen by hand, one per operator family over the spawn-free modules, and including each mutant
that survived the first run and needed a new test. Each is found again by its operator and changed
line, so moving the line does not matter; changing the line makes the sample test fail with
LookupError: then pick the replacement from a fresh ``python3 tools/mutation_run.py MODULE``.
"""

from __future__ import annotations

from mutation_run import Sampled

OPTIONS = ("tests/test_options.py",)
VALIDATION = ("tests/bucket/test_comm_hook_validation.py",)
BUCKET = ("tests/bucket/test_comm_hook_bucket.py",)
SYNC_DEFAULT = (
    "tests/test_sync_checks.py::test_a_new_wrapper_and_a_new_flag_check_require_backward_grad_sync_as_ddp_does",
)

SAMPLE: tuple[Sampled, ...] = (
    Sampled("overlapddp/options.py", "core/RemoveDecorator", "@property => ", OPTIONS),
    Sampled(
        "overlapddp/options.py",
        "core/ReplaceAndWithOr",
        "return self.find_unused_parameters and not self.static_graph "
        "=> return self.find_unused_parameters or not self.static_graph",
        OPTIONS,
    ),
    Sampled(
        "overlapddp/options.py",
        "core/ReplaceFalseWithTrue",
        "static_graph: bool = False  # learn the graph in iteration 1, reduce it all at its end "
        "=> static_graph: bool = True  # learn the graph in iteration 1, reduce it all at its end",
        OPTIONS,
    ),
    Sampled(
        "overlapddp/bucket/comm_hook_validation.py",
        "core/ReplaceUnaryOperator_Delete_Not",
        "if not callable(hook): => if  callable(hook):",
        VALIDATION,
    ),
    Sampled(
        "overlapddp/bucket/comm_hook_validation.py",
        "core/ReplaceComparisonOperator_IsNot_Is",
        "if returned is not inspect.Signature.empty and returned not in ( "
        "=> if returned is inspect.Signature.empty and returned not in (",
        VALIDATION,
    ),
    Sampled(
        "overlapddp/bucket/comm_hook_validation.py",
        "core/ReplaceComparisonOperator_Eq_Is",
        "if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS: "
        "=> if comm_hook_type is dist.BuiltinCommHookType.FP16_COMPRESS:",
        VALIDATION,
    ),
    Sampled(
        "overlapddp/bucket/comm_hook.py",
        "core/ReplaceComparisonOperator_Is_Eq",
        'return hook in UNCHAINED_HOOKS or getattr(hook, "issues_one_collective", False) is True '
        '=> return hook in UNCHAINED_HOOKS or getattr(hook, "issues_one_collective", False) == True',
        BUCKET,
    ),
    Sampled(
        "overlapddp/bucket/comm_hook.py",
        "core/NumberReplacer",
        "self._buffer.narrow(0, off, length).view(param.shape) => self._buffer.narrow( 1, off, length).view(param.shape)",  # noqa: E501 (the line as cosmic-ray changes it)
        BUCKET,
    ),
    Sampled(
        "overlapddp/sync_checks.py",
        "core/ReplaceTrueWithFalse",
        "self.requested = True  # require_backward_grad_sync, as the user last set it "
        "=> self.requested = False  # require_backward_grad_sync, as the user last set it",
        SYNC_DEFAULT,
    ),
)
