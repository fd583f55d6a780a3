"""The keeper (harness.keeper.keeper) as a real process, over a stand-in controller
(keeper_stand_in.py): a controller that dies is replaced with ``--takeover``, the run ends with
the controller's status, past the restart intensity it ends 1 with nothing left running, SIGTERM
is passed on and SIGINT is not the keeper's to act on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.runctl import keeper_alive
from harness.rundir import find_job_end, read_json

pytestmark = pytest.mark.timeout(60)

STAND_IN = Path(__file__).with_name("keeper_stand_in.py")

# The keeper in a process of its own: it becomes a child subreaper and reaps every child, which
# pytest's process must not.
KEEPER = """
import sys
from pathlib import Path
from harness.keeper import keeper as k
run_dir, max_restarts, stand_in = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
k.STANDBY_DELAY_S = 0.2
keeper = k.Keeper(run_dir, max_restarts=max_restarts, within_s=600.0,
                  controller=[sys.executable, stand_in], standby=sys.argv[4] == "standby")
sys.exit(keeper.run())
"""


def _keeper(
    run_dir: Path, mode: str, max_restarts: int = 3, standby: bool = False
) -> subprocess.Popen[str]:
    run_dir.mkdir(mode=0o700)
    (run_dir / "stand_in.json").write_text(json.dumps({"mode": mode}))
    kind = "standby" if standby else "-"
    return subprocess.Popen(
        [sys.executable, "-c", KEEPER, str(run_dir), str(max_restarts), str(STAND_IN), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _starts(run_dir: Path) -> list[list[str]]:
    return [line.split() for line in (run_dir / "starts").read_text().splitlines()]


def _wait_for(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_killed_controller_is_replaced_by_a_takeover_and_the_run_ends_with_its_status(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    keeper = _keeper(run_dir, "die_once")
    out, err = keeper.communicate(timeout=40)
    assert keeper.returncode == 0, err
    starts = _starts(run_dir)
    assert [s[0] for s in starts] == ["first", "takeover"]
    assert {s[2] for s in starts} == {str(keeper.pid)}  # each was told its keeper's pid
    (line,) = [ln for ln in err.splitlines() if "take over" in ln]  # said once, in one line
    assert f"pid {starts[0][1]}" in line and "SIGKILL" in line and "1 of at most 3" in line
    assert "stand-in: the run ended" in out  # the controller's output is the keeper's
    end = find_job_end(run_dir / "journal.jsonl")
    assert end is not None and end["reason"] == "took over"
    info = read_json(run_dir / "keeper.json")
    assert info is not None and info["pid"] == keeper.pid and not info["detached"]
    assert not keeper_alive(info)  # gone now: its pid with its start time


def test_a_standby_takes_over_when_the_controller_dies_and_none_is_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keeper = _keeper(run_dir, "die_after_standby", standby=True)
    _, err = keeper.communicate(timeout=40)
    assert keeper.returncode == 0, err
    starts = _starts(run_dir)
    kinds = [s[0] for s in starts]
    assert kinds[:3] == ["first", "standby", "promoted"], starts
    assert starts[1][1] == starts[2][1]  # the standby itself took over, no new process
    assert "takeover" not in kinds  # no controller was started cold
    end = find_job_end(run_dir / "journal.jsonl")
    assert end is not None and end["reason"] == "took over from standby"
    assert "left behind" not in err  # a standby started after the promotion ended with the run
    assert not [int(s[1]) for s in starts if psutil.pid_exists(int(s[1]))]


def test_past_the_restart_intensity_the_run_ends_1_and_nothing_is_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keeper = _keeper(run_dir, "die_always", max_restarts=2)
    _, err = keeper.communicate(timeout=40)
    assert keeper.returncode == 1, err
    assert [s[0] for s in _starts(run_dir)] == ["first", "takeover", "takeover"]
    assert "recovery.controller_max_restarts = 2" in err and "the run ends here" in err
    # and the journal says so: a run that ended, with why, never one that vanished (#49)
    end = find_job_end(run_dir / "journal.jsonl")
    assert end is not None and end["status"] == "failed", end
    assert "recovery.controller_max_restarts = 2" in end["reason"], end
    # the dead controllers' children were the keeper's (subreaper), stopped when the run ended
    orphans = [int(p) for p in (run_dir / "orphans").read_text().split()]
    assert len(orphans) == 3
    assert not [p for p in orphans if psutil.pid_exists(p)]


def test_a_controller_that_ends_by_itself_without_job_end_is_not_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keeper = _keeper(run_dir, "exit2")
    _, err = keeper.communicate(timeout=40)
    assert keeper.returncode == 2, err
    assert [s[0] for s in _starts(run_dir)] == ["first"]


def test_sigterm_is_passed_on_and_sigint_is_left_to_the_controller(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keeper = _keeper(run_dir, "wait_term")
    _wait_for(run_dir / "ready")
    keeper.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole group; not the keeper's
    time.sleep(0.3)
    assert keeper.poll() is None
    keeper.send_signal(signal.SIGTERM)  # ftharness stop
    _, err = keeper.communicate(timeout=30)
    assert keeper.returncode == 0, err
    end = find_job_end(run_dir / "journal.jsonl")
    assert end is not None and end["reason"] == "SIGTERM"
    assert [s[0] for s in _starts(run_dir)] == ["first"]
