"""The preflight's pure parts: how a failed connection is classified, which addresses count as
loopback, the matrix a round's answers make, the table a user reads, the services probed, and the
controller's mailbox for the agents' answers."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from harness.config import JobConfig, load_config
from harness.job.preflight import cells_from_journal, render, services
from runtime.messages import PreflightListening, PreflightReport, PreflightResult
from runtime.preflight import (
    Outcome,
    answer_token,
    ask_token,
    classify,
    describe,
    is_loopback,
    resolve,
)
from runtime.preflight_matrix import Cell, PreflightBoard, _cells

pytestmark = pytest.mark.timeout(10)


def test_errors_are_classified_as_a_user_would_name_them() -> None:
    assert classify(errno.ECONNREFUSED) is Outcome.REFUSED
    assert classify(errno.ETIMEDOUT) is Outcome.TIMED_OUT
    for err in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN):
        assert classify(err) is Outcome.UNREACHABLE
    assert classify(errno.EACCES) is Outcome.ERROR  # e.g. a local firewall's EPERM/EACCES
    assert describe(errno.ECONNREFUSED) == "ECONNREFUSED: Connection refused"


def test_loopback_addresses() -> None:
    for a in ("127.0.0.1", "127.0.1.1", "::1", "[::1]"):
        assert is_loopback(a), a
    for a in ("10.0.0.1", "0.0.0.0", "::", "host0", ""):
        assert not is_loopback(a), a
    assert resolve("10.1.2.3")[1] == "10.1.2.3" and resolve("[::1]")[1] == "::1"


def test_tokens_are_per_round_per_host_and_per_direction() -> None:
    s, n = b"s" * 32, b"n" * 16
    tokens = {
        ask_token(s, n, "h0"),
        ask_token(s, n, "h1"),
        ask_token(s, b"m" * 16, "h0"),
        ask_token(b"t" * 32, n, "h0"),
        answer_token(s, n, "h0"),
    }
    assert len(tokens) == 5 and all(len(t) == 32 for t in tokens)


def _result(target: str, outcome: Outcome, detail: str = "") -> PreflightResult:
    return PreflightResult(target, "10.0.0.1", 4000, outcome.value, detail, 0.01)


def test_a_rounds_answers_make_one_cell_per_path() -> None:
    n = b"x"
    listening = {
        "h0": PreflightListening(n, "h0", 4000, "p0", ""),
        "h1": PreflightListening(n, "h1", 0, "p1", "cannot listen: EADDRNOTAVAIL: ..."),
        # h2 never answered
    }
    reports = {
        "h0": PreflightReport(n, "h0", (_result("controller", Outcome.OK),)),
        # h1 listened (badly) but did not report its probes
    }
    cells = _cells(["h0", "h1", "h2"], {"h0": "a0", "h1": "a1", "h2": "a2"}, listening, reports)
    got = {(c.src, c.dst, c.outcome) for c in cells}
    assert got == {
        ("h0", "controller", "ok"),
        ("h1", "h1", "not listening"),
        ("h1", "*", "no answer"),
        ("h2", "*", "no answer"),
    }


def test_the_table_names_both_ends_and_why() -> None:
    cells = [
        Cell("host0", "host1", "10.251.7.12", 40411, "ok", "the agent answered", 0.001),
        Cell("host1", "host0", "10.251.7.11", 40123, "timed out", "waited 1.5 s for ...", 1.5),
        Cell("host2", "host0", "127.0.1.1", 40123, "loopback", "127.0.1.1 is a loopback ...", 0),
        Cell("host2", "controller", "10.251.7.1", 5000, "ok", "connected", 0.001),
    ]
    text = render(cells, 1.52)
    lines = text.splitlines()
    assert lines[0].startswith("preflight failed: 2 of 4 network path(s) do not work")
    assert "checked in 1.52 s" in lines[0] and "not started" in lines[0]
    assert lines[1].split()[:4] == ["from", "to", "address", "result"]
    assert lines[2].split()[:5] == ["host1", "host0", "10.251.7.11:40123", "timed", "out"]
    assert lines[3].split()[:4] == ["host2", "host0", "127.0.1.1:40123", "loopback"]
    assert "host0   host1" not in text  # only the paths that do not work
    assert any(ln.strip().startswith("timed out:") for ln in lines)
    assert any(ln.strip().startswith("loopback:") for ln in lines)
    assert not any(ln.strip().startswith("refused:") for ln in lines)
    assert "preflight = false" in text


def test_cells_round_trip_through_the_journal() -> None:
    from dataclasses import asdict

    c = Cell("h0", "h1", "10.0.0.2", 1, "refused", "ECONNREFUSED", 0.002)
    assert cells_from_journal({"matrix": [asdict(c)]}) == [c]


def test_the_services_probed_are_the_controllers_listener_and_the_quorum() -> None:
    class C:
        address = ("10.251.7.1", 5000)

    assert services(C(), "http://10.251.7.1:6000") == [
        ("controller", "10.251.7.1", 5000),
        ("quorum", "10.251.7.1", 6000),
    ]
    assert services(C(), "") == [("controller", "10.251.7.1", 5000)]
    assert services(C(), "http://[fd00::1]:7")[1] == ("quorum", "fd00::1", 7)


def test_the_board_keeps_only_the_rounds_answers_and_waits_for_all() -> None:
    board = PreflightBoard()
    board.deliver("h0", PreflightListening(b"a", "h0", 1, "p", ""))  # no round: dropped
    board.begin(b"a")
    board.deliver("h0", PreflightListening(b"old", "h0", 1, "p", ""))  # another round: dropped
    threading.Timer(0.1, board.deliver, ("h1", PreflightListening(b"a", "h1", 2, "p", ""))).start()
    board.deliver("h0", PreflightListening(b"a", "h0", 3, "p", ""))
    t0 = time.monotonic()
    got = board.collect(PreflightListening, ["h0", "h1"], time.monotonic() + 5)
    assert 0.05 < time.monotonic() - t0 < 2 and {h: m.port for h, m in got.items()} == {
        "h0": 3,
        "h1": 2,
    }
    t0 = time.monotonic()
    got = board.collect(PreflightListening, ["h0", "h2"], time.monotonic() + 0.2)
    assert set(got) == {"h0"} and time.monotonic() - t0 >= 0.19  # h2: gave up at the deadline
    board.end()
    assert board.collect(PreflightListening, ["h0"], time.monotonic()) == {}


def test_the_preflight_is_on_by_default_and_configurable() -> None:
    cfg = JobConfig()
    assert cfg.preflight is True and 0 < cfg.timeouts.preflight <= 2.0
    off = load_config("experiments/tiny.toml", ["preflight=false", "timeouts.preflight=0.5"])
    assert off.preflight is False and off.timeouts.preflight == 0.5
