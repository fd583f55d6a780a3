"""A survivor that leaves a failed collective must not leave a peer blocked on it.

Three real processes share one torchft gloo process group. Rank 1 waits to receive from rank 0;
rank 0 waits to receive from rank 2; rank 2 is SIGKILLed. Rank 0 fails at once (its peer died).
Rank 1's peer, rank 0, is alive: rank 1 stays blocked until the process-group timeout unless
rank 0 closes its communicator. This is the shape of gloo's ring allreduce when a group dies
mid-step, and it made survivors stall for the whole timeout (5 s) in about one kill in five.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from trainer_procs import read_line

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import sys, time
from datetime import timedelta
import torch
from torchft import ProcessGroupGloo
from torchft.process_group import reconfigure_with_store
from harness.rank.torchft_glue import close_communicator

rank, addr, close, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout))
reconfigure_with_store(pg, addr, rank, 3)
buf = torch.zeros(16)
recorded = []  # as torchft's Manager keeps the failure (report_error) for should_commit

def receive(src):  # as in torchft's Manager, the frame that raises holds the work object
    work = pg.recv([buf], src, 0)
    print("posted", flush=True)
    work.wait()

if rank == 2:
    print("posted", flush=True)
    time.sleep(600)
try:
    receive(2 if rank == 0 else 0)
    print("received", flush=True)
except RuntimeError as exc:
    print("failed:", str(exc).splitlines()[0], flush=True)
    recorded.append(exc)
    if close and rank == 0:
        close_communicator(pg, exc)
        print("closed", flush=True)
time.sleep(600)  # a survivor: it lives on
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "left_open"])
def test_blocked_peer_fails_at_once_when_the_survivor_closes(close: bool) -> None:
    # Closed: a generous timeout, so only the close can fail rank 1's receive. Left open: a
    # short one, since rank 1 must wait it out (the control: the test sees the stall).
    pg_timeout = 60.0 if close else 2.0
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/close_test"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), addr, "1" if close else "0", str(pg_timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=env,
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + 120
        for p in procs:
            assert read_line(p, deadline) == "posted"
        time.sleep(0.2)  # let both receives reach gloo
        procs[2].send_signal(signal.SIGKILL)

        deadline = time.monotonic() + 30
        assert read_line(procs[0], deadline).startswith("failed:")
        if close:
            assert read_line(procs[0], deadline) == "closed"
        second = read_line(procs[1], time.monotonic() + pg_timeout + 30)
        assert second.startswith("failed:"), second
        if close:
            assert "Timed out" not in second, second
            assert "closed" in second or "reset" in second or "error" in second.lower(), second
        else:
            assert "Timed out" in second, second
        assert procs[0].poll() is None, "rank 0 is a survivor: it must still be running"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        del store
