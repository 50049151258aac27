"""The desync progress records, in one process: the exact record each call writes to the store, when a
wait is recorded, the grace given to a rank at the same position, and the text naming the ranks behind.

Other ranks are played by records written straight into a fake store (rank and world size come from a
fake group), the grace period runs on a fake clock, and one test uses the real one-rank gloo group's
store. Nothing is spawned and nothing really sleeps, so a mutant of overlapddp/progress.py fails here
within a second instead of only in tests/test_desync.py's multi-process runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from overlapddp import progress
from overlapddp.progress import Position, ProgressRecord
from overlapddp.torch_compat import group_store

TAIL = " A rank not waiting on a bucket is stuck outside OverlapDDP, has finished its loop, or died."
NOT_WAITING = "forward ran, its backward not reduced, not waiting on a bucket"


class FakeStore:
    """The store calls the records make (set, check, get), on a dict; values come back as bytes, as a
    TCPStore's do. ``fail_set`` makes every set raise; ``fail_read`` is raised by check."""

    def __init__(self, fail_set: bool = False, fail_read: Exception | None = None) -> None:
        self.values: dict[str, bytes] = {}
        self.set_keys: list[str] = []  # every key set was called with, failed calls included
        self.fail_set = fail_set
        self.fail_read = fail_read
        self.checks = 0

    def set(self, key: str, value: str) -> None:
        self.set_keys.append(key)
        if self.fail_set:
            raise RuntimeError("the store went away")
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        assert self.checks < 10_000, "the records are read without end"
        if self.fail_read is not None:
            raise self.fail_read
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


class FakeGroup:
    """A process group as the record sees one: a rank (read through the patched ``dist.get_rank``) and a size."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self._size = size

    def size(self) -> int:
        return self._size


class FakeClock:
    """``time`` for the grace loop: sleeping advances the clock exactly (rounded to a nanosecond, so
    twenty 0.1 s sleeps end exactly on the deadline), and ``on_sleep`` lets another rank act after each."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[int], None] = lambda slept: None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")  # as time.sleep says
        self.sleeps.append(seconds)
        assert len(self.sleeps) < 1000, "the grace loop does not end"
        self.now = round(self.now + seconds, 9)
        self.on_sleep(len(self.sleeps))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The module's ``time`` replaced: a real grace period would sleep 2 s per test."""
    fake = FakeClock()
    monkeypatch.setattr(progress, "time", fake)
    return fake


def _record(monkeypatch: pytest.MonkeyPatch, store: Any, rank: int, size: int, parameters: int = 7,
            device: torch.device | None = None) -> ProgressRecord:
    """A record of ``rank`` in a group of ``size`` whose store is ``store``."""
    monkeypatch.setattr(progress, "group_store", lambda group: store)
    monkeypatch.setattr(progress, "dist", SimpleNamespace(get_rank=lambda group: group.rank))
    return ProgressRecord(FakeGroup(rank, size), parameters, device)  # type: ignore[arg-type]


def _value(store: FakeStore, key: str) -> list[Any]:
    return json.loads(store.values[key])


def _prefix(store: FakeStore) -> str:
    """The record's key space, from the first key it wrote (its own)."""
    first = store.set_keys[0]
    return first[: first.rindex("/") + 1]


def _peer(store: FakeStore, rank: int, record: list[Any]) -> None:
    """Another rank's record: [iteration, reductions, dropped, last_dropped, waiting or None]."""
    store.values[_prefix(store) + str(rank)] = json.dumps(record).encode()


class _Future:
    """A work handle's future; only ``done`` is read."""

    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


# -- what is written -------------------------------------------------------------------------------


