"""A run that is not a terminal session, as a user sees it: ``ftharness run --detach`` returns at
once, ``status`` says what runs, ``attach`` follows it to its end, ``stop`` stops it cleanly
(job.end in the journal, nothing left running); and ``attach | stop | status`` refuse a run that
does not exist, has ended, was killed or is another user's, with rc 2, changing nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.runctl import keeper_alive
from harness.rundir import find_job_end, read_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


def ftharness(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "harness", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    print(args, done.returncode, done.stdout[-2000:], done.stderr[-2000:], sep="\n")
    return done


@pytest.fixture
def detach():
    """``ftharness run --detach``; a run a failed test leaves running is stopped at teardown."""
    keepers: list[dict] = []

    def start(run_dir: Path, steps: int) -> dict:
        info = _detach(run_dir, steps)
        keepers.append(info)
        return info

    yield start
    for info in keepers:
        if keeper_alive(info):
            os.kill(info["pid"], signal.SIGTERM)
            psutil.wait_procs([psutil.Process(info["pid"])], timeout=60)


def _detach(run_dir: Path, steps: int) -> dict:
    done = ftharness(
        "run", "experiments/tiny.toml", "--set", f"steps={steps}", "--out", str(run_dir), "--detach"
    )
    assert done.returncode == 0, done.stderr
    assert f"running in the background in {run_dir}" in done.stdout
    assert f"ftharness attach {run_dir}" in done.stdout
    info = read_json(run_dir / "keeper.json")
    assert info is not None and info["detached"] and keeper_alive(info)
    return info


def _left_running(run_dir: Path) -> list[int]:
    """Processes whose command line names the run directory (keeper, controller)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if str(run_dir) in " ".join(p.info["cmdline"] or ()):
            left.append(p.info["pid"])
    return left


def test_a_detached_run_shows_its_status_and_is_followed_to_its_end(tmp_path: Path, detach) -> None:
    run_dir = tmp_path / "run"
    info = detach(run_dir, steps=100)
    status = ftharness("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert f"run {run_dir}: running" in status.stdout
    assert f"keeper      pid {info['pid']}" in status.stdout
    attach = ftharness("attach", str(run_dir))
    assert attach.returncode == 0, attach.stderr
    assert "tiny: ok — 100 steps committed" in attach.stdout  # the console, to its last line
    end = find_job_end(run_dir / "journal.jsonl")
    assert end is not None and end["status"] == "ok"
    assert not keeper_alive(info) and not _left_running(run_dir)
    for command in ("attach", "stop", "status"):  # it has ended: nothing to do
        done = ftharness(command, str(run_dir))
        assert done.returncode == 2 and "has ended (ok: trained to the last step" in done.stderr


def test_stop_stops_a_detached_run_cleanly(tmp_path: Path, detach) -> None:
    run_dir = tmp_path / "run"
    info = detach(run_dir, steps=100_000)
    journal = run_dir / "journal.jsonl"
    deadline = time.monotonic() + 90
    while '"step.commit"' not in (journal.read_text() if journal.exists() else ""):
        assert time.monotonic() < deadline and keeper_alive(info), "no step committed"
        time.sleep(0.2)
    stop = ftharness("stop", str(run_dir))
    assert stop.returncode == 0, stop.stderr
    assert "tiny: stopped (ok: stopped by its caller;" in stop.stdout
    end = find_job_end(journal)
    assert end is not None and end["status"] == "ok" and end["steps"] > 0
    assert not keeper_alive(info) and not _left_running(run_dir)
    console = (run_dir / "console.log").read_text()
    assert "tiny: ok — " in console and "Traceback" not in console


@pytest.fixture
def sleeper():
    """A live process of ours that a bad-input command must not signal."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _fake_run(run_dir: Path, keeper_pid: int, ended: bool) -> None:
    run_dir.mkdir(mode=0o700)
    created = psutil.Process(keeper_pid).create_time() if psutil.pid_exists(keeper_pid) else 0.0
    keeper = {"pid": keeper_pid, "uid": os.getuid(), "started": time.time(), "detached": True}
    (run_dir / "keeper.json").write_text(json.dumps({**keeper, "create_time": created}))
    records = [{"t": 1.0, "event": "job.start", "job": "tiny"}]
    if ended:
        end = {"status": "failed", "reason": "r", "steps": 4, "seconds": 1.0}
        records.append({"t": 2.0, "event": "job.end", "job": "tiny", **end})
    (run_dir / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in [run_dir, *run_dir.rglob("*")]
    }


@pytest.mark.parametrize("case", ["missing", "ended", "killed", "another_user"])
def test_attach_stop_status_refuse_bad_input_and_change_nothing(
    tmp_path: Path, sleeper: subprocess.Popen, case: str
) -> None:
    run_dir = tmp_path / "run"
    said = {
        "missing": f"no run '{run_dir}': not a directory",
        "ended": "has ended (failed: r; 4 steps committed)",
        "killed": "is not running: its keeper (pid",
        "another_user": "belongs to user nobody (uid 65534), not to you",
    }[case]
    if case == "another_user":
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        _fake_run(run_dir, sleeper.pid, ended=False)
        for p in [run_dir, *run_dir.iterdir()]:
            os.chown(p, 65534, 65534)
    elif case == "ended":
        _fake_run(run_dir, sleeper.pid, ended=True)
    elif case == "killed":  # a keeper that is gone, and no job.end
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                              capture_output=True).stdout  # fmt: skip
        _fake_run(run_dir, int(gone), ended=False)
    before = _snapshot(run_dir) if run_dir.exists() else {}
    for command in ("attach", "stop", "status"):
        done = ftharness(command, str(run_dir), timeout=30)
        assert done.returncode == 2, (command, done.stderr)
        assert f"ftharness {command}: " in done.stderr and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert (_snapshot(run_dir) if run_dir.exists() else {}) == before
    assert sleeper.poll() is None  # the live "keeper" was not signalled
