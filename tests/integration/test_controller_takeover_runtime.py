"""A controller replaced mid-run, with real processes (issue #26): its workers keep running,
what they emit while no controller serves reaches the next one's journal (and what the dead
one never read too: ``runtime.resend``), and an old controller that comes back obeys nothing.

Each controller is a driver process (``takeover_driver.py``) on one run directory: two local
hosts, one worker each, each running a ``Ticker.run`` call that emits a journal event every
50 ms. The tests SIGKILL (or SIGSTOP) the first driver and start a second one with
``--takeover``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from runtime.control_file import read_control
from runtime.journal import read_journal

DRIVER = Path(__file__).with_name("takeover_driver.py")
ROOT = Path(__file__).parents[2]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Run:
    """A run directory and the driver processes started on it (all killed at the end)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.drivers: list[subprocess.Popen] = []

    def start(self, *args: str) -> subprocess.Popen:
        n = len(self.drivers)
        log = open(self.path / f"driver-{n}.log", "wb")  # noqa: SIM115 (closed with the run)
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), str(self.path), *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
        )  # fmt: skip
        self.drivers.append(proc)
        return proc

    def state(self, epoch: int, timeout: float = 30.0) -> dict:
        path = self.path / f"state-{epoch}.json"
        wait_for(path.exists, timeout, f"{path.name} (see {self.logs()})")
        return json.loads(path.read_text())

    def result(self, epoch: int) -> dict:
        return json.loads((self.path / f"result-{epoch}.json").read_text())

    def logs(self) -> str:
        return " | ".join(
            p.read_text(errors="replace")[-1500:] for p in sorted(self.path.glob("driver-*.log"))
        )

    def pids(self) -> list[int]:
        """Every agent and worker any driver reported."""
        out: list[int] = []
        for f in self.path.glob("state-*.json"):
            s = json.loads(f.read_text())
            out += [*s["agents"].values(), *s["workers"].values()]
        return sorted(set(out))

    def close(self) -> None:
        for proc in self.drivers:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path)
    yield r
    r.close()


def assert_every_tick_once(ticks: list[dict], result: dict) -> None:
    """Each worker's ``tick`` events in the journal: every one it emitted, none twice, each
    numbered (``eseq``) in the order it was emitted."""
    for proc_id, value in result["values"].items():
        mine = [r["i"] for r in ticks if r["proc"] == proc_id]
        twice = sorted({i for i in mine if mine.count(i) > 1})
        assert twice == [], (proc_id, "journaled twice", twice)
        missing = sorted(set(range(value["ticks"])) - set(mine))
        assert missing == [], (proc_id, "lost", missing)
        numbers = [r["eseq"] for r in sorted(ticks, key=lambda r: r["i"]) if r["proc"] == proc_id]
        assert numbers == sorted(set(numbers)), (proc_id, "numbered out of order")


@pytest.mark.parametrize("takeovers", [1, 2])
def test_a_sigkilled_controller_is_taken_over_with_nothing_restarted(
    run: Run, takeovers: int
) -> None:
    seconds = str(4.0 + takeovers)
    driver = run.start("--seconds", seconds)
    before = run.state(1)
    assert all(before["calls"].values())
    t_kills, starts = [], []
    for epoch in range(2, 2 + takeovers):
        time.sleep(1.0)
        t_kills.append(time.time())
        driver.kill()
        driver.wait()
        time.sleep(0.7)  # a gap with no controller: the workers' events wait in their buffers
        driver = run.start("--takeover", "--seconds", seconds)
        starts.append(run.state(epoch)["t_start"])
    last = 1 + takeovers
    after = run.state(last)
    assert driver.wait(timeout=60) == 0, run.logs()
    result = run.result(last)

    # the same agents and workers, every running call found and answered
    assert after["workers"] == before["workers"], run.logs()
    assert after["agents"] == before["agents"]
    assert all(after["calls"].values()), after
    for proc_id, value in result["values"].items():
        assert value["pid"] == before["workers"][proc_id], result
        assert value["ticks"] >= 90, result
    info = read_control(run.path / "controller.json")
    assert info is not None and info.epoch == last and info.pid == driver.pid

    records = read_journal(run.path / "journal.jsonl")
    # 0 restarted: no process started after the first controller died
    assert [r for r in records if r["event"] == "proc.start" and r["t"] > t_kills[0]] == []
    ticks = [r for r in records if r["event"] == "tick"]
    # every event reached the journal exactly once, those of the gaps too (kept, then sent),
    # and those in flight as a controller died (sent again past the journal's mark)
    assert_every_tick_once(ticks, result)
    for proc_id in before["workers"]:
        for epoch, (t_kill, t_start) in enumerate(zip(t_kills, starts, strict=True), 2):
            gap = [r for r in ticks if r["proc"] == proc_id and t_kill < r["t"] < t_start]
            assert gap, f"no event of {proc_id} from gap {epoch - 1} reached the journal"
            assert all(r["ctl_epoch"] >= epoch for r in gap)  # written by a later controller
    # the new controller's shutdown stopped what it inherited: nothing is left running
    pids = [*after["agents"].values(), *after["workers"].values()]
    wait_for(lambda: not any(_running(p) for p in pids), 10.0, "the inherited processes to stop")


