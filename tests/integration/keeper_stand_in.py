"""A stand-in controller for the keeper's tests: ``python keeper_stand_in.py RUN [--takeover]``.

It does what a controller does that the keeper can see, and nothing else: it ends the run with a
``job.end`` record (or dies without one), so that the keeper is tested without a job, an agent or
the takeover (``harness.job.takeover``). What it does is read from ``RUN/stand_in.json``:

* ``"die_once"``: the first controller SIGKILLs itself; a ``--takeover`` one ends the run ok.
* ``"die_always"``: every controller SIGKILLs itself, after starting a child that it orphans
  (its pid appended to ``RUN/orphans``) and that would sleep for a minute.
* ``"exit2"``: exits 2 without a ``job.end`` (a job file it cannot read).
* ``"wait_term"``: waits for SIGTERM, then ends the run ok with the reason ``SIGTERM``.
* ``"die_after_standby"``: the first controller SIGKILLs itself once a standby has started
  (``--standby``: it appends ``standby PID KEEPER``, then waits for the keeper's word on stdin
  and, told ``takeover``, appends ``promoted PID KEEPER`` and ends the run ok).

Each start appends ``first PID KEEPER`` or ``takeover PID KEEPER`` to ``RUN/starts`` (KEEPER: the
``FTHARNESS_KEEPER_PID`` it was given).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def end_run(run_dir: Path, reason: str) -> None:
    record = {"t": time.time(), "event": "job.end", "job": "stand-in", "status": "ok"}
    record.update(reason=reason, steps=0, seconds=0.0)
    with open(run_dir / "journal.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")


def main() -> int:
    run_dir = Path(sys.argv[1])
    takeover = "--takeover" in sys.argv[2:]
    mode = json.loads((run_dir / "stand_in.json").read_text())["mode"]
    keeper = os.environ.get("FTHARNESS_KEEPER_PID", "-")
    if "--standby" in sys.argv[2:]:
        with open(run_dir / "starts", "a") as fh:
            fh.write(f"standby {os.getpid()} {keeper}\n")
        if sys.stdin.readline().strip() != "takeover":
            return 0  # the run ended without us
        with open(run_dir / "starts", "a") as fh:
            fh.write(f"promoted {os.getpid()} {keeper}\n")
        end_run(run_dir, "took over from standby")
        return 0
    with open(run_dir / "starts", "a") as fh:
        fh.write(f"{'takeover' if takeover else 'first'} {os.getpid()} {keeper}\n")
    if mode == "exit2":
        return 2
    if mode == "die_after_standby" and not takeover:
        while "standby" not in (run_dir / "starts").read_text():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "die_always" or (mode == "die_once" and not takeover):
        if mode == "die_always":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open(run_dir / "orphans", "a") as fh:
                fh.write(f"{child.pid}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "wait_term":
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        (run_dir / "ready").write_text("")
        stop.wait(60)
        end_run(run_dir, "SIGTERM" if stop.is_set() else "no SIGTERM came")
        return 0
    end_run(run_dir, "took over" if takeover else "trained")
    print("stand-in: the run ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
