#!/usr/bin/env python3
"""Mutation check: does the test suite catch realistic single bugs in overlapddp?

Each mutation below is one bug a change to the reducer, the fence, the guard or the optimizer
paths could plausibly introduce, written as an exact snippet of the package and its replacement.
For each, the repository is copied to a scratch directory, the snippet is replaced there (it must
occur exactly once, so the list cannot silently rot), and only the tests chosen to catch that bug
run against the copy (``pytest -x -q``, ``PYTHONPATH`` set to the copy). A mutation is *killed*
when a test fails and *survives* when they all pass. Outside CI; run it before ending any change
to those paths::

    python3 tools/mutations.py                 # every mutation, one at a time
    python3 tools/mutations.py --jobs 2        # two at a time
    python3 tools/mutations.py --only ready_order_not_broadcast
    python3 tools/mutations.py --list          # names, files and tests, nothing run
    python3 tools/mutations.py --baseline      # first run every selected test unmutated: all must pass

Exit status 1 when a mutation survived, timed out or could not run, or a snippet no longer
occurs exactly once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "overlapddp"
DEFAULT_TIMEOUT_S = 900  # per mutation; run_ranks fails a hung spawn well before this
COPY_IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", "build", "dist", "img")

READY_ORDER = "tests/layout/test_ready_order.py::test_every_rank_uses_the_layout_built_from_rank_0s_ready_order"
READY_VALUES = "tests/layout/test_ready_order.py::test_ranks_with_different_ready_orders_stay_bit_equal_to_ddp"
GUARD = "tests/optim/test_guard.py::test_guard_raises_a_clear_error_naming_the_problem_and_rank"
OVERLAP = "tests/optim/test_optimizer_overlap.py"
HANDED_OVER = "tests/test_race.py::test_each_collective_is_handed_the_complete_bucket_as_in_ddp"
LOOPS = "tests/test_loops.py::test_gan_steps_and_reentrant_checkpoints_match_ddp"
JOIN_WS2 = "tests/test_join.py::test_join_with_uneven_inputs_is_bit_equal_to_ddp_every_step_and_after[2]"
STEM_FIRST = "tests/test_compile.py::test_every_bucket_but_the_stems_launches_in_the_first_half_of_a_compiled_backward"
HOOK_VALUES = "tests/bucket/test_comm_hooks.py::test_hook_parameters_and_buffers_equal_ddp_after_every_step"
HOOK_ORDER = ("tests/test_option_pairs.py::"
              "test_collectives_started_between_a_hooks_callbacks_keep_one_order_on_every_rank")
USER_INPUTS = "tests/test_user_inputs.py::test_user_inputs_and_outputs_are_bit_equal_to_ddp_in_every_mode"
SHARDED_WS2 = "tests/shard/test_sharded_optimizer.py::test_every_line_of_a_ddp_loop_is_bit_equal_with_the_optimizers_sharded[2]"
SHARDED_RESUME = "tests/shard/test_sharded_optimizer.py::test_checkpoints_resume_bit_exact_across_world_sizes_2_and_3"
SHARDED_ONE_RANK = ("tests/shard/test_sharded_optimizer_one_rank.py::"
                    "test_each_owned_update_is_launched_at_once_and_the_others_are_left_to_their_owners")
TOKENS_EXACT = "tests/bucket/test_token_weighting.py::test_token_weighting_is_bit_equal_to_ddp_dividing_by_the_global_count_every_step"


@dataclass(frozen=True)
class Mutation:
    """One realistic bug: ``original`` (exactly once in ``path``) becomes ``replacement``."""

    name: str
    bug: str
    path: str  # relative to the repository root
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest node ids, cheapest first


MUTATIONS = (
    Mutation(
        "ready_order_not_broadcast",
        "each rank rebuilds its buckets from its own gradient-ready order, not rank 0's",
        "overlapddp/layout/lifecycle.py",
        "            broadcast_from(order, 0, process_group)\n",
        "",
        (f"{READY_ORDER}[rank_ordered-sgd-cap0.001-3]", f"{READY_VALUES}[rank_ordered-sgd-cap0.001-3]"),
    ),
    Mutation(
        "rebuild_skipped",
        "the ready order is recorded and broadcast, but the buckets are never rebuilt from it",
        "overlapddp/layout/lifecycle.py",
        "            adopt(rebuilt_plan(self._params, self._sparse_gradient, self._caps, self._rebuilt_from))",
        "            pass",
        (f"{READY_ORDER}[rank_ordered-sgd-cap0.001-2]",),
    ),
    Mutation(
        "scaling_skipped",
        "gradients enter the buckets unscaled: the reduction sums instead of averaging",
        "overlapddp/bucket/storage.py",
        "                if multiply_by is not None:\n                    self.buffer.mul_(multiply_by)",
        "                pass",
        (f"{READY_VALUES}[rank_ordered-sgd-cap0.001-2]",),
    ),
    Mutation(
        "copy_out_skipped",
        "the reduced values are never copied into param.grad (each rank steps on its local gradient)",
        "overlapddp/bucket/storage.py",
        "                foreach_copy_([self.params[i].grad for i in chosen], reduced)",
        "                pass",
        (f"{READY_VALUES}[rank_ordered-sgd-cap0.001-2]",),
    ),
    Mutation(
        "wait_skipped",
        "completing a bucket hands out its buffer without waiting for the collective",
        "overlapddp/fence.py",
        "        value = self._wait(future)",
        "        value = self._buffers[bucket]",
        ("tests/test_race.py::test_fenced_training_matches_ddp_and_synchronous_reference_every_step_every_repetition"
         "[launch-None]",),
    ),
    Mutation(
        "launch_before_copy_in",
        "a complete bucket's collective starts before its gradients are copied into its buffer",
        "overlapddp/fence.py",
        "        if fill is not None:\n            self.fill(bucket, fill)\n        if bucket not in self._filled:\n"
        "            raise RuntimeError(f\"Bucket {bucket} was launched before it was filled.\")\n"
        "        self._filled.discard(bucket)\n        self._start(bucket, start)\n",
        "        self._start(bucket, start)\n        if fill is not None:\n            self.fill(bucket, fill)\n"
        "        self._filled.discard(bucket)\n",
        (HANDED_OVER,),
    ),
    Mutation(
        "hook_chaining_dropped",
        "each bucket's comm hook starts as soon as the bucket is ready, not after the previous hook chain",
        "overlapddp/bucket/reduction.py",
        "        after = self._hook_future if chained else None",
        "        after = None",
        ("tests/bucket/test_comm_hooks.py::test_hook_chains_run_one_bucket_at_a_time",),
    ),
    Mutation(
        "no_sync_guard_weakened",
        "the guard refuses no_sync gradients only when no reduction ran since the last step",
        "overlapddp/optim/guard.py",
        "        if self._reducer.local_gradients_since_reduction:",
        "        if self._reducer.local_gradients_since_reduction and self._reducer.reductions == self._stepped_at:",
        (f"{GUARD}[first_step_after_synchronized_then_no_sync-accumulated under no_sync()]",),
    ),
    Mutation(
        "guard_in_flight_check_removed",
        "step() may read gradients while their buckets are still being reduced",
        "overlapddp/optim/guard.py",
        '        """Raise unless ``action`` may read the gradients now."""\n        busy = self._reducer.unfinished_buckets()',
        '        """Raise unless ``action`` may read the gradients now."""\n        busy = []',
        (f"{GUARD}[step_during_backward-are still being reduced]",),
    ),
    Mutation(
        "guard_stale_check_removed",
        "a second step() reuses the gradients the previous step already used",
        "overlapddp/optim/guard.py",
        "        if self._reducer.reductions == self._stepped_at:\n            raise RuntimeError(\n"
        '                f"{action} would read stale',
        "        if False:\n            raise RuntimeError(\n"
        '                f"{action} would read stale',
        (f"{GUARD}[second_step_same_gradients-already used by the previous step]",),
    ),
    Mutation(
        "write_during_reduction_unchecked",
        "a gradient changed while its bucket was reduced (clip inside backward) is silently overwritten",
        "overlapddp/bucket/pipeline.py",
        "            shared.write_watch.check(self.index)\n",
        "",
        (f"{GUARD}[clip_during_backward-were changed on rank]",),
    ),
    Mutation(
        "no_sync_ignored",
        "no_sync() leaves synchronization on: every micro-step is reduced",
        "overlapddp/wrapper.py",
        "        self.require_backward_grad_sync = False\n        try:",
        "        try:",
        (f"{GUARD}[step_after_no_sync_only-accumulated under no_sync()]",),
    ),
    Mutation(
        "buffers_not_broadcast",
        "forward no longer broadcasts rank 0's buffers (BatchNorm statistics drift apart)",
        "overlapddp/wrapper.py",
        "            self._broadcast_buffers(common_rank(self, True) if self._join_config.enable else 0)",
        "            pass",
        (JOIN_WS2,),
    ),
    Mutation(
        "init_sync_skipped",
        "the constructor does not broadcast rank 0's parameters and buffers",
        "overlapddp/construction.py",
        "        broadcast_state(construction.synchronized, buffers, 0, group)\n",
        "",
        ("tests/test_wrapper.py::test_init_sync_broadcasts_rank0_parameters_and_buffers",),
    ),
    Mutation(
        "unused_params_not_marked",
        "find_unused_parameters: the parameters a forward did not use are never marked ready",
        "overlapddp/reducer.py",
        "            for unused in iteration.unused:\n                self._count(unused)",
        "            pass",
        (JOIN_WS2,),
    ),
    Mutation(
        "unused_grads_written",
        "find_unused_parameters: gradients no rank produced are written (zeros) instead of left None",
        "overlapddp/reducer.py",
        "write = [self._globally_used(i) for i in pipeline.members]",
        "write = [True for i in pipeline.members]",
        ("tests/test_parity.py::test_parameters_and_buffers_equal_ddp_after_every_step"
         "[branchy-sgd-default-find_unused_parameters=True-2]",),
    ),
    Mutation(
        "join_divides_by_initial_world_size",
        "under Join, gradients are averaged over all ranks even when told to count the remaining ones",
        "overlapddp/bucket/reduction.py",
        "        self._training_ranks_work = None if divide_by_initial_world_size else work",
        "        self._training_ranks_work = None",
        (JOIN_WS2,),
    ),
    Mutation(
        "ignored_params_not_stepped",
        "overlap=True without clipping or scaling never updates parameters the wrapper ignores",
        "overlapddp/optim/overlap.py",
        "            if outside:\n                self._update_bucket(outside)",
        "            pass",
        (f"{OVERLAP}::test_overlapped_updates_step_ignored_parameters_too_bit_equal_to_ddp_then_step",),
    ),
    Mutation(
        "overlapped_update_before_copy_out",
        "overlap=True updates a bucket's parameters before its reduced gradients are written",
        "overlapddp/reducer.py",
        "        self.consumers.append(consumer)\n",
        "        self.consumers.insert(0, consumer)\n",
        (f"{OVERLAP}::test_overlapped_updates_are_bit_equal_to_ddp_then_step[2]",),
    ),
    Mutation(
        "overlapped_updates_ignore_the_scaler",
        "overlap=True with a GradScaler updates each bucket before the scaler has seen every gradient",
        "overlapddp/optim/overlap.py",
        "        return self.max_grad_norm is not None or self._unscaler is not None",
        "        return self.max_grad_norm is not None",
        (f"{OVERLAP}::test_overlapped_loss_scaling_is_bit_equal_to_unscale_clip_then_scaler_step[None]",),
    ),
    Mutation(
        "init_buffers_skipped_without_forward_sync",
        "forward_sync_buffers=False also skips the buffer broadcast at construction (DDP still does it)",
        "overlapddp/construction.py",
        "        return forward_sync_buffers, True\n",
        "        return forward_sync_buffers, forward_sync_buffers\n",
        ("tests/test_wrapper.py::test_forward_sync_buffers_false_still_broadcasts_buffers_at_init_as_ddp_does",),
    ),
    Mutation(
        "copy_resumes_grad_sync",
        "a copy or pickle of a wrapper with require_backward_grad_sync=False comes back reducing",
        "overlapddp/pickling.py",
        "    recipe: ReducerRecipe = attributes[\"_recipe\"]\n",
        "    recipe: ReducerRecipe = attributes[\"_recipe\"]\n"
        '    state["_sync_flags"] = type(state["_sync_flags"])()\n',
        ("tests/test_pickling.py::test_a_copy_keeps_require_backward_grad_sync_as_ddp_copies_it[deepcopy]",),
    ),
    Mutation(
        "guard_in_place_zero_grad_unchecked",
        "zero_grad(set_to_none=False) during backward zeroes the buckets being reduced (gradient_as_bucket_view)",
        "overlapddp/optim/guard.py",
        "    def _zero_grad(self, *args: Any, **kwargs: Any) -> Any:\n        busy = self._reducer.unfinished_buckets()\n",
        "    def _zero_grad(self, *args: Any, **kwargs: Any) -> Any:\n"
        '        busy = self._reducer.unfinished_buckets() if kwargs.get("set_to_none", True) else []\n',
        (f"{GUARD}[zero_grad_in_place_during_backward-optimizer.zero_grad() was called while buckets]",),
    ),
    Mutation(
        "delayed_multiplies_by_reciprocal",
        "the delayed all-reduce multiplies by 1/world_size instead of DDP's true division (differs at 3)",
        "overlapddp/delayed_reduction.py",
        "storage.copy_in([p.grad for p in self.params], None, group.size())",
        "storage.copy_in([p.grad for p in self.params], 1.0 / group.size(), None)",
        ("tests/test_delayed.py::test_bit_equal_to_stock_ddp_with_the_delay_at_world_size_3",),
    ),
    Mutation(
        "joined_rank_ignores_no_sync",
        "a joined rank shadows every backward, also the others' no_sync ones: the collectives mismatch",
        "overlapddp/join.py",
        "        if should_sync:\n            model._shadow_backward()\n",
        "        model._shadow_backward()\n",
        (JOIN_WS2,),
    ),
    Mutation(
        "compile_cut_dropped",
        "the compile splitter drops one cut: a later bucket launches only at the end of the compiled backward",
        "overlapddp/compile_split.py",
        "        pieces = _with_outputs(nodes, cuts)\n",
        "        pieces = _with_outputs(nodes, cuts[1:])\n",
        (f"{STEM_FIRST}[OverlapDDP(compile(model))]",),
    ),
    Mutation(
        "hook_aliased_grads_divided",
        "gradient_as_bucket_view with a comm hook: kept gradients are divided by the reducer and the hook",
        "overlapddp/bucket/reduction.py",
        "            alias_divide_by=self._divide_by if no_hook and not batched else None,\n",
        "            alias_divide_by=self._divide_by if not batched else None,\n",
        (f"{HOOK_VALUES}[cnn_bn-sgd-cap0.001-gradient_as_bucket_view=True-hook=allreduce-keep_grads-2]",),
    ),
    Mutation(
        "hook_result_not_copied_into_views",
        "gradient_as_bucket_view: a hook's result that is another tensor (fp16 compression) never reaches the views",
        "overlapddp/bucket/storage.py",
        "                if result is not self.buffer and chosen:\n"
        "                    foreach_copy_([self.views[i] for i in chosen], reduced)\n",
        "",
        (f"{HOOK_VALUES}[mlp-sgd-default-gradient_as_bucket_view=True-hook=fp16_wrapper(allreduce)-keep_grads-2]",),
    ),
    Mutation(
        "buffer_broadcast_bumps_versions",
        "the forward's buffer broadcast bumps version counters: a GAN step's 2nd forward breaks the 1st's backward",
        "overlapddp/module_sync.py",
        "    with preserving_versions(buffers):\n        broadcast_coalesced(buffers, src, process_group)\n",
        "    broadcast_coalesced(buffers, src, process_group)\n",
        (f"{LOOPS}[2]",),
    ),
    Mutation(
        "reentrant_checkpoint_not_seen",
        "find_unused_parameters takes parameters behind a reentrant checkpoint for unused",
        "overlapddp/param_usage.py",
        '        hidden = hidden or getattr(node, "_forward_cls", None) is CheckpointFunction\n',
        "",
        (f"{LOOPS}[2]",),
    ),
    Mutation(
        "progress_waiting_unrecorded",
        "a rank writes its 'waiting for bucket' record only when the collective is already done",
        "overlapddp/progress.py",
        "        if self._store is None or future.done():\n            return\n",
        "        if self._store is None or not future.done():\n            return\n",
        ("tests/test_desync.py::test_a_rank_really_waiting_for_a_bucket_says_so_in_its_record",),
    ),
    Mutation(
        "init_sync_skips_frozen_parameters",
        "the init-time broadcast covers only parameters that require grad: a frozen layer stays per rank",
        "overlapddp/construction.py",
        "synchronized=[p for _, p in named],",
        "synchronized=[p for _, p in trainable],",
        ("tests/test_wrapper.py::test_init_sync_broadcasts_frozen_parameters_as_ddp_does",),
    ),
    Mutation(
        "ignored_alias_drops_tied_weight",
        "a tied weight ignored under one of its names is dropped from the buckets (DDP reduces it under the other)",
        "overlapddp/construction.py",
        "if param.requires_grad and matched_as not in ignored and id(param) not in delayed:",
        "if param.requires_grad and matched_as not in ignored and id(param) not in delayed and not any(\n"
        "                    n in ignored for n, q in module.named_parameters(remove_duplicate=False) if q is param):",
        ("tests/test_wrapper.py::test_the_reduced_parameters_are_ddps_in_its_order_whatever_names_are_ignored",),
    ),
    Mutation(
        "mixed_precision_casts_integer_inputs",
        "mixed precision casts integer and bool inputs to param_dtype too (embedding indices, masks)",
        "overlapddp/mixed_precision.py",
        "if self.param_dtype is None or not tensor.is_floating_point() or tensor.dtype == self.param_dtype:",
        "if self.param_dtype is None or tensor.dtype == self.param_dtype:",
        ("tests/test_mixed_precision.py::test_integer_and_bool_inputs_keep_their_dtype[2]",),
    ),
    Mutation(
        "token_count_not_reset",
        "count_tokens: the local count is not reset after its all-reduce (later steps divide by a growing total)",
        "overlapddp/bucket/token_weighting.py",
        "                self._copied.record(self._stream)\n        self.local = 0\n",
        "                self._copied.record(self._stream)\n",
        (f"{TOKENS_EXACT}[2]",),
    ),
    Mutation(
        "token_weighting_divides_twice_when_batched",
        "count_tokens with batched_grad_copy: each bucket is multiplied by 1/N while copied and divided by N",
        "overlapddp/bucket/reduction.py",
        "            self._scale = None if batched else 1.0 / self._divide_by\n",
        "            self._scale = 1.0 / self._divide_by\n",
        (f"{TOKENS_EXACT}[2]",),
    ),
    Mutation(
        "lightning_manual_arms_under_toggle_model",
        "Lightning manual optimization arms the reduction even under toggle_model(sync_grad=False)",
        "overlapddp/integrations/trainer_strategy.py",
        "        if torch.is_grad_enabled() and model.require_backward_grad_sync:\n",
        "        if torch.is_grad_enabled():\n",
        ("tests/integrations/test_frameworks.py::test_lightning_manual_accumulation_under_toggle_model_reduces_once_per_step_as_ddp"
         "[lightning]",),
    ),
    Mutation(
        "find_unused_starts_in_one_bucket",
        "find_unused_parameters=True starts in one bucket as static_graph does (DDP: cap-sized, never rebuilt)",
        "overlapddp/layout/plan.py",
        "        if not searches_unused_each_forward:\n            return [sys.maxsize]\n",
        "        return [sys.maxsize]\n",
        (f"{LOOPS}[3]",),
    ),
    Mutation(
        "static_graph_unused_prepended",
        "static_graph: the parameters that never fired go first in the rebuilt ready order (DDP appends them)",
        "overlapddp/layout/lifecycle.py",
        "            self._ready_order += list(unused)\n",
        "            self._ready_order = list(unused) + self._ready_order\n",
        (f"{LOOPS}[2]",),
    ),
    Mutation(
        "undefined_gradient_counted_as_used",
        "a hook that fires with an undefined gradient (an output the loss never reached) counts as a use",
        "overlapddp/reducer.py",
        "        used = self.params[index].grad is not None\n",
        "        used = True\n",
        (f"{USER_INPUTS}[2]",),
    ),
    Mutation(
        "outputs_not_routed_for_unused_search",
        "find_unused_parameters: outputs the loss never reaches leave their parameters' buckets incomplete",
        "overlapddp/wrapper.py",
        "                output = _end_of_backward_trigger(output, None)\n",
        "                pass\n",
        (f"{USER_INPUTS}[2]",),
    ),
    Mutation(
        "delayed_launch_amid_hook_chains",
        "the delayed all-reduce starts at its hook parameter's gradient even while PowerSGD chains issue collectives",
        "overlapddp/reducer.py",
        "        chained = self.reduction.issues_from_callbacks\n",
        "        chained = False\n",
        (HOOK_ORDER,),
    ),
    Mutation(
        "usage_reduction_amid_hook_chains",
        "find_unused_parameters: the usage flags' all-reduce starts with the last bucket amid PowerSGD's chains",
        "overlapddp/reducer.py",
        "                if not self.reduction.issues_from_callbacks:  # else finalize launches it\n",
        "                if True:\n",
        (HOOK_ORDER,),
    ),
    Mutation(
        "shard_step_returns_before_the_broadcasts",
        "sharded optimizer: step() returns without waiting for the owners' broadcasts",
        "overlapddp/shard/optimizer.py",
        "        self._wait(launched)\n",
        "",
        (SHARDED_WS2,),
    ),
    Mutation(
        "shard_every_rank_updates_everything",
        "sharded optimizer: every rank updates every parameter (and keeps state for all of them)",
        "overlapddp/shard/optimizer.py",
        "            if owner == self.rank:\n",
        "            if True:\n",
        (SHARDED_ONE_RANK,),
    ),
    Mutation(
        "shard_unreduced_parameters_not_updated",
        "sharded optimizer: a parameter the wrapper does not reduce is updated by no rank",
        "overlapddp/shard/optimizer.py",
        "        if self._local:\n",
        "        if False:\n",
        (SHARDED_WS2,),
    ),
    Mutation(
        "shard_consolidated_from_this_rank",
        "sharded state_dict(): each entry taken from this rank instead of its owner",
        "overlapddp/shard/state.py",
        "            held = everyone[owner].get(index)\n",
        "            held = everyone[rank].get(index)\n",
        (SHARDED_WS2,),
    ),
    Mutation(
        "shard_checkpoint_reads_the_others_entries",
        "sharded DCP load: each rank reads the entries of the parameters it does not own",
        "overlapddp/shard/checkpoint.py",
        "            if optimizer.owner_of(index_of[name]) not in (None, optimizer.rank):\n",
        "            if optimizer.owner_of(index_of[name]) in (None, optimizer.rank):\n",
        (SHARDED_RESUME,),
    ),
    Mutation(
        "shard_broadcast_failure_unnamed",
        "sharded optimizer: a failed broadcast raises gloo's bare error, naming no parameter or rank",
        "overlapddp/shard/optimizer.py",
        "                raise RuntimeError(\n                    f\"The broadcast of {names} from its owner",
        "                raise\n                raise RuntimeError(\n                    f\"The broadcast of {names} from its owner",
        ("tests/test_reliability.py::test_survivors_of_a_rank_dead_before_its_sharded_step_raise_naming_the_parameter_and_the_rank",),
    ),
)


def snippet_problems(root: Path = REPO) -> list[str]:
    """Each mutation whose snippet does not occur exactly once in its file, described."""
    problems = []
    for mutation in MUTATIONS:
        if not mutation.path.startswith(f"{PACKAGE}/"):
            problems.append(f"{mutation.name}: {mutation.path} is outside the package")
            continue
        text = (root / mutation.path).read_text()
        count = text.count(mutation.original)
        if count != 1:
            problems.append(f"{mutation.name}: its snippet occurs {count} times in {mutation.path}, expected once")
    return problems


def _pytest(scratch: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, str, float]:
    """Run ``tests`` against ``scratch``: (status, the first failure or last line, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(scratch))
    command = [sys.executable, "-m", "pytest", "-x", "-q", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout_s:g} s", time.monotonic() - started
    seconds = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    said = failed[0] if failed else (lines[-1] if lines else done.stderr.strip()[-300:])
    status = {0: "passed", 1: "failed"}.get(done.returncode, f"error (pytest exit code {done.returncode})")
    return status, said, seconds


