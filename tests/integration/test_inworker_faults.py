"""In-worker faults for real, in real processes.

A small stand-in worker (WORKER below) does what a harness worker does for faults: a Python
heartbeat thread, and a control thread that runs ``"module:qualname"(*args)`` requests (the
function's ``runtime.actor.wire_name``) on their own threads; its "trainer" just prints what it
was asked. The fault classes fire through a hand-written FaultContext whose ``run_in_worker``
writes the request to that worker's stdin.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from faults.fault import Target, make_fault
from faults.injector import Injector
from faults.schedule import PlannedFault
from runtime.actor import wire_name
from runtime.journal import Journal, read_journal

ROOT = Path(__file__).resolve().parents[2]

# Every line is printed with one write (text and newline together): print's separate write of
# the newline let a heartbeat thread's line and the main thread's line merge into one, and the
# merged "beat 0ready" was never seen as "ready".
HEARTBEAT = r"""
import sys, threading, time

def heartbeat():
    i = 0
    while True:
        print(f"beat {i}\n", end="", flush=True)
        i += 1
        time.sleep(0.05)

threading.Thread(target=heartbeat, daemon=True).start()
"""

_WORKER_BODY = r"""
import json
import faults.inworker as inworker
from runtime.actor import resolve

class Trainer:
    def set_step_delay(self, seconds):
        print(f"delay {seconds}\n", end="", flush=True)
    def abort_collectives(self):
        print("abort\n", end="", flush=True)

inworker.actors_provider = lambda: {"trainer": Trainer()}

print("ready\n", end="", flush=True)
for line in sys.stdin:  # the control thread: each request on its own thread
    req = json.loads(line)
    threading.Thread(target=resolve(req["func"]), args=req["args"], daemon=True).start()
"""
WORKER = HEARTBEAT + _WORKER_BODY


class Proc:
    """A child process whose stdout lines arrive on a queue."""

    def __init__(self, args: list[str], stdin: bool = False) -> None:
        self.p = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.PIPE if stdin else None,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The next line starting with ``prefix`` (other lines are skipped)."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line starting with {prefix!r} within {timeout} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line

    def wait_silent(self, quiet_s: float, within_s: float) -> bool:
        """True once no line arrived for ``quiet_s`` (checked for up to ``within_s``)."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            try:
                self.lines.get(timeout=quiet_s)
            except queue.Empty:
                return True
        return False

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


def python(code: str, *args: str, stdin: bool = False) -> Proc:
    return Proc([sys.executable, "-c", code, *args], stdin=stdin)


# -- the functions alone -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_segfault_kills_its_process_with_sigsegv():
    proc = python("from faults.inworker import segfault; segfault(); print('survived')")
    assert proc.p.wait(timeout=30) == -11  # killed by SIGSEGV, raised by the CPU in-process
    assert proc.lines.empty()  # "survived" never printed


_GIL_BODY = r"""
from faults.inworker import hold_gil

time.sleep(0.3)
hold_gil(float(sys.argv[1]), 0.1)
print("armed\n", end="", flush=True)
while True:  # the main thread stays alive; after the hold it carries on
    time.sleep(0.05)
"""
GIL_SCRIPT = HEARTBEAT + _GIL_BODY


@pytest.mark.timeout(90)
def test_hold_gil_freezes_every_python_thread_but_the_process_lives():
    proc = python(GIL_SCRIPT, "4")
    try:
        proc.expect("beat")
        proc.expect("armed")
        # Within the 4 s hold the heartbeat must go silent for a full second...
        assert proc.wait_silent(quiet_s=1.0, within_s=3.0), "heartbeat kept printing"
        # ...while the process is alive (not exited, not a zombie): frozen, not dead.
        assert proc.p.poll() is None
        assert psutil.Process(proc.p.pid).status() != psutil.STATUS_ZOMBIE
        # When the C call returns, the same process beats again.
        proc.expect("beat", timeout=30)
        assert proc.p.poll() is None
    finally:
        proc.close()


