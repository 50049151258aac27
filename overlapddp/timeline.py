"""Per-bucket timelines from a fence log: when each bucket became ready, launched, completed and was
consumed, how much communication was left exposed after backward, and a Chrome-trace export.

Example::

    >>> log = model.record_fences()
    >>> train_a_few_steps(model)
    >>> for s in summarize(log): print(s.exposed_communication_s, s.last_ready_bucket)
    >>> json.dump(chrome_trace(log), open("trace.json", "w"))     # open in chrome://tracing
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapddp.fence import BACKWARD_END, FenceLog


@dataclass(frozen=True)
class BucketSpan:
    """One bucket in one iteration; times are ``time.perf_counter()`` seconds (None if never reached)."""

    iteration: int
    bucket: int
    ready: float | None
    launched: float | None
    completed: float | None
    consumed: float | None


@dataclass(frozen=True)
class IterationSummary:
    """What limited one iteration: communication still running after backward, and the last bucket."""

    iteration: int
    backward_end: float
    last_completed: float
    exposed_communication_s: float  # last completion minus end of backward (0 if all finished first)
    last_ready_bucket: int


def bucket_spans(log: FenceLog) -> list[BucketSpan]:
    """Every bucket of every recorded iteration, in (iteration, bucket) order."""
    times: dict[tuple[int, int], dict[str, float]] = {}
    for edge in log.edges:
        if edge.edge != BACKWARD_END:
            times.setdefault((edge.iteration, edge.bucket), {}).setdefault(edge.edge, edge.time)
    return [
        BucketSpan(it, b, t.get("produced"), t.get("launched"), t.get("completed"), t.get("consumed"))
        for (it, b), t in sorted(times.items())
    ]


def summarize(log: FenceLog) -> list[IterationSummary]:
    """One summary per iteration that reached the end of backward and completed its buckets."""
    ends = {e.iteration: e.time for e in log.edges if e.edge == BACKWARD_END}
    by_iteration: dict[int, list[BucketSpan]] = {}
    for span in bucket_spans(log):
        by_iteration.setdefault(span.iteration, []).append(span)
    summaries = []
    for iteration, spans in sorted(by_iteration.items()):
        completed = [s.completed for s in spans if s.completed is not None]
        ready = [(s.ready, s.bucket) for s in spans if s.ready is not None]
        if iteration not in ends or not completed or not ready:
            continue
        last_completed = max(completed)
        summaries.append(
            IterationSummary(
                iteration,
                ends[iteration],
                last_completed,
                max(0.0, last_completed - ends[iteration]),
                max(ready, key=lambda pair: pair[0])[1],
            )
        )
    return summaries


def chrome_trace(log: FenceLog) -> dict[str, list[dict[str, object]]]:
    """The log as Chrome trace events: per bucket a 'waiting to launch' and a 'reducing' span."""
    events: list[dict[str, object]] = []
    start = min((e.time for e in log.edges), default=0.0)

    def us(t: float) -> float:
        return (t - start) * 1e6

    for s in bucket_spans(log):
        if s.ready is not None and s.launched is not None:
            events.append({"name": f"bucket {s.bucket} ready", "ph": "X", "ts": us(s.ready),
                           "dur": us(s.launched) - us(s.ready), "pid": 0, "tid": f"bucket {s.bucket}",
                           "args": {"iteration": s.iteration}})
        if s.launched is not None and s.completed is not None:
            events.append({"name": f"bucket {s.bucket} reducing", "ph": "X", "ts": us(s.launched),
                           "dur": us(s.completed) - us(s.launched), "pid": 0, "tid": f"bucket {s.bucket}",
                           "args": {"iteration": s.iteration}})
    for e in log.edges:
        if e.edge == BACKWARD_END:
            events.append({"name": "backward end", "ph": "i", "ts": us(e.time), "pid": 0, "tid": "backward",
                           "s": "g", "args": {"iteration": e.iteration}})
    return {"traceEvents": events}