def run_mutation(mutation: Mutation | None, tests: tuple[str, ...], timeout_s: float) -> tuple[str, str, float]:
    """Apply ``mutation`` (None: none) in a scratch copy of the repository and run ``tests`` there."""
    with tempfile.TemporaryDirectory(prefix="overlapddp-mutant-") as scratch:
        copy = Path(scratch) / "repo"
        shutil.copytree(REPO, copy, ignore=COPY_IGNORE)
        if mutation is not None:
            target = copy / mutation.path
            text = target.read_text()
            if text.count(mutation.original) != 1:
                return "error (snippet not found exactly once)", mutation.path, 0.0
            target.write_text(text.replace(mutation.original, mutation.replacement))
        return _pytest(copy, tests, timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at the same time (default 1)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests; run nothing")
    parser.add_argument("--baseline", action="store_true", help="first check every selected test passes unmutated")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutation")
    args = parser.parse_args(argv)

    known = {m.name: m for m in MUTATIONS}
    unknown = [name for name in args.only or [] if name not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; --list shows them")
    selected = [known[name] for name in args.only] if args.only else list(MUTATIONS)
    if args.list:
        for m in selected:
            print(f"{m.name}: {m.bug}\n  {m.path}\n  " + "\n  ".join(m.tests))
        return 0
    problems = snippet_problems()
    for problem in problems:
        print(f"STALE {problem}")
    if problems:
        return 1

    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in selected for t in m.tests))
        status, said, seconds = run_mutation(None, tests, args.timeout * 2)
        print(f"baseline: {status} in {seconds:.0f} s: {said}", flush=True)
        if status != "passed":
            return 1

    def one(mutation: Mutation) -> tuple[Mutation, str, str, float]:
        status, said, seconds = run_mutation(mutation, mutation.tests, args.timeout)
        verdict = {"failed": "killed", "passed": "SURVIVED"}.get(status, status.upper())
        print(f"{verdict:8} {mutation.name} ({seconds:.0f} s): {said}", flush=True)
        return mutation, verdict, said, seconds

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, selected))
    killed = [m.name for m, verdict, _, _ in results if verdict == "killed"]
    others = [f"{m.name} ({verdict})" for m, verdict, _, _ in results if verdict != "killed"]
    print(
        f"\n{len(killed)}/{len(results)} mutations killed in {time.monotonic() - started:.0f} s"
        + (f"; not killed: {', '.join(others)}" if others else "")
    )
    return 0 if not others else 1


if __name__ == "__main__":
    sys.exit(main())
