"""How is a program watched? The patches, the access mode and the report, for one ``with`` block.

While :func:`detect` runs: every process-group method that launches a collective records it
(``collectives.py`` says which tensors it writes and reads); ``Work.wait``/``synchronize``/
``get_future``/``is_completed`` and ``torch.Future``'s ``wait``/``value``/``done``/``then``/``add_done_callback``
(and ``torch.futures.collect_all``/``wait_all``) report what this rank observed; a dispatch mode
checks every op on the calling thread (``accesses.py``); a global forward pre-hook collects the
modules whose parameter names a finding uses. Stock DDP's C++ reducer waits on a comm hook's future
where Python cannot see it, but that future is a ``then`` chain (DDP accepts no other: its result
must be a Python object), whose callback observed the collective first. Every patch is undone on
exit, in reverse order.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook

from overlapddp.sanitize.accesses import Accesses
from overlapddp.sanitize.collectives import METHODS, Method, split
from overlapddp.sanitize.completion import Collectives, InFlight
from overlapddp.sanitize.findings import Finding, user_site, write_report
from overlapddp.sanitize.force import Forced
from overlapddp.sanitize.names import Names
from overlapddp.sanitize.streams import CudaStreams, HostStreams, StreamModel

_MISSING = object()
_ACTIVE: list[bool] = []  # one detector at a time: the patches are process-wide


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _Observed:
    """Which collectives each work and future stands for (weakly: dropping one is the user's call)."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.of: weakref.WeakKeyDictionary[Any, list[InFlight]] = weakref.WeakKeyDictionary()

    def get(self, handle: Any) -> list[InFlight]:
        try:
            return self.of.get(handle) or []
        except TypeError:  # not weakly referenceable: nothing launched it here
            return []

    def observe(self, handle: Any, how: str) -> None:
        entries = self.get(handle)
        if entries:
            self.collectives.observe(entries, how)


def _launcher(method: Method, real: Callable[..., Any], observed: _Observed, force: bool) -> Callable[..., Any]:
    collectives = observed.collectives

    def launch(group: Any, *args: Any, **kwargs: Any) -> Any:
        outputs, inputs = split(method, args, group.rank())
        forced = None
        if force and outputs:
            args, forced = Forced.redirect(args, outputs, inputs)
        work = real(group, *args, **kwargs)
        entry = collectives.launch(method.op, group.size(), outputs, inputs, forced)
        if forced is not None:
            forced.poison()
        if work is not None:
            observed.of[work] = [entry]
        return work

    return launch


def _work_patches(observed: _Observed) -> list[tuple[Any, str, Any]]:
    work = dist.Work
    real_wait, real_future, real_completed = work.wait, work.get_future, work.is_completed
    real_synchronize = work.synchronize
    real_then = torch._C.Future.then  # not yet patched: chaining the forced value observes nothing

    def wait(handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_wait(handle, *args, **kwargs)
        observed.observe(handle, "wait")
        return result

    def synchronize(handle: Any) -> Any:
        result = real_synchronize(handle)
        observed.observe(handle, "wait")  # NCCL: the current stream waits, as in wait()
        return result

    def get_future(handle: Any) -> Any:
        future: Any = real_future(handle)
        entries = observed.get(handle)
        if entries:
            forced = [e.forced for e in entries if e.forced is not None]
            if forced:  # its value is the user's tensors, as without --force (force.py)
                future = real_then(future, forced[0].user_value)
            observed.of[future] = entries
        return future

    def is_completed(handle: Any) -> bool:
        done = real_completed(handle)
        if done:
            observed.observe(handle, "poll")
        return done

    return [(work, "wait", wait), (work, "synchronize", synchronize), (work, "get_future", get_future),
            (work, "is_completed", is_completed)]


def _future_patches(observed: _Observed) -> list[tuple[Any, str, Any]]:  # noqa: C901 - one patch per method
    future = torch._C.Future
    real_wait, real_value, real_done = future.wait, future.value, future.done
    real_then, real_add = future.then, future.add_done_callback
    real_collect, real_wait_all = torch.futures.collect_all, torch.futures.wait_all

    def wait(fut: Any) -> Any:
        result = real_wait(fut)
        observed.observe(fut, "future wait")
        return result

    def value(fut: Any) -> Any:
        result = real_value(fut)
        observed.observe(fut, "value")
        return result

    def done(fut: Any) -> bool:
        finished = real_done(fut)
        if finished:
            observed.observe(fut, "poll")
        return finished

    def observing(fut: Any, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        entries = observed.get(fut)
        if not entries:
            return callback

        @functools.wraps(callback)
        def run(parent: Any) -> Any:
            observed.collectives.observe(entries, "callback")
            return callback(parent)

        return run

    def then(fut: Any, callback: Callable[[Any], Any]) -> Any:
        child = real_then(fut, observing(fut, callback))
        entries = observed.get(fut)
        if entries:
            observed.of[child] = entries
        return child

    def add_done_callback(fut: Any, callback: Callable[[Any], None]) -> None:
        real_add(fut, observing(fut, callback))

    def collect_all(futures: list[Any]) -> Any:
        child = real_collect(futures)
        entries = [e for f in futures for e in observed.get(f)]
        if entries:
            observed.of[child] = entries
        return child

    def wait_all(futures: list[Any]) -> Any:
        result = real_wait_all(futures)
        for f in futures:
            observed.observe(f, "future wait")
        return result

    return [(future, "wait", wait), (future, "value", value), (future, "done", done), (future, "then", then),
            (future, "add_done_callback", add_done_callback), (torch.futures, "collect_all", collect_all),
            (torch.futures, "wait_all", wait_all)]


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, attr, obj.__dict__.get(attr, _MISSING)) for obj, attr, _ in patches]
    try:
        for obj, attr, new in patches:
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


@contextlib.contextmanager
def detect(force: bool = False, report_dir: str | os.PathLike[str] | None = None, echo: bool = True,
           streams: StreamModel | None = None, end_site: str | None = None) -> Iterator[list[Finding]]:
    """Watch the asynchronous collectives this rank issues from Python inside the block.

    Yields the list of findings, filled as they happen (each also written to stderr unless ``echo``
    is False). At the end, every collective not observed complete is a ``never-completed`` finding.
    With ``report_dir`` the list is written to ``report_dir/rank{R}.json`` at each finding and at the end.
    ``force``: delay each
    collective's result until it is observed and show NaN meanwhile (``force.py``). ``streams``: the
    stream model (default: CUDA's when available, else the host's only); ``end_site``: the
    ``"path:line"`` named as the end (default: the line that leaves the block).

    Example::

        with overlapddp.sanitize.detect() as findings:
            train(steps=3)
        assert not findings, findings
    """
    if _ACTIVE:
        raise RuntimeError("overlapddp.sanitize.detect() is already running in this process; "
                           "it cannot be nested (its patches are process-wide).")
    findings: list[Finding] = []
    rank: list[int] = []

    def report(finding: Finding) -> None:
        findings.append(finding)
        if echo:
            print(finding.message(), file=sys.stderr, flush=True)
        if report_dir is not None:  # now too: torchrun ends the other ranks when one exits non-zero
            write_report(findings, report_dir, known_rank())

    def known_rank() -> int:
        if not rank:
            rank.append(_rank())
        return rank[0]

    model = streams or (CudaStreams() if torch.cuda.is_available() else HostStreams())
    names = Names()
    collectives = Collectives(model, names, known_rank, report)
    observed = _Observed(collectives)
    patches = [(dist.ProcessGroup, name, _launcher(method, getattr(dist.ProcessGroup, name), observed, force))
               for name, method in METHODS.items() if hasattr(dist.ProcessGroup, name)]
    patches += _work_patches(observed) + _future_patches(observed) + model.patches()
    _ACTIVE.append(True)
    hook = register_module_forward_pre_hook(lambda module, _: names.saw(module))
    try:
        with _patched(patches), Accesses(collectives, watch_host_syncs=isinstance(model, CudaStreams)):
            try:
                yield findings
            finally:
                known_rank()
                gc.collect()  # the storages a cycle held are freed now, while their collectives are watched
                collectives.end(end_site or user_site(3) or collectives.last_site)
    finally:
        hook.remove()
        _ACTIVE.pop()
        if report_dir is not None:
            write_report(findings, report_dir, known_rank())
