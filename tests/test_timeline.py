"""Bucket timelines: edge times in order, exposed communication visible when a rank's reductions lag."""

from __future__ import annotations

import json
import time

import torch

from overlapddp import OverlapDDP
from overlapddp.testing import delay_communication
from overlapddp.timeline import bucket_spans, chrome_trace, summarize
from tests.support import models
from tests.support.multiprocess import run_ranks

DELAY_S = 0.05


def _timeline(rank: int, world_size: int) -> dict[str, object]:
    model = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    log = model.record_fences()
    with delay_communication(model, rank=1, seconds=DELAY_S, stage="completion"):
        for step in range(3):
            inputs, target = models.batch("mlp", rank, step)
            models.loss_of(model(inputs), target).backward()
    spans = bucket_spans(log)
    return {
        "ordered": all(s.ready <= s.launched <= s.completed <= s.consumed for s in spans),
        "buckets_per_iteration": [len([s for s in spans if s.iteration == it]) for it in range(3)],
        "exposed": [s.exposed_communication_s for s in summarize(log)],
        "last_ready": [s.last_ready_bucket for s in summarize(log)],
        "trace": json.dumps(chrome_trace(log)),
    }


def test_timeline_orders_edges_and_shows_exposed_communication_of_a_lagging_rank():
    ranks = run_ranks(2, _timeline)
    for facts in ranks:
        assert facts["ordered"]
        assert facts["buckets_per_iteration"][0] == 1 and facts["buckets_per_iteration"][1] > 1
        trace = json.loads(facts["trace"])["traceEvents"]
        assert any(e["name"] == "backward end" for e in trace) and any("reducing" in e["name"] for e in trace)
    # Rank 1's futures resolve DELAY_S after launch, so its communication outlasts its backward by
    # about that (less the time from the last launch to the end of backward, which a loaded
    # machine can stretch by milliseconds: half the delay is asserted).
    assert all(exposed >= DELAY_S / 2 for exposed in ranks[1]["exposed"])
    # The last bucket to become ready is the last one in the (rebuilt) launch order.
    assert ranks[0]["last_ready"][1:] == [ranks[0]["buckets_per_iteration"][1] - 1] * 2


def _completions_during_backward(rank: int, world_size: int) -> list[float]:
    """Per iteration after the rebuild: backward end minus bucket 0's completion, with a slow first layer."""
    model = OverlapDDP(models.build("mlp"), bucket_cap_mb=0.001)
    model.module[0].register_full_backward_pre_hook(lambda *_: time.sleep(DELAY_S))  # backward's last part
    log = model.record_fences()
    for step in range(3):
        inputs, target = models.batch("mlp", rank, step)
        models.loss_of(model(inputs), target).backward()
    ends = {s.iteration: s.backward_end for s in summarize(log)}
    return [ends[s.iteration] - s.completed for s in bucket_spans(log) if s.iteration > 0 and s.bucket == 0]


def test_timeline_shows_a_bucket_completing_during_backward_when_it_did():
    # Bucket 0 (the last layers) is reduced while the first layer's backward sleeps DELAY_S; its
    # completion must show then, not when the end-of-backward callback got round to waiting for it.
    for lead in run_ranks(2, _completions_during_backward):
        assert lead and all(seconds >= DELAY_S * 0.5 for seconds in lead), lead


def test_profiler_shows_bucket_ranges(one_rank):
    model = OverlapDDP(models.build("mlp"))
    inputs, target = models.batch("mlp", 0, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        models.loss_of(model(inputs), target).backward()
    names = {e.name for e in prof.events()}
    assert "overlapddp.bucket_0.launch" in names and "overlapddp.bucket_0.complete" in names
