"""The detector's parts, in one process: byte spans of views, names, the user's line, the report,
the completion rules on a one-rank gloo group, and what detect() refuses."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapddp.sanitize import DROPPED, NEVER, READ, WRITE, detect
from overlapddp.sanitize.findings import Finding, write_report
from overlapddp.sanitize.memory import span_of
from overlapddp.sanitize.names import Names


def test_views_overlap_their_base_and_disjoint_slices_do_not():
    flat = torch.zeros(10)
    left, right, strided = flat[:4], flat[4:], flat[::3]  # strided: elements 0, 3, 6, 9
    assert span_of(left).overlaps(span_of(flat)) and not span_of(left).overlaps(span_of(right))
    assert span_of(strided).overlaps(span_of(right))  # its bytes run from 0 to 9
    assert span_of(torch.zeros(0)) is None and not span_of(flat).overlaps(span_of(torch.zeros(10)))


def test_names_are_the_parameters_and_gradients_of_the_outermost_module_seen():
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    net(torch.ones(1, 2)).sum().backward()
    names = Names()
    names.saw(net[0])
    names.saw(net)
    assert names.named(net[0].weight.grad)[0] == "0.weight.grad"
    assert names.named(net[1].bias)[0] == "1.bias"
    assert names.named(net[0].weight.grad[1])[0] == "part of 0.weight.grad"
    assert names.named(torch.ones(3)) is None


def test_a_finding_says_what_where_and_how_to_fix_it(tmp_path):
    finding = Finding(READ, "0.weight.grad (float32[3, 2])", "all_reduce over 2 ranks", "a.py:3", "a.py:4",
                      "aten.add_", 1)
    assert finding.message().startswith(
        "overlapddp.sanitize: rank 1: read-before-complete: 0.weight.grad (float32[3, 2]) read by aten.add_ at "
        "a.py:4, while all_reduce over 2 ranks launched at a.py:3 was not observed complete; ")
    path = write_report([finding], tmp_path / "reports", 1)
    assert path.name == "rank1.json" and json.loads(path.read_text())[0]["launched_at"] == "a.py:3"


def _line(offset: int = 0) -> str:
    import sys

    frame = sys._getframe(1)
    return f"test_units.py:{frame.f_lineno + offset}"


def test_reads_writes_and_waits_on_a_one_rank_group(one_rank):
    with detect(echo=False) as findings:
        grad = torch.ones(4)
        work = dist.all_reduce(grad, async_op=True); launched = _line()  # noqa: E702
        grad.sum(); read = _line()  # noqa: E702
        grad[2:].zero_(); written = _line()  # noqa: E702
        work.wait()
        grad.sum()  # after the wait: nothing
    assert [(f.kind, f.tensor) for f in findings] == [(READ, "float32[4]"), (WRITE, "float32[2]")]
    assert findings[0].launched_at.endswith(launched) and findings[0].accessed_at.endswith(read)
    assert findings[1].accessed_at.endswith(written) and findings[1].access == "aten.zero_"


def test_an_all_gathers_input_may_be_read_but_not_written_before_it_completes(one_rank):
    with detect(echo=False) as findings:
        mine, gathered = torch.ones(3), torch.zeros(3)
        work = dist.all_gather_into_tensor(gathered, mine, async_op=True)
        mine.sum()
        mine.add_(1)
        work.wait()
    assert [f.kind for f in findings] == [WRITE]


def test_a_then_callback_a_chained_futures_wait_a_poll_and_synchronize_observe(one_rank):
    with detect(echo=False) as findings:
        grad = torch.ones(4)
        future = dist.all_reduce(grad, async_op=True).get_future()
        seen = future.then(lambda fut: fut.value()[0].sum())
        seen.wait()
        grad.sum()
        other = torch.ones(4)
        dist.all_reduce(other, async_op=True).get_future().then(lambda fut: None).wait()
        other.sum()
        polled = torch.ones(4)
        work = dist.all_reduce(polled, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        polled.sum()
        synchronized = torch.ones(4)
        work = dist.all_reduce(synchronized, async_op=True)
        work.synchronize()
        synchronized.sum()
    assert findings == []


def test_a_collective_never_waited_for_and_its_tensor_dropped(one_rank):
    with detect(echo=False) as findings:
        dist.all_reduce(torch.ones(4), async_op=True)  # tensor and work dropped at once
        deadline = time.monotonic() + 10
        while DROPPED not in [f.kind for f in findings] and time.monotonic() < deadline:
            time.sleep(0.01)  # gloo's worker frees the tensor once it has run the collective
        kept = torch.ones(4)
        dist.all_reduce(kept, async_op=True)
        dist.all_reduce(kept, async_op=True).wait()  # the next launch on its memory
    kinds = [f.kind for f in findings]
    assert kinds.count(NEVER) == 2 and DROPPED in kinds  # the dropped one at the end, the kept one at the launch


def test_detect_cannot_be_nested_and_undoes_its_patches(one_rank):
    wait = dist.Work.wait
    with detect(echo=False):
        assert dist.Work.wait is not wait
        with pytest.raises(RuntimeError, match="already running"), detect():
            pass
    assert dist.Work.wait is wait


def test_a_broadcasts_root_only_sends_its_tensor(one_rank):
    with detect(echo=False) as findings:
        sent = torch.ones(4)
        work = dist.broadcast(sent, src=0, async_op=True)  # rank 0 is the root of the one-rank group
        sent.sum()  # reading what is being sent is safe
        sent.add_(1)  # changing it is not
        work.wait()
    assert [f.kind for f in findings] == [WRITE]
