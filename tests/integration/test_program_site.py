"""ftharness's always-on start-up patch in a user's program (harness/rank/program_site), in a
fresh interpreter started as a cold program is: with the environment ``launcher_env`` and the
agent give it, torchft advertises ``$FTHARNESS_ADVERTISE`` wherever it would advertise the
machine's hostname, and the ``sitecustomize`` the patch shadows still runs."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from harness.config import load_config
from harness.job.program.env import HOOKS_DIR, SITE_DIR, launcher_env

ROOT = Path(__file__).resolve().parents[2]
ADDRESS = "127.0.0.2"  # local (all of 127/8 is, on Linux), and not what the hostname resolves to

PROGRAM = """
import inspect, json, sys
from datetime import timedelta
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport
pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
store = json.loads(pg.get_reconfigure_handle())["store"]
http = HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
print(json.dumps({
    "store": store,
    "manager_hostname": inspect.signature(Manager.__init__).parameters["hostname"].default,
    "http": http.address(),
    "user_site": getattr(sys.modules.get("sitecustomize"), "USER_SITE_RAN", False),
}))
http.shutdown()
"""


def test_a_cold_program_advertises_the_host_address_and_its_own_sitecustomize_still_runs(
    tmp_path: Path,
) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("USER_SITE_RAN = True\n")
    cfg = load_config(str(ROOT / "experiments" / "tiny.toml"))
    cfg = dataclasses.replace(
        cfg, program=dataclasses.replace(cfg.program, env={"PYTHONPATH": str(user)})
    )
    env = launcher_env(cfg, replica=0, rank=0, lighthouse="http://x:1", store_addr="x:1")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), str(user)]
    assert str(HOOKS_DIR) not in env["FTHARNESS_SITE"]  # the fault hook stays opt-in
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**os.environ, **env, "FTHARNESS_ADVERTISE": ADDRESS},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["store"].rsplit(":", 1)[0] == ADDRESS
    assert seen["manager_hostname"] == ADDRESS
    assert seen["http"].startswith(f"http://{ADDRESS}:")
    assert seen["user_site"] is True
    # And without the patch torchft names the machine, which here is not ADDRESS.
    assert ADDRESS not in {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
