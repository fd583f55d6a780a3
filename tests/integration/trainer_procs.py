"""Helpers for the trainer integration tests: start trainer processes, read their journals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from runtime.journal import read_journal

REPO = Path(__file__).resolve().parents[2]


def lone_trainer(
    cfg: Any, lighthouse_addr: str, emit: Any, run_dir: Path | None = None, **kwargs: Any
) -> Any:
    """A Trainer in this process: replica group 0, rank 0, no group store (one rank),
    journaling through ``emit(event, fields)``; checkpoints under ``run_dir`` if given;
    ``kwargs``: the Trainer's other keywords."""
    from harness.rank.trainer import Trainer

    return Trainer(
        cfg,
        replica_id=0,
        rank=0,
        store_addr=None,
        lighthouse_addr=lighthouse_addr,
        run_dir=None if run_dir is None else str(run_dir),
        emit=emit,
        **kwargs,
    )


def start_trainer(
    cfg: dict[str, Any],
    *,
    replica_id: int,
    rank: int,
    store_addr: str | None,
    lighthouse_addr: str,
    journal_path: Path,
    member_id: str | None = None,
) -> subprocess.Popen[bytes]:
    """``run_trainer`` in a fresh ``python -c`` process (its own session, so a SIGKILL of it is
    a real death of the whole trainer). Output goes to ``journal_path`` with ``.log``.
    ``member_id``: the name a tree quorum admitted for it (``TreeQuorum.admit``; it lets in no
    other), passed to its Trainer as the job would."""
    code = (
        "import functools, json, os, sys\n"
        "from harness.rank import trainer\n"
        "a = json.loads(sys.argv[1])\n"
        "member_id = a.pop('member_id')\n"
        "if member_id:\n"
        "    trainer.Trainer = functools.partial(trainer.Trainer, member_id=member_id)\n"
        "print(json.dumps(trainer.run_trainer(**a)), flush=True)\n"
        # The journal is closed and the summary printed: skip interpreter teardown, where
        # gloo's destructors can abort (SIGABRT) once the peer groups have already exited.
        "os._exit(0)\n"
    )
    args = {
        "cfg_dict": cfg,
        "replica_id": replica_id,
        "rank": rank,
        "store_addr": store_addr,
        "lighthouse_addr": lighthouse_addr,
        "journal_path": str(journal_path),
        "member_id": member_id,
    }
    log = open(journal_path.with_suffix(".log"), "ab")  # noqa: SIM115 - owned by the child
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )


def commits(path: Path) -> list[dict[str, Any]]:
    """The ``step.commit`` records of one journal file, in file order (empty if none yet)."""
    if not path.exists():
        return []
    return [r for r in read_journal(path) if r["event"] == "step.commit"]


def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next line ``proc`` prints (stripped), waiting until ``deadline`` (monotonic); fails
    the test if the process exits or prints nothing before it."""
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return line.strip()
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before printing")
    raise AssertionError("process printed nothing before the deadline")
