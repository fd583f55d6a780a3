"""The journal loses nothing it can keep and never takes a thread down with it: a full disk is
reported (once, loudly, to listeners) instead of raised, a torn line never swallows the next
record, and readers (and ``ftharness report``) survive any line a crash or a person left."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runtime.journal import Journal, read_journal

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_reported_not_raised(capfd: pytest.CaptureFixture[str]) -> None:
    # Writing to /dev/full fails with ENOSPC, exactly as a full file system does.
    journal = Journal("/dev/full", job="t")
    heard: list[OSError] = []
    journal.on_error(heard.append)
    seen: list[dict] = []
    journal.add_sink(seen.append)
    raised: list[BaseException] = []

    def controller_thread() -> None:
        try:
            journal.emit("failure", replica=1)
            journal.emit("supervisor", decision="restart_one")
        except BaseException as e:  # the test reports any escape
            raised.append(e)

    t = threading.Thread(target=controller_thread)
    t.start()
    t.join(timeout=10)
    assert raised == []
    assert journal.error is not None and journal.error.errno == errno.ENOSPC
    assert journal.lost == 2
    assert len(heard) == 1 and heard[0] is journal.error  # told once, not per record
    assert [r["event"] for r in seen] == ["failure", "supervisor"]  # sinks still get them
    late: list[OSError] = []
    journal.on_error(late.append)  # subscribing after the fact still hears about it
    assert late == [journal.error]
    journal.close()
    err = capfd.readouterr().err
    assert err.count("journal /dev/full: write failed") == 1
    assert "No space left on device" in err


# Fills the journal's file up to RLIMIT_FSIZE (a real short write, then EFBIG, as a disk that
# fills mid-record), then lifts the limit: the records after it must be readable again.
_FILLER = """
import resource, signal, sys
from runtime.journal import Journal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
journal = Journal(sys.argv[1], job="t")
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
i = 0
while journal.error is None:
    journal.emit("step.commit", step=i, pad="x" * 37)
    i += 1
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
journal.emit("after", n=1)
journal.emit("after", n=2)
journal.close()
print(journal.lost, journal.error.errno)
"""


@pytest.mark.timeout(60)
def test_a_record_torn_by_a_full_disk_does_not_swallow_the_next(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _FILLER, str(path)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    lost, code = done.stdout.split()
    assert (lost, int(code)) == ("1", errno.EFBIG)
    data = path.read_bytes()
    assert len(data) > 1000 and data[999:1000] != b"\n"  # the write was cut short mid-line
    problems: list[str] = []
    records = read_journal(path, problems=problems)
    assert [r["n"] for r in records if r["event"] == "after"] == [1, 2]
    commits = [r["step"] for r in records if r["event"] == "step.commit"]
    assert commits == list(range(len(commits))) and commits
    assert len(problems) == 1 and "not valid JSON" in problems[0]  # only the torn one


def test_reopening_after_a_torn_last_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    whole = json.dumps({"t": 1.0, "event": "job.start", "job": "t"})
    path.write_text(whole + '\n{"t": 2.0, "event": "step.co')  # the writer died mid-record
    journal = Journal(path, job="t")
    journal.emit("job.restart", t=3.0, reason="x")
    journal.close()
    assert [r["event"] for r in read_journal(path)] == ["job.start", "job.restart"]


def test_reader_skips_and_names_what_no_reader_could_use(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    good = [
        {"t": 2.0, "event": "step.commit", "step": 1},
        {"t": 1.0, "event": "job.start"},
    ]
    lines = [
        json.dumps(good[0]).encode(),
        b"[1, 2]",
        b'"x"',
        b'{"event": "step.commit", "step": 2}',  # no t
        b'{"t": "yesterday", "event": "x"}',
        b'{"t": NaN, "event": "x"}',
        b'{"t": 5.0}',  # no event
        '{"t": 6.0, "event": "caf\u00e9"}'.encode()[:-4],  # torn inside a UTF-8 character
        json.dumps(good[1]).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    problems: list[str] = []
    records = read_journal(path, problems=problems)
    assert records == [good[1], good[0]]
    assert len(problems) == 7
    assert problems[0] == f"{path}:2: not a JSON object: list"
    assert any(":4: no finite time 't'" in p for p in problems)


def test_report_survives_malformed_records(tmp_path: Path) -> None:
    """``ftharness report`` on a journal with odd lines reports on the rest, no traceback."""
    journal = Journal(tmp_path / "journal.jsonl", job="t", policy="in_place")
    journal.emit("job.start", config={}, replicas=1, ranks=1)
    for step in range(1, 4):
        journal.emit("step.commit", replica=0, rank=0, step=step, loss=1.0, samples=8)
    journal.emit("job.end", status="ok", reason="done", steps=3)
    journal.close()
    with open(tmp_path / "journal.jsonl", "a") as fh:
        fh.write('[1, 2]\n"x"\n{"event": "step.commit", "replica": 0, "step": 9}\n')
    done = subprocess.run(
        [sys.executable, "-m", "harness", "report", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "report.json").is_file()


def test_journal_file_is_private(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "run" / "journal.jsonl", job="t")
    journal.emit("job.start")
    journal.close()
    assert stat.S_IMODE((tmp_path / "run" / "journal.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700


# --- one run per directory: a second run never mixes into the first one's journal ------------


def _cli(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("command", ["run", "chaos"])
def test_out_holding_an_earlier_run_is_refused(tmp_path: Path, command: str) -> None:
    out = tmp_path / "earlier"
    out.mkdir()
    earlier = out / "journal.jsonl"
    earlier.write_text('{"t": 1.0, "event": "job.start", "job": "tiny"}\n')
    source = "experiments/tiny.toml" if command == "run" else "experiments/quickstart.toml"
    done = _cli(command, str(REPO / source), "--out", str(out), "--quiet")
    assert done.returncode == 2, done.stderr
    assert f"run directory {out} already holds an earlier run; pass --out with a new " in (
        done.stderr
    )
    assert sorted(p.name for p in out.iterdir()) == ["journal.jsonl"]  # nothing launched
    assert earlier.read_text().count("\n") == 1


def test_default_run_dir_moves_on_to_a_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.rundir import choose_run_dir

    monkeypatch.chdir(tmp_path)
    first, note = choose_run_dir(None, "tiny")
    assert (first, note) == (Path("runs/tiny"), None)
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    (first / "journal.jsonl").write_text("{}\n")
    second, note = choose_run_dir(None, "tiny")
    assert second == Path("runs/tiny-2")
    assert (
        note == "runs/tiny holds an earlier run; this run writes to runs/tiny-2 (choose with --out)"
    )
    assert stat.S_IMODE(second.stat().st_mode) == 0o700
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    assert choose_run_dir(str(empty), "tiny") == (empty, None)  # an empty --out is fine
    assert stat.S_IMODE(empty.stat().st_mode) == 0o700


def test_a_private_dir_never_chmods_a_folder_that_holds_other_things(tmp_path: Path) -> None:
    from harness.rundir import make_private_dir

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "theirs.txt").write_text("x")
    os.chmod(shared, 0o755)
    make_private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    made = make_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
