"""A survivor blocked on another survivor of a dead group is unblocked from outside.

Three real processes share one torchft gloo process group, and know nothing of ftharness (as a
user's program). Rank 1 waits to receive from rank 0, rank 0 from rank 2, and rank 2 is
SIGKILLed: rank 0 fails at once, rank 1 would wait out its 60 s timeout (the shape of gloo's
ring allreduce when a group dies mid-step; tests/integration/test_communicator_close.py shows
the wait). Here this process, their parent, does what the host agent does when it reaps the
dead rank (``runtime.sockets``): list the survivors' sockets, shut down those of the failed
communicator. Rank 1 must fail at once, and both survivors must still be able to build a new
communicator through the rendezvous store rank 0 hosts (which must have been left alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore
from trainer_procs import read_line

from runtime import sockets

PROGRAM = """
import sys, time
from datetime import timedelta
import torch
from torchft import ProcessGroupGloo
from torchft.process_group import reconfigure_with_store

rank, addr = int(sys.argv[1]), sys.argv[2]
pg = ProcessGroupGloo(timeout=timedelta(seconds=60))  # torchft's default
reconfigure_with_store(pg, addr + "/1", rank, 3)
buf = torch.zeros(16)
print("posted", flush=True)
if rank == 2:
    time.sleep(600)
t0 = time.monotonic()
try:
    pg.recv([buf], 2 if rank == 0 else 0, 0).wait()
    print("received", flush=True)
except RuntimeError as exc:
    print(f"failed after {time.monotonic() - t0:.2f} s:", str(exc).splitlines()[0], flush=True)
sys.stdin.readline()  # rebuild without the dead rank, as the next quorum would
reconfigure_with_store(pg, addr + "/2", rank, 2)
t = torch.ones(4) * (rank + 1)
pg.allreduce([t], torch.distributed.AllreduceOptions()).wait()
print("rebuilt:", t.tolist(), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sockets.pidfd_getfd_supported(), reason="needs pidfd_getfd (Linux)")
def test_a_blocked_survivor_fails_at_once_and_the_survivors_rebuild() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/unblock_test"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, str(r), addr],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # no ftharness
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + 90
        for p in procs:
            assert read_line(p, deadline) == "posted"
        time.sleep(0.3)  # let both receives reach gloo
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        # what the agent does when it reaps rank 2 (each rank is a group of its own here)
        groups = {procs[0].pid: 0, procs[1].pid: 1}
        fds = sockets.socket_fds(groups)
        done = sockets.unblock_survivors(fds, groups, dead=2)
        assert sum(done.values()) >= 1, done

        first = read_line(procs[0], time.monotonic() + 30)
        second = read_line(procs[1], time.monotonic() + 30)
        for line in (first, second):
            assert line.startswith("failed after"), line
            assert "Timed out" not in line, line
        assert float(second.split()[2]) < 5.0, second  # not the 60 s timeout

        for p in procs[:2]:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs[:2]:
            assert read_line(p, time.monotonic() + 60) == "rebuilt: [3.0, 3.0, 3.0, 3.0]"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        del store