def test_each_call_writes_the_exact_record_under_the_ranks_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record is a JSON list in a fixed field order, under overlapddp/progress/<wrapper>-<parameters>/<rank>;
    dropped forwards accumulate and are kept by later forwards and reductions, and a reduction clears the wait."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=2, size=3, parameters=7)
    record.wait_for(4, _Future(done=False))  # before any forward: the first backward, nothing reduced
    (key,) = set(store.set_keys)
    assert re.fullmatch(r"overlapddp/progress/\d+-7/2", key), key
    assert store.values[key] == b"[0, 0, 0, null, [1, 4]]"
    steps: list[tuple[Callable[[], None], list[Any]]] = [
        (lambda: record.forward(1, 0, False), [1, 0, 0, None, None]),
        (lambda: record.forward(2, 0, True), [2, 0, 1, 1, None]),  # forward 1's backward never came
        (lambda: record.forward(3, 0, True), [3, 0, 2, 2, None]),
        (lambda: record.reduced(3, 1), [3, 1, 2, 2, None]),
        (lambda: record.forward(4, 1, False), [4, 1, 2, 2, None]),
        (lambda: record.wait_for(0, _Future(done=False)), [4, 1, 2, 2, [2, 0]]),
        (lambda: record.wait_for(3, _Future(done=False)), [4, 1, 2, 2, [2, 3]]),
        (lambda: record.reduced(4, 2), [4, 2, 2, 2, None]),
    ]
    for step, expected in steps:
        step()
        assert _value(store, key) == expected
    assert store.set_keys == [key] * (1 + len(steps))  # one write per call, nothing else


def test_a_wait_is_recorded_only_while_the_collective_is_not_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug (progress_waiting_unrecorded): the "waiting" record must be written when the
    bucket's collective is still running, which is when a hang can follow, and not when it is done."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(3, 2, False)
    key = store.set_keys[0]
    record.wait_for(1, _Future(done=True))
    assert store.set_keys == [key]  # a done bucket adds no write
    assert _value(store, key) == [3, 2, 0, None, None]
    record.wait_for(1, _Future(done=False))
    assert store.set_keys == [key, key]
    assert _value(store, key) == [3, 2, 0, None, [3, 1]]


