"""A tree quorum service (``TreeQuorumService`` with a state file) in a process of its own, so a
test can SIGKILL it as a controller dies, and resume it from its file in another process.

``python tree_quorum_proc.py CFG_JSON STATE_PATH ISSUED_LOG [--resume] [--admit N]``: serves
(a fresh service admitting incarnation 0 of groups 0..N-1, or one resumed from STATE_PATH),
prints one JSON line ``{"address", "member_ids", "pid"}`` once it serves, and serves until it
is killed. Every quorum it issues is appended to ISSUED_LOG as it is issued (``ID MEMBER,...``
per line, flushed: a SIGKILL loses none). A resume refused prints ``{"error": ...}`` and exits 3.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer_procs import REPO, read_line


class _Events:
    def quorum_ids_reset(self) -> None: ...

    def quorum_restarted(self) -> None: ...

    def ask_for_quorum(self) -> None: ...


class _Issued(logging.Handler):
    """Appends each quorum ``harness.quorum.tree`` logs as issued to a file."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.INFO)
        self._out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "tree quorum %d: %s":
            qid, members = record.args  # type: ignore[misc]
            self._out.write(f"{qid} {','.join(members)}\n")


def main(argv: list[str]) -> None:
    from harness.config import config_from_dict
    from harness.quorum.durable import QuorumStateError
    from harness.quorum.service import TreeQuorumService

    cfg_json, state_path, issued_log, *rest = argv
    cfg = config_from_dict(json.loads(cfg_json))
    tree_log = logging.getLogger("harness.quorum.tree")
    tree_log.setLevel(logging.INFO)
    tree_log.addHandler(_Issued(issued_log))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if "--resume" in rest:
        try:
            service = TreeQuorumService.resume(cfg, _Events(), Path(state_path))
        except (QuorumStateError, OSError) as e:
            print(json.dumps({"error": str(e)}), flush=True)
            sys.exit(3)
        members = {}
    else:
        service = TreeQuorumService(cfg, _Events(), Path(state_path))
        service.start()
        n = int(rest[rest.index("--admit") + 1]) if "--admit" in rest else 0
        members = {r: service.admit(r, 0) for r in range(n)}
    print(json.dumps({"address": service.address, "member_ids": members, "pid": os.getpid()}))
    sys.stdout.flush()
    threading.Event().wait()


def start_service(
    cfg: dict[str, Any],
    state_path: Path,
    issued_log: Path,
    *,
    resume: bool = False,
    admit: int = 0,
    timeout_s: float = 60.0,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """This module's service in a new process (its own session); returns it and the line it
    printed once serving (``member_ids`` keyed by str(replica)). Its stderr goes to
    ``issued_log`` with ``.log``."""
    args = [json.dumps(cfg), str(state_path), str(issued_log)]
    args += ["--resume"] if resume else ["--admit", str(admit)]
    log = open(issued_log.with_suffix(".log"), "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__)), *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{Path(__file__).parent}"},
        start_new_session=True,
    )
    return proc, json.loads(read_line(proc, time.monotonic() + timeout_s))


def issued(issued_log: Path) -> list[tuple[int, list[str]]]:
    """The quorums a service process issued, in order: (id, member ids)."""
    if not issued_log.exists():
        return []
    out = []
    for line in issued_log.read_text().splitlines():
        qid, _, members = line.partition(" ")
        out.append((int(qid), members.split(",") if members else []))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
