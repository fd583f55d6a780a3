"""The run's control file, the job secret file, and the epoch fence (runtime.control_file), and
the pure parts of a controller takeover (runtime.orphan, runtime.proc_handle.CallTable)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.control_file import (
    ControlFileError,
    EpochFence,
    read_control,
    read_secret,
    write_control,
    write_secret,
)
from runtime.messages import AgentBeat, Exited, PreflightReply
from runtime.orphan import MAX_KEPT, FrameQueue, Survival, parse_redial, tell_workers


def test_written_whole_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "controller.json"
    assert read_control(path) is None  # no controller wrote it yet
    info = write_control(path, ("127.0.0.1", 4242), 3)
    assert read_control(path) == info
    assert info.address == ("127.0.0.1", 4242) and info.epoch == 3 and info.pid == os.getpid()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["controller.json"]  # no temporary left
    write_control(path, ("127.0.0.1", 4243), 4)
    got = read_control(path)
    assert got is not None and got.epoch == 4 and got.address[1] == 4243


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"address": "127.0.0.1:1", "epoch": 2, "pi', "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"address": "nowhere", "epoch": 1, "pid": 5, "started": 1.0}', "HOST:PORT"),
        ('{"address": "h:70000", "epoch": 1, "pid": 5, "started": 1.0}', "HOST:PORT"),
        ('{"address": "h:1", "epoch": 0, "pid": 5, "started": 1.0}', "'epoch'"),
        ('{"address": "h:1", "epoch": true, "pid": 5, "started": 1.0}', "'epoch'"),
        ('{"address": "h:1", "epoch": 1, "pid": "5", "started": 1.0}', "'pid'"),
        ('{"address": "h:1", "epoch": 1, "pid": 5, "started": NaN}', "'started'"),
        ("x" * 5000, "over 4096 bytes"),
    ],
)
def test_a_torn_or_edited_file_is_refused_with_the_reason(
    tmp_path: Path, text: str, why: str
) -> None:
    path = tmp_path / "controller.json"
    path.write_text(text)
    with pytest.raises(ControlFileError, match=why):
        read_control(path)


def test_a_bad_epoch_is_never_written(tmp_path: Path) -> None:
    for epoch in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="epoch"):
            write_control(tmp_path / "c.json", ("h", 1), epoch)  # type: ignore[arg-type]
    assert not (tmp_path / "c.json").exists()


def test_the_secret_file_is_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    write_secret(path, b"\x01\x02" * 16)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(str(path)) == b"\x01\x02" * 16
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        read_secret(str(path))
    path.chmod(0o600)
    path.write_text("not hex")
    with pytest.raises(ValueError, match="not a hex secret"):
        read_secret(str(path))


def test_the_fence_falls_once_a_newer_epoch_is_written(tmp_path: Path) -> None:
    path = tmp_path / "controller.json"
    fence = EpochFence(path, 1)
    assert fence()  # no file yet: nothing says we were replaced
    write_control(path, ("127.0.0.1", 1), 1)
    assert fence()
    write_control(path, ("127.0.0.1", 2), 2)
    assert not fence()
    path.write_text("torn")  # unreadable: the last verdict stands
    assert not fence()


def test_a_fenced_journal_exits_before_it_appends(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from runtime.control_file import EpochFence, write_control
        from runtime.journal import Journal
        path = {str(tmp_path / "controller.json")!r}
        write_control(path, ("127.0.0.1", 1), 1)
        j = Journal({str(tmp_path / "journal.jsonl")!r}, job="j", fence=EpochFence(path, 1))
        j.emit("before")
        write_control(path, ("127.0.0.1", 2), 2)
        j.emit("after")
        print("not reached")
        """
    )
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 75, done.stderr
    assert "not reached" not in done.stdout
    assert "newer controller" in done.stderr
    events = [json.loads(line)["event"] for line in (tmp_path / "journal.jsonl").open()]
    assert events == ["before"]


