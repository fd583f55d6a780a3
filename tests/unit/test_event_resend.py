"""Worker events sent again to a takeover controller (runtime.resend): the journal's marks, what
a worker keeps and sends again, what a controller journals, and the worker's sending order."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from typing import Any

import pytest

from runtime.channel import ChannelError, Connection, FrameError
from runtime.messages import Event, Welcome
from runtime.resend import Marks, Retained, first_welcome
from runtime.takeover import event_marks
from runtime.worker import _Link, _Outbox


def test_event_marks_are_the_highest_number_journaled_per_process() -> None:
    records = [
        {"event": "job.start", "t": 0.0},
        {"event": "tick", "proc": "h0/p0", "eseq": 3},
        {"event": "tick", "proc": "h0/p0", "eseq": 7},
        {"event": "tick", "proc": "h0/p0", "eseq": 5},  # journaled out of order: still 7
        {"event": "tick", "proc": "h1/p0", "eseq": 1},
        {"event": "proc.start", "proc": "h1/p1", "pid": 4},  # no number: not a worker event
        {"event": "group.start", "seq": 9, "procs": ["h0/p0"]},  # seq is not eseq
        {"event": "tick", "proc": "h2/p0", "eseq": "12"},  # not a number (edited): ignored
        {"event": "tick", "proc": "h2/p0", "eseq": True},
    ]
    assert event_marks(records) == {"h0/p0": 7, "h1/p0": 1}
    assert event_marks([]) == {}


def test_retained_sends_again_only_past_the_mark_in_order() -> None:
    kept = Retained()
    for seq in range(1, 6):
        kept.keep(seq, b"e%d" % seq)
    assert kept.after(3) == [b"e4", b"e5"]
    assert len(kept) == 2  # those the journal holds are dropped
    assert kept.after(3) == [b"e4", b"e5"]  # the rest stay: the next controller may die too
    assert kept.after(5) == []
    assert kept.after(0) == []


def test_retained_is_bounded_by_frames_and_bytes_and_says_what_it_forgot(caplog: Any) -> None:
    kept = Retained(max_frames=3, max_bytes=1000)
    for seq in range(1, 6):
        kept.keep(seq, b"x")
    assert kept.after(0) == [b"x"] * 3 and kept.forgotten == 2
    assert "events 1..2 may be lost" in caplog.text
    big = Retained(max_frames=100, max_bytes=10)
    for seq in range(1, 5):
        big.keep(seq, b"1234")
    assert len(big) == 2 and big.forgotten == 2
    caplog.clear()
    assert big.after(2) == [b"1234"] * 2
    assert "may be lost" not in caplog.text  # the journal has everything forgotten


def test_marks_journal_each_numbered_event_once() -> None:
    marks = Marks({"h0/p0": 4})
    assert marks.mark("h0/p0") == 4
    assert marks.mark("h9/p9") == 0  # never heard from: send everything kept
    assert not marks.admit("h0/p0", 4)  # the journal has it
    assert marks.admit("h0/p0", 5) and not marks.admit("h0/p0", 5)
    assert marks.mark("h0/p0") == 5
    assert marks.admit("h0/p0", 0) and marks.admit("h0/p0", 0)  # unnumbered: always
    assert marks.admit("h1/p0", 1)


def test_messages_stay_compatible() -> None:
    assert Event("tick", {}).seq == 0  # unnumbered
    assert Welcome(3).resend_after == -1  # nothing to send again


class FakeConn:
    """A connection that records what is sent on it (decoded), or fails every send."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[Any] = []
        self.fail = fail
        self.sock = self

    def send_encoded(self, payload: bytes) -> None:
        if self.fail:
            raise ChannelError("dead")
        self.sent.append(pickle.loads(payload))

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


def wait_until(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def ticks(conn: FakeConn) -> list[tuple[int, int]]:
    return [(m.fields["i"], m.seq) for m in conn.sent if isinstance(m, Event)]


def test_a_worker_numbers_its_events_and_sends_a_new_controller_what_it_lacks_first() -> None:
    link = _Link(grace_s=60.0, epoch=1)
    outbox = _Outbox(link, {})
    old = FakeConn()
    link.attach(old)
    for i in range(5):
        outbox.put(Event("tick", {"i": i}))
    outbox.flush(5.0)
    assert ticks(old) == [(i, i + 1) for i in range(5)]  # numbered from 1
    # the controller dies having journaled up to 3; two more are queued while none serves
    link.lost(old)
    for i in range(5, 7):
        outbox.put(Event("tick", {"i": i}))
    new = FakeConn()
    link.attach(new, resend_after=3)
    outbox.resend_now()
    outbox.flush(5.0)
    # 4 and 5 again first, then what was queued: in order, nothing the journal holds
    assert [s for _, s in ticks(new)] == [4, 5, 6, 7]


def test_a_new_connection_gets_what_it_lacks_without_a_new_event() -> None:
    link = _Link(grace_s=60.0, epoch=1)
    outbox = _Outbox(link, {})
    old = FakeConn()
    link.attach(old)
    for i in range(3):
        outbox.put(Event("tick", {"i": i}))
    outbox.flush(5.0)
    link.lost(old)
    new = FakeConn()
    link.attach(new, resend_after=0)  # a process the journal never heard from: everything
    outbox.resend_now()
    wait_until(lambda: len(new.sent) == 3)
    assert [s for _, s in ticks(new)] == [1, 2, 3]


def test_without_a_mark_nothing_is_sent_again() -> None:
    link = _Link(grace_s=60.0, epoch=1)
    outbox = _Outbox(link, {})
    old = FakeConn()
    link.attach(old)
    outbox.put(Event("tick", {"i": 0}))
    outbox.flush(5.0)
    link.lost(old)
    new = FakeConn()
    link.attach(new)  # a controller that does not say (resend_after -1)
    outbox.resend_now()
    outbox.put(Event("tick", {"i": 1}))
    outbox.flush(5.0)
    assert ticks(new) == [(1, 2)]


def test_events_put_from_many_threads_are_sent_in_number_order() -> None:
    link = _Link(grace_s=60.0, epoch=1)
    outbox = _Outbox(link, {})
    conn = FakeConn()
    link.attach(conn)

    def emit(k: int) -> None:
        for i in range(200):
            outbox.put(Event("tick", {"i": k * 1000 + i}))

    threads = [threading.Thread(target=emit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outbox.flush(5.0)
    assert [s for _, s in ticks(conn)] == list(range(1, 801))


def test_without_survival_nothing_is_kept() -> None:
    link = _Link(grace_s=0.0, epoch=1)
    outbox = _Outbox(link, {})
    conn = FakeConn()
    link.attach(conn)
    outbox.put(Event("tick", {"i": 0}))
    outbox.flush(5.0)
    assert ticks(conn) == [(0, 1)]
    assert len(outbox._retained) == 0


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def test_a_redialling_worker_reads_the_welcome_first_and_gives_up_on_none() -> None:
    a, b = tcp_pair()
    worker, controller = Connection(a), Connection(b)
    try:
        controller.send(Welcome(2, 5))
        assert first_welcome(worker, 1.0) == Welcome(2, 5)
        assert a.gettimeout() is None  # blocking again, for the receiver thread
        with pytest.raises(ChannelError):
            first_welcome(worker, 0.05)  # nothing comes in time
    finally:
        worker.close()
        controller.close()
    a, b = tcp_pair()
    worker, controller = Connection(a), Connection(b)
    try:
        controller.send(Event("tick", {}))
        with pytest.raises(FrameError):
            first_welcome(worker, 1.0)  # anything else first: a broken controller
    finally:
        worker.close()
        controller.close()