def test_an_old_controller_resumed_after_a_takeover_obeys_nothing(run: Run) -> None:
    first = run.start("--seconds", "6", "--poke")
    before = run.state(1)
    time.sleep(0.8)
    first.send_signal(signal.SIGSTOP)
    # the agents hear nothing for controller_silence (1 s) and re-dial the new controller
    second = run.start("--takeover", "--seconds", "6", "--poke")
    after = run.state(2)
    assert after["workers"] == before["workers"], run.logs()
    time.sleep(0.5)
    t_cont = time.time()
    first.send_signal(signal.SIGCONT)
    # it finds a newer epoch in the control file and exits before it acts on anything
    assert first.wait(timeout=20) == 75, run.logs()
    assert second.wait(timeout=60) == 0, run.logs()
    result = run.result(2)
    for proc_id, value in result["values"].items():
        assert value["pid"] == before["workers"][proc_id], result
    # what the workers sent the stopped controller in its last second sat unread in its socket
    # buffers (it exits on resuming, before journaling any): sent again to the new one
    records = read_journal(run.path / "journal.jsonl")
    assert_every_tick_once([r for r in records if r["event"] == "tick"], result)

    obeyed = [line.split() for line in (run.path / "obeyed").read_text().splitlines()]
    assert any(e == "1" for e, _, _ in obeyed)  # the old one was obeyed while it served
    assert any(e == "2" for e, _, _ in obeyed)  # the new one is
    late = [line for line in obeyed if line[0] == "1" and float(line[1]) > t_cont]
    assert late == [], f"the old controller got {len(late)} command(s) obeyed after SIGCONT"
    # the journal in the order it was written: nothing of the old controller after the new
    # one's first record (it exits before appending, runtime.journal's fence)
    order = [json.loads(line)["ctl_epoch"] for line in (run.path / "journal.jsonl").open()]
    assert 2 in order
    assert 1 not in order[order.index(2) :], "the old controller appended after the takeover"
    info = read_control(run.path / "controller.json")
    assert info is not None and info.epoch == 2


def test_without_a_control_file_everything_dies_with_the_controller(run: Run) -> None:
    first = run.start("--no-survival", "--seconds", "30")
    state = run.state(1)
    pids = [*state["agents"].values(), *state["workers"].values()]
    assert all(_running(p) for p in pids)
    assert not (run.path / "controller.json").exists()
    first.kill()
    first.wait()
    wait_for(lambda: not any(_running(p) for p in pids), 5.0, "every agent and worker to exit")


def test_past_its_grace_an_orphaned_agent_stops_its_workers_and_exits(run: Run) -> None:
    first = run.start("--seconds", "30", "--grace", "2", "--silence", "1")
    state = run.state(1)
    pids = [*state["agents"].values(), *state["workers"].values()]
    first.kill()
    first.wait()
    t_kill = time.monotonic()
    time.sleep(1.0)
    assert all(_running(p) for p in pids), "agents and workers must outlive the controller"
    wait_for(lambda: not any(_running(p) for p in pids), 6.0, "every agent and worker to exit")
    assert time.monotonic() - t_kill >= 1.9  # not before the grace ran out


def test_an_agent_refuses_a_controller_of_an_epoch_it_has_served(tmp_path: Path) -> None:
    """An orphaned agent dials only a controller whose epoch is above the one it served, and
    drops one that answers with a lower or equal epoch (an old controller at a new address)."""
    from runtime.control_file import write_control
    from runtime.controller import Controller
    from runtime.messages import AgentReport
    from runtime.orphan import Survival
    from runtime.spec import ControllerSpec

    ctl = Controller(ControllerSpec(preload=()))  # epoch 1
    try:
        path = tmp_path / "controller.json"
        write_control(path, ctl.address, 2)  # the file claims 2; the controller says 1
        s = Survival(path, grace_s=5.0)
        s.lose(time.monotonic(), [])
        report = AgentReport((), 1, "127.0.0.1")
        assert s.dial("h0", ctl.secret, 1, report) is None
        assert "h0" not in ctl.hosts
    finally:
        ctl.shutdown(grace_s=0.5)
