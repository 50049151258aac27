"""The timeline's arithmetic on a hand-built fence log: every span, summary and trace event exactly.

Times are binary fractions so each difference and each microsecond value is exact.
"""

from __future__ import annotations

import dataclasses

import pytest

from overlapddp.fence import BACKWARD_END, FenceEdge, FenceLog
from overlapddp.timeline import BucketSpan, IterationSummary, bucket_spans, chrome_trace, summarize


def _edge(iteration: int, bucket: int, edge: str, time: float) -> FenceEdge:
    """The edge name as an equal but new string (as an unpickled log holds it), not the fence's object."""
    name = "".join(list(edge))
    return FenceEdge(iteration, bucket, name, actor="test", stream="cpu", event=None, buffer=bucket, time=time)


def _log() -> FenceLog:
    """Iteration 0: bucket 1 ready first, bucket 0 last, bucket 0 completes 0.25 s after backward ends.
    Iteration 1: bucket 0 completes before backward ends, bucket 1 never does. Iteration 2: backward never ended.
    Iteration 3: ended, but no bucket completed. Iteration 4: one bucket, 0.5 s exposed. Bucket 0's second ``completed`` is not its first."""
    edges = [
        _edge(0, 1, "produced", 10.0), _edge(0, 1, "launched", 10.5), _edge(0, 0, "produced", 11.0),
        _edge(0, 0, "launched", 11.25), _edge(0, 1, "completed", 11.5), _edge(0, -1, BACKWARD_END, 12.0),
        _edge(0, 0, "completed", 12.25), _edge(0, 0, "completed", 13.0), _edge(0, 1, "consumed", 12.5),
        _edge(0, 0, "consumed", 12.5),
        _edge(1, 0, "produced", 20.0), _edge(1, 0, "launched", 20.5), _edge(1, 0, "completed", 21.0),
        _edge(1, 1, "produced", 21.5), _edge(1, 1, "launched", 21.75), _edge(1, -1, BACKWARD_END, 22.0),
        _edge(2, 0, "produced", 30.0), _edge(2, 0, "launched", 30.5), _edge(2, 0, "completed", 31.0),
        _edge(3, 0, "produced", 40.0), _edge(3, -1, BACKWARD_END, 41.0),
        _edge(4, 0, "produced", 50.0), _edge(4, 0, "launched", 50.5), _edge(4, -1, BACKWARD_END, 51.0),
        _edge(4, 0, "completed", 51.5),
    ]
    return FenceLog(edges)


def test_spans_keep_each_edges_first_time_in_iteration_and_bucket_order():
    assert bucket_spans(_log()) == [
        BucketSpan(0, 0, 11.0, 11.25, 12.25, 12.5), BucketSpan(0, 1, 10.0, 10.5, 11.5, 12.5),
        BucketSpan(1, 0, 20.0, 20.5, 21.0, None), BucketSpan(1, 1, 21.5, 21.75, None, None),
        BucketSpan(2, 0, 30.0, 30.5, 31.0, None), BucketSpan(3, 0, 40.0, None, None, None),
        BucketSpan(4, 0, 50.0, 50.5, 51.5, None),
    ]


def test_summaries_measure_communication_left_after_backward_and_the_last_ready_bucket():
    assert summarize(_log()) == [
        IterationSummary(0, backward_end=12.0, last_completed=12.25, exposed_communication_s=0.25, last_ready_bucket=0),
        IterationSummary(1, backward_end=22.0, last_completed=21.0, exposed_communication_s=0.0, last_ready_bucket=1),
        IterationSummary(4, backward_end=51.0, last_completed=51.5, exposed_communication_s=0.5, last_ready_bucket=0),
    ]


def test_chrome_trace_has_a_waiting_and_a_reducing_span_per_bucket_and_each_backward_end():
    def span(name: str, ts: float, dur: float, bucket: int, iteration: int) -> dict[str, object]:
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": f"bucket {bucket}",
                "args": {"iteration": iteration}}

    def end(ts: float, iteration: int) -> dict[str, object]:
        return {"name": "backward end", "ph": "i", "ts": ts, "pid": 0, "tid": "backward", "s": "g",
                "args": {"iteration": iteration}}

    assert chrome_trace(_log()) == {"traceEvents": [
        span("bucket 0 ready", 1.0e6, 0.25e6, 0, 0), span("bucket 0 reducing", 1.25e6, 1.0e6, 0, 0),
        span("bucket 1 ready", 0.0, 0.5e6, 1, 0), span("bucket 1 reducing", 0.5e6, 1.0e6, 1, 0),
        span("bucket 0 ready", 10.0e6, 0.5e6, 0, 1), span("bucket 0 reducing", 10.5e6, 0.5e6, 0, 1),
        span("bucket 1 ready", 11.5e6, 0.25e6, 1, 1),
        span("bucket 0 ready", 20.0e6, 0.5e6, 0, 2), span("bucket 0 reducing", 20.5e6, 0.5e6, 0, 2),
        span("bucket 0 ready", 40.0e6, 0.5e6, 0, 4), span("bucket 0 reducing", 40.5e6, 1.0e6, 0, 4),
        end(2.0e6, 0), end(12.0e6, 1), end(31.0e6, 3), end(41.0e6, 4),
    ]}


def test_an_empty_log_has_no_spans_summaries_or_events():
    assert (bucket_spans(FenceLog()), summarize(FenceLog()), chrome_trace(FenceLog())) == ([], [], {"traceEvents": []})


def test_spans_and_summaries_are_frozen_records():
    with pytest.raises(dataclasses.FrozenInstanceError):
        bucket_spans(_log())[0].ready = 0.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        summarize(_log())[0].iteration = 5  # type: ignore[misc]