def test_an_orphaned_agent_keeps_what_matters_in_order(tmp_path: Path) -> None:
    s = Survival(tmp_path / "controller.json", grace_s=5.0)
    s.lose(100.0, [Exited("h/p0", 1, 9, 1.0), AgentBeat(1.0)])
    s.keep(PreflightReply(b"n", "h"))
    s.keep(Exited("h/p1", 2, 9, 2.0))
    assert s.orphaned and not s.expired(104.0) and s.expired(105.5)
    assert [m.proc_id for m in s.attached()] == ["h/p0", "h/p1"]
    assert not s.orphaned
    s.lose(0.0, [])
    for i in range(MAX_KEPT + 5):
        s.keep(Exited(f"h/p{i}", i, 0, 0.0))
    kept = s.attached()
    assert len(kept) == MAX_KEPT and kept[0].proc_id == "h/p5"  # the oldest dropped


def test_no_controller_to_dial_until_a_newer_epoch_is_written(tmp_path: Path) -> None:
    from runtime.messages import AgentReport

    path = tmp_path / "controller.json"
    s = Survival(path, grace_s=5.0)
    report = AgentReport((), 1, "127.0.0.1")
    assert s.dial("h", b"k", 1, report) is None  # no file
    write_control(path, ("127.0.0.1", 1), 1)
    assert s.dial("h", b"k", 1, report) is None  # the epoch served: a stopped old controller


def test_frames_not_sent_whole_are_kept_for_the_next_link() -> None:
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    q = FrameQueue()
    q.push("first", b"x" * 10)
    q.send_some(a)
    assert not q and q.bytes == 0
    big = b"y" * (8 << 20)  # more than a socket buffer takes at once
    q.push("big", big)
    q.push("after", b"z")
    q.send_some(a)
    assert q and 0 < q.bytes < len(big) + 1
    assert q.take_unsent() == ["big", "after"]
    assert not q and q.bytes == 0
    a.close()
    b.close()


def test_redial_lines_round_trip() -> None:
    import socket

    a, b = socket.socketpair()
    tell_workers([a], ("10.0.0.2", 4242), 7)
    line = b.recv(4096)
    assert line.endswith(b"\n")
    assert parse_redial(line.strip()) == (("10.0.0.2", 4242), 7)
    assert parse_redial(b"R{nonsense") is None
    assert parse_redial(b".") is None
    a.close()
    b.close()


def test_a_previous_controllers_result_waits_for_its_claim() -> None:
    from runtime.mesh import ProcRef
    from runtime.proc_handle import CallTable, ProcRecord

    table = CallTable(first=(1 << 32) + 1)  # epoch 2
    rec = ProcRecord(ProcRef("h/p0", "h", {}), host=None)  # type: ignore[arg-type]
    early = table.pop_or_keep(rec, 5)  # a result before anyone asked for it
    assert early is not None
    early.set_result("done")
    assert table.claim(rec, 5).result(timeout=0) == "done"
    later = table.claim(rec, 6)  # asked before its result came
    assert table.pop_or_keep(rec, 6) is later
    assert table.pop_or_keep(rec, (1 << 32) + 9) is None  # one of ours nobody waits for
    call_id, _ = table.open(rec)
    assert call_id == (1 << 32) + 1


def test_a_takeover_epoch_must_be_above_the_files(tmp_path: Path) -> None:
    from runtime.takeover import Succession

    path = tmp_path / "controller.json"
    with pytest.raises(ValueError, match="needs the run's control file"):
        Succession(None, None, True, 5.0)
    assert Succession(None, None, False, 5.0).boot_settings() == {}  # no survival without one
    write_control(path, ("127.0.0.1", 1), 3)
    assert Succession(path, None, True, 5.0).epoch == 4
    with pytest.raises(ValueError, match="took this run over already"):
        Succession(path, 3, True, 5.0)
    assert Succession(path, 4, True, 5.0).boot_settings() == {
        "control_file": str(path),
        "grace_s": 5.0,
    }
    assert Succession(path, 4, True, 0.0).boot_settings() == {}  # a grace of 0: no survival
    path.write_text("{torn")
    with pytest.raises(ControlFileError):
        Succession(path, None, True, 5.0)