def test_records_are_keyed_by_construction_order_and_parameter_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wrapper gets the next key space, so two wrappers in one process never share records."""
    first_store, second_store = FakeStore(), FakeStore()
    first = _record(monkeypatch, first_store, rank=1, size=2, parameters=3)
    second = _record(monkeypatch, second_store, rank=1, size=2, parameters=5)
    first.forward(1, 0, False)
    second.forward(1, 0, False)
    number = int(re.fullmatch(r"overlapddp/progress/(\d+)-3/1", first_store.set_keys[0]).group(1))  # type: ignore[union-attr]
    assert second_store.set_keys == [f"overlapddp/progress/{number + 1}-5/1"]
    third_store = FakeStore()
    monkeypatch.setattr(progress, "group_store", lambda group: third_store)
    ProgressRecord(FakeGroup(1, 2)).forward(1, 0, False)  # type: ignore[arg-type]  # no parameter count given
    assert third_store.set_keys == [f"overlapddp/progress/{number + 2}-0/1"]


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["no device", "cpu"])
def test_a_host_record_uses_the_groups_store(monkeypatch: pytest.MonkeyPatch, device: torch.device | None) -> None:
    """No device given means the host (as the reducer's default record has): records are kept."""
    store = FakeStore()
    _record(monkeypatch, store, rank=0, size=1, device=device).forward(1, 0, False)
    assert len(store.set_keys) == 1


@pytest.mark.parametrize("device", [torch.device("cuda"), torch.device("meta")], ids=["cuda", "meta"])
def test_a_device_record_keeps_nothing(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Off the host no record is kept: no write, no wait recorded, no text for an error."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2, device=device)
    record.forward(1, 0, False)
    record.wait_for(0, _Future(done=False))
    record.reduced(1, 1)
    assert record.behind(0) == ""
    assert store.set_keys == []


def test_a_record_without_a_group_keeps_nothing() -> None:
    """The reducer's default record (no group): every call is a no-op, and an error gets no text."""
    record = ProgressRecord()
    record.forward(1, 0, True)
    record.wait_for(0, _Future(done=False))
    record.reduced(1, 1)
    assert record.behind(0) == ""
    assert record.behind(0, after_reduction=True) == ""
    assert record._others() == {}


def test_a_store_that_fails_a_write_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that is gone must not turn a training step into an error: the first failed write is
    swallowed, no write is tried again, and an error then gets no text from the records."""
    store = FakeStore(fail_set=True)
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(1, 0, False)
    record.wait_for(0, _Future(done=False))
    record.reduced(1, 1)
    assert len(store.set_keys) == 1
    assert record.behind(0) == ""


# -- where another rank is -------------------------------------------------------------------------


def test_describe_says_which_bucket_of_which_backward_a_rank_waits_for() -> None:
    """The waiting text takes the bucket from the second field and the backward from the first."""
    mine = Position(6, 4, 0, None, None)
    assert Position(6, 4, 0, None, (5, 2)).describe(mine) == "iteration 6 (waiting for bucket 2 of backward 5; 4 backwards reduced)"


def test_describe_tells_a_forward_without_reduction_from_a_finished_reduction() -> None:
    """Fewer reductions than iterations: its backward is not reduced; as many: it is between iterations."""
    mine = Position(3, 3, 0, None, None)
    assert Position(3, 2, 0, None, None).describe(mine) == f"iteration 3 ({NOT_WAITING}; 2 backwards reduced)"
    assert Position(3, 3, 0, None, None).describe(mine) == (
        "iteration 3 (reduced, the next synchronized forward not reached; 3 backwards reduced)"
    )
    # Counts read back from the store are new int objects: above 256 they are equal, not identical.
    late = Position(int("300"), int("300"), 0, None, None)
    assert late.describe(mine) == "iteration 300 (reduced, the next synchronized forward not reached; 300 backwards reduced)"


def test_describe_counts_only_the_extra_forwards_without_a_backward() -> None:
    """The skipped-backward note appears only when the other rank dropped more forwards than this one, with the difference."""
    mine = Position(4, 4, 1, 1, None)
    assert Position(4, 3, 3, 2, None).describe(mine) == (
        f"iteration 4 ({NOT_WAITING}; 3 backwards reduced); it ran 2 more forward(s) without a backward than this rank, "
        "the last at iteration 2: a skipped backward makes each later backward of it pair with the other ranks' previous one"
    )
    assert "more forward(s)" not in Position(4, 3, 1, 1, None).describe(mine)  # as many as this rank
    assert "more forward(s)" not in Position(4, 3, 0, None, None).describe(mine)  # fewer: this rank skipped


def test_a_position_is_frozen() -> None:
    """A record read from the store is a snapshot: it cannot be changed after the fact."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        Position(1, 0, 0, None, None).iteration = 2  # type: ignore[misc]


# -- the ranks behind ------------------------------------------------------------------------------


def _rank_1_of_4(monkeypatch: pytest.MonkeyPatch) -> tuple[ProgressRecord, FakeStore]:
    """Rank 1 at iteration 5 with 4 backwards reduced; rank 0 never wrote a record, rank 2 skipped a
    backward and is at an earlier iteration, rank 3 waits for another bucket of the same backward."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=1, size=4)
    record.forward(5, 4, False)
    _peer(store, 2, [4, 3, 1, 2, None])
    _peer(store, 3, [5, 4, 0, None, [5, 3]])
    return record, store


def test_the_ranks_behind_are_named_in_rank_order_with_where_each_is(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """A missing record and a rank at an earlier iteration are behind; a rank waiting in the same
    backward is not; nobody at this rank's position means no grace wait."""
    record, store = _rank_1_of_4(monkeypatch)
    said = record.behind(2)
    assert said == (
        " Ranks behind: rank 0: no progress record (no synchronized forward of this model); "
        f"rank 2: at iteration 4 ({NOT_WAITING}; 3 backwards reduced); it ran 1 more forward(s) without a backward "
        "than this rank, the last at iteration 2: a skipped backward makes each later backward of it pair with the "
        f"other ranks' previous one (rank 1 waited for bucket 2 of backward 5 (iteration 5)).{TAIL}"
    )
    assert _value(store, _prefix(store) + "1") == [5, 4, 0, None, [5, 2]]  # written before reading the others
    assert clock.sleeps == []


def test_other_records_are_read_back_as_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank but this one, None where no record exists, the wait as a tuple (tests/test_desync.py reads these)."""
    record, _ = _rank_1_of_4(monkeypatch)
    assert record._others() == {0: None, 2: Position(4, 3, 1, 2, None), 3: Position(5, 4, 0, None, (5, 3))}


def test_a_rank_above_256_skips_its_own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's rank and the loop's ranks are equal ints, not the same objects, past CPython's small-int cache."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=int("300"), size=302)
    record.forward(1, 0, False)
    others = record._others()
    assert 300 not in others and sorted(others) == [*range(300), 301]


def test_ranks_that_reached_the_backward_are_not_behind(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """A rank that reduced this backward, one ahead of it, and one waiting for another of its buckets."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=1, size=4)
    record.forward(5, 4, False)
    _peer(store, 0, [5, 5, 0, None, None])
    _peer(store, 2, [7, 6, 0, None, None])
    _peer(store, 3, [5, 4, 0, None, [5, 3]])
    assert record.behind(2) == " Every other rank recorded reaching that backward (rank 1 waited for bucket 2 of backward 5 (iteration 5))."
    assert clock.sleeps == []


def test_a_rank_waiting_in_the_same_late_backward_is_not_behind(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """Past backward 256 the backward read back from the store is an equal int, not the same object."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(300, 299, False)
    _peer(store, 1, [300, 299, 0, None, [300, 1]])
    assert record.behind(0) == " Every other rank recorded reaching that backward (rank 0 waited for bucket 0 of backward 300 (iteration 300))."


def test_a_rank_waiting_in_an_earlier_backward_is_behind(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """Waiting is not enough: the wait must be in this backward's reduction."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(5, 4, False)
    _peer(store, 1, [4, 3, 0, None, [4, 0]])
    assert record.behind(2) == (
        " Ranks behind: rank 1: at iteration 4 (waiting for bucket 0 of backward 4; 3 backwards reduced) "
        f"(rank 0 waited for bucket 2 of backward 5 (iteration 5)).{TAIL}"
    )
    assert clock.sleeps == []


def test_after_a_reduction_a_rank_still_in_that_reduction_is_behind(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """A sharded optimizer's all-gather follows the backward this rank reduced last: a rank waiting in
    that reduction is behind, one that reduced it is at the same all-gather."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=2, size=3)
    record.forward(5, 4, False)
    record.reduced(5, 5)
    _peer(store, 0, [5, 4, 0, None, [5, 1]])
    _peer(store, 1, [5, 5, 0, None, [5, 1]])
    assert record.behind(1, after_reduction=True) == (
        " Ranks behind: rank 0: at iteration 5 (waiting for bucket 1 of backward 5; 4 backwards reduced) (rank 2 waited "
        f"for the all-gather of the updated parameters of bucket 1 of backward 5 (iteration 5)).{TAIL}"
    )
    assert _value(store, _prefix(store) + "2") == [5, 5, 0, None, [5, 1]]
    assert clock.sleeps == []


def test_an_unreadable_store_is_said_instead_of_the_ranks(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """The store goes with a dead rank: the error says the records could not be read, and why."""
    store = FakeStore(fail_read=RuntimeError("connection reset by peer"))
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(2, 1, False)
    assert record.behind(0) == " The ranks' progress records could not be read (connection reset by peer)."
    assert clock.sleeps == []


def test_a_store_lost_during_the_report_is_said_instead_of_every_rank_being_there(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """The store answered until this error's own record: no rank can be read, so none is said to be there."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(2, 1, False)
    _peer(store, 1, [2, 1, 0, None, [2, 0]])
    store.fail_set = True
    assert record.behind(0) == " The ranks' progress records could not be read (the store took no write)."
    assert clock.sleeps == []


# -- the grace for a rank at the same position -----------------------------------------------------


def _rank_0_beside_an_unsure_rank_1(monkeypatch: pytest.MonkeyPatch) -> tuple[ProgressRecord, FakeStore]:
    """Rank 0 and rank 1 both at iteration 3 with 2 backwards reduced; rank 1 not (yet) waiting."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(3, 2, False)
    _peer(store, 1, [3, 2, 0, None, None])
    return record, store


def test_a_rank_at_the_same_position_gets_the_grace_period_polled_every_tenth_second(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    """It may be about to fail the same wait: it is polled every 0.1 s until the clock is past the
    2 s deadline (not merely at it), then named as behind."""
    record, _ = _rank_0_beside_an_unsure_rank_1(monkeypatch)
    said = record.behind(0)
    assert said == (
        f" Ranks behind: rank 1: at iteration 3 ({NOT_WAITING}; 2 backwards reduced) "
        f"(rank 0 waited for bucket 0 of backward 3 (iteration 3)).{TAIL}"
    )
    assert clock.sleeps == [0.1] * 21  # at 102.0 the deadline is not yet passed
    assert progress.GRACE_S == 2.0


def test_the_grace_ends_as_soon_as_the_rank_records_the_same_wait(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    """The records are read again after each sleep: once rank 1 says it waits in the same backward,
    it is not behind, and nobody waits longer."""
    record, store = _rank_0_beside_an_unsure_rank_1(monkeypatch)

    def rank_1_starts_waiting(slept: int) -> None:
        if slept == 3:
            _peer(store, 1, [3, 2, 0, None, [3, 0]])

    clock.on_sleep = rank_1_starts_waiting
    assert record.behind(0) == " Every other rank recorded reaching that backward (rank 0 waited for bucket 0 of backward 3 (iteration 3))."
    assert clock.sleeps == [0.1] * 3


@pytest.mark.parametrize(
    "peer", [[4, 2, 0, None, None], [3, 1, 0, None, None], [3, 2, 1, 2, None]],
    ids=["later iteration", "fewer reductions", "more dropped"],
)
def test_no_grace_for_a_rank_at_another_position(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, peer: list[Any]) -> None:
    """Only a rank whose iteration, reductions and dropped forwards all equal this rank's is waited for."""
    store = FakeStore()
    record = _record(monkeypatch, store, rank=0, size=2)
    record.forward(3, 2, False)
    _peer(store, 1, peer)
    assert record.behind(0).startswith(" Ranks behind: rank 1: at iteration ")
    assert clock.sleeps == []


# -- the real store ------------------------------------------------------------------------------


def test_the_real_one_rank_groups_store_holds_the_record(one_rank: None) -> None:
    """Through the real group_store and TCPStore: a CPU record is written and read back; a CUDA one
    (NCCL: the host never waits) keeps nothing. Last in the file, under an alarm: with one rank there
    is no other record to read, so a grace loop that never ends would spin without touching a fake."""
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        _real_one_rank_store()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def _out_of_time(signum: int, frame: object) -> None:
    raise TimeoutError("the one-rank record did not answer within 5 s")


def _real_one_rank_store() -> None:
    store = group_store(dist.group.WORLD)
    number = next(progress._wrappers) + 1  # the next record's key space
    on_cpu = ProgressRecord(dist.group.WORLD, 4, torch.device("cpu"))
    on_cuda = ProgressRecord(dist.group.WORLD, 4, torch.device("cuda"))
    on_cpu.forward(1, 0, False)
    on_cuda.forward(1, 0, False)
    assert not store.check([f"overlapddp/progress/{number + 1}-4/0"])
    assert store.check([f"overlapddp/progress/{number}-4/0"])  # before get, which would block for a missing key
    assert store.get(f"overlapddp/progress/{number}-4/0") == b"[1, 0, 0, null, null]"
    assert on_cpu.behind(3) == " Every other rank recorded reaching that backward (rank 0 waited for bucket 3 of backward 1 (iteration 1))."
    assert store.get(f"overlapddp/progress/{number}-4/0") == b"[1, 0, 0, null, [1, 3]]"
    assert on_cuda.behind(3) == ""