# -- the fault classes through a FaultContext into a real worker --------------------------------


class WorkerContext:
    """A FaultContext over stand-in workers (one per replica, one rank each)."""

    def __init__(self, journal: Journal, replicas: int = 2) -> None:
        self.journal = journal
        self.replicas = replicas
        self.ranks = 1
        self.networked = False
        self.workers = {r: python(WORKER, stdin=True) for r in range(replicas)}
        try:
            for w in self.workers.values():
                w.expect("ready", timeout=90)  # a loaded 2-core machine starts Python slowly
        except BaseException:
            self.close()  # the fixture's teardown does not run when its setup raises
            raise
        self.step = 0

    def hosts(self) -> list[str]:
        return ["host0"]

    def replica_host(self, replica: int) -> str:
        return "host0"

    def pids(self, target: Target) -> list[int]:
        return [self.workers[target.replica].p.pid]

    def run_in_worker(self, target: Target, func: Callable[..., Any], *args: Any) -> None:
        w = self.workers[target.replica]
        assert w.p.stdin is not None
        w.p.stdin.write(json.dumps({"func": wire_name(func), "args": list(args)}) + "\n")
        w.p.stdin.flush()

    def kill_host(self, host: str) -> None:
        raise AssertionError("not used here")

    def set_host_cooldown(self, host: str, seconds: float) -> None:
        raise AssertionError("not used here")

    def kill_quorum_service(self) -> None:
        raise AssertionError("not used here")

    def committed_step(self) -> int:
        return self.step

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


@pytest.fixture
def wctx(tmp_path):
    c = WorkerContext(Journal(tmp_path / "journal.jsonl", job="test"))
    yield c
    c.close()
    c.journal.close()


@pytest.mark.timeout(90)
def test_segfault_fault_crashes_only_the_target_worker(wctx):
    plan = [PlannedFault(fault_id="f000", kind="segfault", target=Target(replica=1, rank=0),
                         at_step=3)]  # fmt: skip
    inj = Injector(plan, wctx, seed=1)
    inj.poll()
    assert wctx.workers[1].p.poll() is None  # step 3 not reached
    wctx.step = 3
    inj.poll()
    assert wctx.workers[1].p.wait(timeout=30) == -11
    assert wctx.workers[0].p.poll() is None
    wctx.workers[0].expect("beat")  # the other worker is unaffected
    events = [(e["event"], e.get("fault_id")) for e in read_journal(wctx.journal.path)]
    # the plan first (a controller that takes over resumes it), then the fault
    assert events == [("fault.plan", None), ("fault.inject", "f000"), ("fault.heal", "f000")]


@pytest.mark.timeout(90)
def test_gil_deadlock_fault_freezes_the_worker_alive(wctx):
    make_fault("gil_deadlock", seconds=5).fire(wctx, Target(replica=0, rank=0), None)
    w = wctx.workers[0]
    assert w.wait_silent(quiet_s=1.0, within_s=4.0), "worker kept heartbeating"
    assert w.p.poll() is None
    assert psutil.Process(w.p.pid).status() != psutil.STATUS_ZOMBIE
    wctx.workers[1].expect("beat")  # a different process is not affected


@pytest.mark.timeout(90)
def test_slow_rank_and_collective_abort_reach_the_trainer(wctx):
    slow = make_fault("slow_rank", delay_s=0.25)
    target = Target(replica=1, rank=0)
    slow.fire(wctx, target, None)
    assert wctx.workers[1].expect("delay") == "delay 0.25"
    slow.heal(wctx, target)
    assert wctx.workers[1].expect("delay") == "delay 0.0"
    make_fault("collective_abort").fire(wctx, target, None)
    wctx.workers[1].expect("abort")
    assert wctx.workers[1].p.poll() is None  # the process lives through an abort
