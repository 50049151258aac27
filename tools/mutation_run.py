#!/usr/bin/env python3
"""Which generated single-point mutants of overlapddp do the tests kill, module by module?

A wrapper around cosmic-ray (the ``test`` extra pins it; docs/testing.md says why cosmic-ray): for
each module in ``MODULE_TESTS`` it writes a cosmic-ray config into a scratch copy of the repository
(the working tree is never mutated), runs ``cosmic-ray init``, drops the operators in
``EXCLUDED_OPERATORS`` (``cr-filter-operators``), runs ``cosmic-ray exec`` there with one worker,
and reads the session back. The tests for a module come from the map below, not from coverage:
most tests spawn their ranks, and no in-process coverage sees what runs in them. Mutants whose
change cannot alter behaviour are listed in tools/mutation_equivalents.py with their argument::

    python3 tools/mutation_run.py                          # every mapped module
    python3 tools/mutation_run.py overlapddp/options.py    # some modules
    python3 tools/mutation_run.py --list                   # modules, tests, mutant counts; nothing run
    python3 tools/mutation_run.py --survivors              # also print each survivor's diff
    python3 tools/mutation_run.py --resume MODULE          # finish a stopped session of an unchanged module

Sessions and the report (``report.md``) go to ``results/mutation/``. Exit status 1 when a
non-equivalent mutant survived or a module's tests fail unmutated.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from mutation_equivalents import EQUIVALENTS  # noqa: E402

RESULTS = REPO / "results" / "mutation"
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "build", "dist", "img", "results"
)
PYTEST_ARGS = "-x -q -p no:cacheprovider -p no:randomly"
PYTEST = f"-m pytest {PYTEST_ARGS}"
WARM_SOCKET = "warm-pytest.sock"  # in the scratch copy

# Replacements that make no realistic slip and multiply the count (x ** y, x >> y, x ^ y ...), and
# the two operators that insert or swap variable names at random (not deterministic across runs).
EXCLUDED_OPERATORS = (
    r"core/ReplaceBinaryOperator_.*_(Pow|RShift|LShift|BitOr|BitAnd|BitXor|Mod|FloorDiv)$",
    r"core/ReplaceBinaryOperator_(Pow|RShift|LShift|BitOr|BitAnd|BitXor|Mod|FloorDiv)_.*",
    r"core/VariableInserter",
    r"core/VariableReplacer",
)

# module -> pytest node ids that exercise it, cheapest first (``-x`` stops at the first failure).
# Spawn-free tests first: a spawn of two or three ranks costs seconds per mutant.
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "overlapddp/options.py": (
        "tests/test_options.py",
        "tests/layout/test_bucket_plan.py",
    ),
    "overlapddp/layout/plan.py": ("tests/layout/test_bucket_plan.py", "tests/layout/test_plan_selection.py"),
    "overlapddp/bucket/comm_hook_validation.py": (
        "tests/bucket/test_comm_hook_validation.py",
        "tests/bucket/test_comm_hooks.py::test_register_rejects_what_ddp_rejects_with_the_same_exception_type",
        "tests/bucket/test_comm_hooks.py::test_hook_without_bucket_parameter_error_is_also_a_type_error",
        "tests/bucket/test_comm_hooks.py::test_correctly_annotated_hook_is_accepted",
        "tests/bucket/test_comm_hooks.py::test_registering_twice_raises_like_ddp",
        "tests/bucket/test_comm_hooks.py::test_bf16_compress_hook_is_accepted_on_gloo",
    ),
    "overlapddp/sync_checks.py": ("tests/test_sync_checks.py",),
    "overlapddp/bucket/comm_hook.py": (
        "tests/bucket/test_comm_hook_bucket.py",
        "tests/bucket/test_comm_hooks.py::test_a_hook_can_declare_that_it_needs_no_chaining",
        "tests/bucket/test_comm_hooks.py::test_hook_chains_run_one_bucket_at_a_time",
        "tests/bucket/test_comm_hooks.py::test_bad_hook_result_raises_naming_hook_and_bucket_on_every_rank",
    ),
    "overlapddp/layout/cost_model.py": ("tests/layout/test_cost_model_unit.py", "tests/layout/test_plan_selection.py", "tests/layout/test_tuned_plan.py"),
    "overlapddp/clock.py": ("tests/test_clock.py", "tests/layout/test_tuner_unit.py", "tests/layout/test_plan_selection.py", "tests/layout/test_tuned_plan.py"),
    "overlapddp/layout/selection.py": ("tests/layout/test_plan_selection.py", "tests/layout/test_tuned_plan.py"),
    "overlapddp/layout/tuner.py": ("tests/layout/test_tuner_unit.py", "tests/layout/test_plan_selection.py", "tests/layout/test_tuned_plan.py"),
    "overlapddp/shard/ownership.py": ("tests/shard/test_shard_ownership.py", "tests/shard/test_sharded_optimizer_one_rank.py"),
    "overlapddp/shard/checks.py": ("tests/shard/test_shard_checks.py", "tests/test_wrapper_unit.py"),
    "overlapddp/shard/state.py": ("tests/shard/test_sharded_optimizer.py",),
    "overlapddp/shard/step_record.py": ("tests/test_reliability.py",),
    "overlapddp/shard/checkpoint.py": ("tests/test_dcp.py", "tests/shard/test_sharded_optimizer.py"),
    "overlapddp/shard/optimizer.py": ("tests/shard/test_sharded_optimizer_one_rank.py", "tests/shard/test_shard_checks.py",
                                      "tests/shard/test_sharded_optimizer.py"),
    "overlapddp/device_streams.py": ("tests/test_device_streams.py", "tests/test_cuda_logic.py", "tests/test_streams.py"),
    "overlapddp/fence.py": ("tests/test_fence_unit.py", "tests/test_cuda_logic.py", "tests/test_race.py", "tests/test_streams.py"),
    "overlapddp/pickling.py": ("tests/test_copy_recipe.py", "tests/test_pickling.py", "tests/test_copies.py"),
    "overlapddp/frames.py": ("tests/test_frames.py", "tests/test_compile_split_unit.py", "tests/test_pickling.py"),
    "overlapddp/delayed_reduction.py": ("tests/test_delayed_unit.py", "tests/test_delayed.py"),
    "overlapddp/join.py": ("tests/test_join_unit.py", "tests/test_join.py"),
    "overlapddp/bucket/gradient_checks.py": ("tests/bucket/test_backend_checks.py", "tests/test_errors.py", "tests/optim/test_guard.py", "tests/test_copies.py"),
    "overlapddp/backend_support.py": ("tests/bucket/test_backend_checks.py", "tests/test_cuda_logic.py", "tests/test_errors.py", "tests/test_sparse.py"),
    "overlapddp/optim/unscaler.py": ("tests/optim/test_bucket_unscaler.py", "tests/optim/test_optimizer_overlap.py", "tests/test_streams.py"),
    "overlapddp/optim/guard.py": ("tests/optim/test_guard_detach.py", "tests/optim/test_guard.py", "tests/test_cuda_logic.py"),
    "overlapddp/optim/overlap.py": ("tests/optim/test_optimizer_overlap_one_rank.py", "tests/optim/test_optimizer_overlap.py", "tests/test_cuda_logic.py"),
    "overlapddp/mixed_precision.py": ("tests/test_mixed_precision_casts.py", "tests/test_mixed_precision.py"),
    "overlapddp/bucket/token_weighting.py": ("tests/bucket/test_token_count.py", "tests/bucket/test_token_weighting.py", "tests/test_option_pairs.py"),
    "overlapddp/bucket/sparse_storage.py": ("tests/bucket/test_sparse_storage.py", "tests/test_sparse.py"),
    "overlapddp/timeline.py": ("tests/test_timeline_unit.py", "tests/test_timeline.py"),
    "overlapddp/progress.py": ("tests/test_progress_unit.py", "tests/test_desync.py", "tests/test_reliability.py"),
    "overlapddp/compile_split.py": (
        "tests/test_compile_split_unit.py",
        "tests/test_compile.py::test_cut_points_close_each_bucket_at_its_earliest_parameter_use",
        "tests/test_compile.py::test_the_compiled_cuts_follow_every_bucket_layout",
        "tests/test_compile.py::test_every_bucket_but_the_stems_launches_in_the_first_half_of_a_compiled_backward",
        "tests/test_compile.py::test_without_splitting_the_first_bucket_launches_at_the_end_of_backward",
        "tests/test_compile.py::test_checkpoint_graph_break_and_graph_options_under_compile_match_ddp",
        "tests/test_compile.py::test_compiled_training_is_bit_equal_to_ddp_in_the_same_form_with_and_without_splits",
        "tests/test_compile.py::test_compiled_autograd_still_reduces_every_backward",
        "tests/test_compile.py::test_inductor_in_both_forms_splits_and_launches_early",
    ),
    "overlapddp/torch_compat.py": ("tests/test_torch_compat.py", "tests/test_wrapper.py", "tests/test_cuda_logic.py", "tests/test_parity.py"),
    "overlapddp/param_usage.py": ("tests/test_usage_map.py", "tests/test_wrapper.py", "tests/test_loops.py", "tests/test_user_inputs.py"),
    "overlapddp/module_sync.py": ("tests/test_module_sync_unit.py", "tests/test_one_rank_parity.py", "tests/test_wrapper.py", "tests/test_join.py", "tests/test_parity.py"),
    "overlapddp/bucket/reduction.py": (
        "tests/bucket/test_bucket_reduction_unit.py", "tests/bucket/test_bucket_pipeline_unit.py", "tests/layout/test_ready_order.py",
        "tests/bucket/test_comm_hooks.py",
        "tests/bucket/test_token_weighting.py", "tests/test_parity.py",
    ),
    "overlapddp/refusals.py": ("tests/test_refusals_unit.py", "tests/test_wrapper_unit.py", "tests/test_construction_unit.py", "tests/test_option_pairs.py"),
    "overlapddp/bucket/consumer.py": (
        "tests/bucket/test_bucket_pipeline_unit.py", "tests/bucket/test_bucket_reduction_unit.py", "tests/test_reducer_unit.py",
        "tests/test_one_rank_parity.py", "tests/bucket/test_comm_hooks.py", "tests/test_parity.py",
    ),
    "overlapddp/optim/takeover.py": ("tests/optim/test_optimizer_overlap_one_rank.py", "tests/optim/test_guard_detach.py", "tests/shard/test_sharded_optimizer_one_rank.py"),
    "overlapddp/bucket/pipeline.py": ("tests/bucket/test_bucket_pipeline_unit.py", "tests/bucket/test_bucket_reduction_unit.py", "tests/test_one_rank_parity.py", "tests/layout/test_ready_order.py", "tests/test_race.py", "tests/test_parity.py"),
    "overlapddp/bucket/storage.py": ("tests/bucket/test_bucket_storage_unit.py", "tests/test_one_rank_parity.py", "tests/layout/test_ready_order.py", "tests/bucket/test_comm_hooks.py", "tests/test_parity.py"),
    "overlapddp/layout/lifecycle.py": ("tests/layout/test_layout_lifecycle_unit.py", "tests/test_one_rank_parity.py", "tests/layout/test_ready_order.py", "tests/test_loops.py", "tests/test_parity.py"),
    "overlapddp/construction.py": (
        "tests/test_construction_unit.py", "tests/test_refusal_order.py", "tests/test_options.py", "tests/test_cuda_logic.py",
        "tests/test_delayed_unit.py",
        "tests/test_mixed_precision_casts.py", "tests/test_errors.py", "tests/test_wrapper.py",
    ),
    "overlapddp/testing.py": ("tests/test_testing_unit.py", "tests/test_race.py", "tests/test_timeline.py", "tests/test_reliability.py"),
    "overlapddp/integrations/torchft.py": ("tests/integrations/test_torchft_unit.py", "tests/integrations/test_torchft.py"),
    "overlapddp/integrations/accelerate.py": ("tests/integrations/test_integrations_unit.py", "tests/integrations/test_frameworks.py"),
    "overlapddp/integrations/trainer_strategy.py": ("tests/integrations/test_integrations_unit.py", "tests/integrations/test_frameworks.py"),
    "overlapddp/integrations/fabric.py": ("tests/integrations/test_integrations_unit.py", "tests/integrations/test_frameworks.py"),
    "overlapddp/integrations/ray.py": ("tests/integrations/test_integrations_unit.py", "tests/integrations/test_ray.py"),
    "overlapddp/integrations/lightning.py": ("tests/integrations/test_integrations_unit.py", "tests/integrations/test_frameworks.py"),
    "overlapddp/integrations/pytorch_lightning.py": ("tests/integrations/test_frameworks.py",),
    "overlapddp/integrations/transformers.py": ("tests/integrations/test_frameworks.py",),
    "overlapddp/reducer.py": (
        "tests/test_reducer_unit.py", "tests/test_cuda_logic.py", "tests/test_one_rank_parity.py", "tests/test_wrapper_unit.py",
        "tests/layout/test_ready_order.py", "tests/test_loops.py", "tests/test_parity.py",
    ),
    "overlapddp/attachment.py": (
        "tests/test_attachment_unit.py", "tests/shard/test_shard_checks.py", "tests/test_refusals_unit.py", "tests/optim/test_optimizer_overlap_one_rank.py",
        "tests/test_wrapper_unit.py", "tests/shard/test_sharded_optimizer_one_rank.py", "tests/test_refusal_order.py",
    ),
    "overlapddp/wrapper.py": ("tests/test_wrapper_unit.py", "tests/test_one_rank_parity.py", "tests/test_errors.py", "tests/test_wrapper.py", "tests/test_parity.py"),
}


@dataclass(frozen=True)
class Mutant:
    """One finished cosmic-ray job, reduced to what the report needs."""

    module: str
    operator: str
    occurrence: int
    line: int
    change: str  # "old line => new line", stripped: the key equivalents and the CI sample use
    outcome: str  # killed, survived, timeout, equivalent, incompetent, skipped
    killer: str  # the test file that failed first ("" unless killed)


def change_of(diff: str) -> str:
    """The mutated line before and after, from cosmic-ray's unified diff (robust to line moves, and to
    the blank last line a mutant of a module's last line may show as removed)."""
    removed = [line[1:].strip() for line in diff.splitlines()
               if line.startswith("-") and not line.startswith("---") and line[1:].strip()]
    added = [line[1:].strip() for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
    return " | ".join(removed) + " => " + " | ".join(added)


@dataclass(frozen=True)
class Sampled:
    """One mutant of the CI sample: found again by operator and change, so line moves do not matter."""

    module: str
    operator: str
    change: str
    tests: tuple[str, ...]  # the cheapest node ids that kill it


def mutate_sampled(root: Path, sampled: Sampled) -> None:
    """Write ``sampled``'s mutant into ``root``'s copy of its module (cosmic-ray makes the change)."""
    import difflib

    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    path = root / sampled.module
    source = path.read_text()
    operator = get_operator(sampled.operator)()
    occurrence = 0
    while (mutated := mutate_code(source, operator, occurrence)) is not None:
        diff = "\n".join(difflib.unified_diff(source.splitlines(), mutated.splitlines(), lineterm=""))
        if change_of(diff) == sampled.change:
            path.write_text(mutated)
            return
        occurrence += 1
    raise LookupError(
        f"{sampled.module}: no {sampled.operator} mutant changes {sampled.change!r} any more; "
        "pick a new sample from a fresh run (tools/mutation_sample.py says how)."
    )


def killer_of(output: str) -> str:
    """The test file pytest -q names first among its failures (a collection error names its file)."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split()[1].split("::")[0]
    return "?"


def _cosmic_ray(scratch: Path, *args: str, timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    bindir = Path(sys.executable).parent
    tool = shutil.which(args[0], path=f"{bindir}{os.pathsep}{env.get('PATH', '')}")
    if tool is None:
        raise SystemExit(f"{args[0]} not found: install the test extra (pip install -e '.[test]').")
    return subprocess.run(
        [tool, *args[1:]], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def write_config(scratch: Path, module: str, timeout_s: float) -> Path:
    tests = " ".join(MODULE_TESTS[module])
    excluded = ", ".join(f"'{pattern}'" for pattern in EXCLUDED_OPERATORS)
    config = scratch / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {timeout_s}\n"
        "excluded-modules = []\n"
        f'test-command = "{" ".join(test_command(scratch))} {tests}"\n'
        "[cosmic-ray.distributor]\n"
        'name = "local"\n'
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = [{excluded}]\n"
    )
    return config


def test_command(scratch: Path) -> list[str]:
    """How a mutant's tests run: through the warm pytest server (tools/warm_pytest.py)."""
    server = scratch / "tools" / "warm_pytest.py"
    return [sys.executable, str(server), "run", str(scratch / WARM_SOCKET), *PYTEST_ARGS.split()]


@contextmanager
def warm_server(scratch: Path) -> Iterator[None]:
    """A pytest server for the scratch copy, torch imported once (a cold start is most of a mutant's cost)."""
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    server = subprocess.Popen(
        [sys.executable, str(scratch / "tools" / "warm_pytest.py"), "serve", str(scratch / WARM_SOCKET)],
        cwd=scratch, env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise RuntimeError("the warm pytest server did not start (tools/warm_pytest.py)")
        yield
    finally:
        server.kill()
        server.wait()


def baseline_s(scratch: Path, module: str) -> float:
    """Seconds the module's tests take unmutated; they must pass."""
    env = dict(os.environ, PYTHONPATH=str(scratch))
    start = time.perf_counter()
    done = subprocess.run(
        [*test_command(scratch), *MODULE_TESTS[module]], cwd=scratch, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module}: its tests fail unmutated:\n{done.stdout[-3000:]}")
    return time.perf_counter() - start


def read_session(session: Path, module: str) -> list[Mutant]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    equivalent = {(e.module, e.change) for e in EQUIVALENTS}
    mutants = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            spec = item.mutations[0]
            change = change_of(result.diff or "")
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                outcome = "skipped"
            elif result.worker_outcome != WorkerOutcome.NORMAL:
                outcome = "incompetent"  # the mutation itself could not be applied or run
            elif result.test_outcome == TestOutcome.SURVIVED:  # a killed mutant is never called equivalent
                outcome = "equivalent" if (module, change) in equivalent else "survived"
            elif result.output == "timeout":
                outcome = "timeout"
            elif result.test_outcome == TestOutcome.KILLED:
                outcome = "killed"
            else:
                outcome = "incompetent"
            killer = killer_of(result.output or "") if outcome == "killed" else ""
            mutants.append(
                Mutant(module, spec.operator_name, spec.occurrence, spec.start_pos[0], change, outcome, killer)
            )
    return sorted(mutants, key=lambda m: (m.line, m.operator, m.occurrence))


def source_stamp(session: Path) -> Path:
    """Beside a session: the hash of the module source it was made from, written once its work
    list is complete (init and filter done), so only a whole list of the same source resumes."""
    return session.with_suffix(".source")


def source_hash(scratch: Path, module: str) -> str:
    return hashlib.sha256((scratch / module).read_bytes()).hexdigest()


def run_module(
    scratch: Path, module: str, timeout_s: float | None, resume: bool = False
) -> tuple[list[Mutant], float, float]:
    """Mutate one module in the scratch copy; returns its mutants, baseline seconds and wall seconds.
    With ``resume``, an existing session for an unchanged module runs only its pending mutants."""
    base = baseline_s(scratch, module)
    per_mutant = timeout_s if timeout_s is not None else round(2 * base + 15, 1)
    config = write_config(scratch, module, per_mutant)
    RESULTS.mkdir(parents=True, exist_ok=True)
    session = session_of(module)
    stamp = source_stamp(session)
    resume = resume and session.exists()
    if resume and (not stamp.exists() or stamp.read_text() != source_hash(scratch, module)):
        raise RuntimeError(f"{module} changed since its session was made, or its making was cut short: "
                           "run it again without --resume")
    if not resume:
        session.unlink(missing_ok=True)
        stamp.unlink(missing_ok=True)
    start = time.perf_counter()
    steps = (("cosmic-ray", "init", str(config), str(session)), ("cr-filter-operators", str(session), str(config)))
    for step in () if resume else steps:
        done = _cosmic_ray(scratch, *step)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stderr[-3000:]}")
    stamp.write_text(source_hash(scratch, module))
    done = _cosmic_ray(scratch, "cosmic-ray", "exec", str(config), str(session))
    if done.returncode != 0:
        raise RuntimeError(f"cosmic-ray exec failed:\n{done.stderr[-3000:]}")
    return read_session(session, module), base, time.perf_counter() - start


def run_modules(
    scratch: Path, modules: list[str], timeout_s: float | None, survivors: bool, resume: bool = False
) -> tuple[list[str], list[str]]:
    """Each module in turn; returns the report's rows and its problem lines (survivors, incompetent)."""
    rows, problems = [], []
    for module in modules:
        mutants, base, wall = run_module(scratch, module, timeout_s, resume)
        rows.append(summary_row(module, mutants, base, wall))
        print(rows[-1], flush=True)
        for m in mutants:
            if m.outcome in ("survived", "incompetent"):
                problems.append(f"{m.outcome}: {module}:{m.line} {m.operator}#{m.occurrence}: {m.change}")
                if survivors:
                    print("   ", problems[-1], flush=True)
    return rows, problems


def recheck_survivors(scratch: Path, module: str) -> int:
    """Run each survivor of ``module``'s finished session again with the module's current tests
    (added since the session ran) and record the new outcome there; returns how many were killed.
    The killed ones need no rerun: tests were only added."""
    import difflib

    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    equivalent = {(e.module, e.change) for e in EQUIVALENTS}
    timeout_s = round(2 * baseline_s(scratch, module) + 15, 1)
    path = scratch / module
    source = path.read_text()
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    killed = 0
    with use_db(str(session_of(module)), WorkDB.Mode.open) as db:
        for item, result in list(db.completed_work_items):
            spec = item.mutations[0]
            if result.test_outcome != TestOutcome.SURVIVED or (module, change_of(result.diff or "")) in equivalent:
                continue
            mutated = mutate_code(source, get_operator(spec.operator_name)(), spec.occurrence)
            diff = "\n".join(difflib.unified_diff(source.splitlines(), (mutated or "").splitlines(), lineterm=""))
            if change_of(diff) != change_of(result.diff or ""):
                raise RuntimeError(f"{module} changed since its session ran: run it again, not --recheck")
            path.write_text(mutated)
            try:
                done = subprocess.run([*test_command(scratch), *MODULE_TESTS[module]], cwd=scratch, env=env,
                                      capture_output=True, text=True, timeout=timeout_s)
                output, outcome = done.stdout, TestOutcome.SURVIVED if done.returncode == 0 else TestOutcome.KILLED
            except subprocess.TimeoutExpired:
                output, outcome = "timeout", TestOutcome.KILLED
            finally:
                path.write_text(source)
            killed += outcome == TestOutcome.KILLED
            db.set_result(item.job_id, WorkResult(WorkerOutcome.NORMAL, output, outcome, result.diff))
    return killed


def session_of(module: str) -> Path:
    return RESULTS / (module.replace("/", ".").removesuffix(".py") + ".sqlite")


def summary_row(module: str, mutants: list[Mutant], base: float | None, wall: float | None) -> str:
    count = {k: sum(m.outcome == k for m in mutants) for k in ("killed", "survived", "timeout", "equivalent")}
    ran = sum(count.values())
    scored = ran - count["equivalent"]
    rate = 100.0 * (count["killed"] + count["timeout"]) / scored if scored else 100.0
    base_s = "-" if base is None else f"{base:.1f} s"  # not known when a session is reread
    per = "-" if wall is None or not ran else f"{wall / ran:.1f} s"
    return (
        f"| {module} | {ran} | {count['killed']} | {count['survived']} | {count['timeout']} | "
        f"{count['equivalent']} | {rate:.0f}% | {base_s} | {per} |"
    )


HEADER = (
    "| module | mutants | killed | survived | timed out | equivalent | killed of non-equivalent | "
    "tests unmutated | per mutant |\n|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: every module in MODULE_TESTS)")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 2 x baseline + 15 s)")
    parser.add_argument("--list", action="store_true", help="print modules and tests, run nothing")
    parser.add_argument("--survivors", action="store_true", help="print each survivor's change")
    parser.add_argument("--resume", action="store_true",
                        help="continue an unfinished session of an unchanged module instead of starting over")
    parser.add_argument("--reread", action="store_true", help="report from the sessions in results/mutation")
    parser.add_argument("--recheck", action="store_true",
                        help="rerun each survivor of a finished session with the current tests, then report")
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULE_TESTS)
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        parser.error(f"no tests mapped for {unknown}: add them to MODULE_TESTS in {Path(__file__).name}")
    if args.list:
        for module in modules:
            print(module, "<-", " ".join(MODULE_TESTS[module]))
        return 0
    if args.recheck:
        with tempfile.TemporaryDirectory(prefix="overlapddp-cosmic-ray-") as tmp:
            scratch = Path(tmp) / "repo"
            shutil.copytree(REPO, scratch, ignore=COPY_IGNORE)
            with warm_server(scratch):
                for module in modules:
                    print(f"{module}: {recheck_survivors(scratch, module)} more killed", flush=True)
    if args.reread or args.recheck:
        for module in modules:
            session = session_of(module)
            if session.exists():
                mutants = read_session(session, module)
                print(summary_row(module, mutants, None, None))
                killers: dict[str, int] = {}
                for m in mutants:
                    if m.killer:
                        killers[m.killer] = killers.get(m.killer, 0) + 1
                    if m.outcome not in ("killed", "skipped"):
                        print(f"    {m.outcome}: {m.line} {m.operator}#{m.occurrence}: {m.change}")
                print("    killed first by:", killers)
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="overlapddp-cosmic-ray-") as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(REPO, scratch, ignore=COPY_IGNORE)
        with warm_server(scratch):
            rows, problems = run_modules(scratch, modules, args.timeout, args.survivors, args.resume)
    report = f"Commit {commit.strip()}, `python3 tools/mutation_run.py {' '.join(argv or sys.argv[1:])}`\n\n"
    report += HEADER + "\n" + "\n".join(rows) + "\n\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    (RESULTS / "report.md").write_text(report)
    print(f"report: {RESULTS / 'report.md'}")
    return 1 if any(p.startswith("survived") for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
