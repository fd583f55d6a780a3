"""A controller process for the takeover tests: ``python takeover_driver.py RUN [options]``.

Without ``--takeover`` it starts a run in RUN: the job secret (RUN/secret), a controller with
the control file RUN/controller.json (unless ``--no-survival``), ``--hosts`` local hosts with one
worker each, and on each worker a ``Ticker.run`` call that emits journal events for
``--seconds``. With ``--takeover`` it takes that run over as the next epoch: it reattaches the
agents, finds each worker's running ``run`` call among its open calls and waits for its
result (its workers send again the events the journal lacks: the journal's last event of each
process is the controller's ``event_marks``). Either way it writes RUN/state-EPOCH.json once
the calls run (pids, proc ids, times) and RUN/result-EPOCH.json with the results, then shuts
the run down. ``--poke`` keeps sending every worker a command (``takeover_actors.obey``) every
0.1 s, to count what a replaced controller gets obeyed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # takeover_actors, in the workers too

import takeover_actors

from runtime import channel
from runtime.control_file import read_control, read_secret, write_secret
from runtime.controller import Controller
from runtime.journal import Journal, read_journal
from runtime.spec import ControllerSpec, HeartbeatSpec
from runtime.takeover import event_marks


def spec(args: argparse.Namespace) -> ControllerSpec:
    return ControllerSpec(
        heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=1.0),
        agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=3.0),
        preload=(),
        call_timeout_s=30.0,
        controller_silence_s=args.silence,
        controller_grace_s=args.grace,
    )


def write_json(path: Path, body: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def poke(ctl: Controller, procs: list[str], run: Path, epoch: int) -> None:
    while True:
        for proc_id in procs:
            with contextlib.suppress(Exception):  # refused: not running, or the job stopped
                ctl.run_in_worker(proc_id, takeover_actors.obey, str(run / "obeyed"), epoch)
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    p.add_argument("--takeover", action="store_true")
    p.add_argument("--no-survival", action="store_true")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--grace", type=float, default=20.0)
    p.add_argument("--silence", type=float, default=1.0)
    p.add_argument("--poke", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    run: Path = args.run
    control = None if args.no_survival else run / "controller.json"
    if args.takeover:
        secret = read_secret(str(run / "secret"))
        info = read_control(run / "controller.json")
        assert info is not None
        epoch = info.epoch + 1
    else:
        secret, epoch = channel.new_secret(), 1
        write_secret(run / "secret", secret)
    t0 = time.time()
    marks = event_marks(read_journal(run / "journal.jsonl")) if args.takeover else None
    journal = Journal(run / "journal.jsonl", job="takeover", ctl_epoch=epoch)
    ctl = Controller(
        spec(args), journal=journal, secret=secret, on_failure=lambda f: True,
        control_file=control, epoch=epoch, takeover=args.takeover, event_marks=marks,
    )  # fmt: skip
    names = [f"h{i}" for i in range(args.hosts)]
    if args.takeover:
        reports = ctl.reattach(names, timeout_s=20.0)
        procs = sorted(w.proc_id for r in reports.values() for w in r.workers)
        calls: dict[str, Any] = {}
        for proc_id in procs:
            found = [c for c, ep in ctl.open_calls(proc_id).items() if ep == ("ticker", "run")]
            calls[proc_id] = ctl.open_call(proc_id, found[0]) if found else None
        ctl.adopt(procs)
    else:
        meshes = [ctl.spawn_host(n).spawn_procs({"ranks": 1}) for n in names]
        actors = [m.spawn("ticker", takeover_actors.Ticker) for m in meshes]
        procs = [m.proc_ids[0] for m in meshes]
        calls = {
            proc_id: a.run.call_one(args.seconds, 0.05)
            for proc_id, a in zip(procs, actors, strict=True)
        }
    state = {
        "epoch": epoch,
        "pid": os.getpid(),
        "t_start": t0,
        "t_ready": time.time(),
        "agents": {n: h.pid for n, h in ctl.hosts.items()},
        "workers": {proc_id: ctl.procs[proc_id].pid for proc_id in procs},
        "calls": {proc_id: call is not None for proc_id, call in calls.items()},
    }
    write_json(run / f"state-{epoch}.json", state)
    if args.poke:
        threading.Thread(target=poke, args=(ctl, procs, run, epoch), daemon=True).start()
    values = {}
    for proc_id, call in calls.items():
        try:
            wait = getattr(call, "get", None) or getattr(call, "result", None)
            values[proc_id] = wait(timeout=args.seconds + 60) if wait is not None else None
        except Exception as exc:
            values[proc_id] = {"error": repr(exc)}
    write_json(run / f"result-{epoch}.json", {**state, "values": values, "t_end": time.time()})
    ctl.shutdown(grace_s=0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
