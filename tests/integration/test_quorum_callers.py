"""Issue #49, finding 2: a stolen member id gets a stranger nothing. The built-in trainer's tagged
replica id is readable from its group's TCPStore by any local user; the tree quorum service now
answers only connections held by the job's own processes (``harness.job.quorum_callers``), so a
process outside the job's tree that calls with that id, step 999999 and its own address is
refused before its request is even read, while the job's own calls with the same id go on.

The stranger is a real process outside this one's tree (``setsid --fork``: its parent exits at
once, so it is nobody's descendant here), running torchft's own LighthouseClient.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from harness.config import JobConfig
from harness.job.quorum_callers import QuorumCallers
from harness.quorum.service import TreeQuorumService

ROOT = Path(__file__).parents[2]

STRANGER = """
import json, sys
from datetime import timedelta
from torchft._torchft import LighthouseClient
addr, rid, out = sys.argv[1:4]
said = {}
try:
    c = LighthouseClient(addr=addr, connect_timeout=timedelta(seconds=5))
    c.heartbeat(rid)
    said["heartbeat"] = "ok"
    q = c.quorum(replica_id=rid, timeout=timedelta(seconds=5), step=999999, address="evil:1")
    said["quorum"] = [m.replica_id for m in q.participants]
except Exception as e:
    said["error"] = str(e)
open(out + ".tmp", "w").write(json.dumps(said))
import os; os.rename(out + ".tmp", out)
"""


class _Events:
    def quorum_ids_reset(self) -> None: ...

    def quorum_restarted(self) -> None: ...

    def ask_for_quorum(self) -> None: ...


@pytest.mark.timeout(60)
def test_a_stolen_member_id_from_outside_the_job_is_refused(tmp_path: Path) -> None:
    service: TreeQuorumService
    callers = QuorumCallers(lambda: [], lambda: service.address)
    service = TreeQuorumService(
        JobConfig(name="callers", replicas=2), _Events(), caller_refusal=callers.refusal
    )
    service.start()
    try:
        stolen = service.admit(0, 0) + ":group0"
        out = tmp_path / "said.json"
        subprocess.run(
            ["setsid", "--fork", sys.executable, "-c", STRANGER, service.address, stolen,
             str(out)],
            cwd=ROOT, check=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not out.exists():
            assert time.monotonic() < deadline, "the stranger never answered"
            time.sleep(0.05)
        said = json.loads(out.read_text())
        assert "heartbeat" not in said and "quorum" not in said, said
        assert "held by no process of this job" in said["error"], said
        assert service.tree.status()["participants"] == []  # nothing of it got in
        # the job's own process (here: this one, the controller) is answered with the same id
        from torchft._torchft import LighthouseClient

        LighthouseClient(addr=service.address, connect_timeout=timedelta(seconds=5)).heartbeat(
            stolen
        )
    finally:
        service.shutdown()
