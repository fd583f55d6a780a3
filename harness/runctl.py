"""``ftharness attach | stop | status RUN``: follow, stop and inspect a run under its keeper;
and ``ftharness run --detach``'s start of that keeper (:func:`start_detached`).

A run started by ``ftharness run`` (in the foreground or with ``--detach``) is found through its
directory (docs/controller.md): ``keeper.json`` names the keeper (``harness.keeper.keeper``),
``controller.json`` the controller serving now, ``console.log`` a detached run's output, and the
journal what runs where and how far it got. RUN is a run directory or a run's name under
``runs/``.

Bad input changes nothing and exits 2 with the reason: no such run, a run another user owns (its
processes and private files are not ours), a run that has ended (its journal has ``job.end``), a
run whose keeper is gone without one (killed), a directory no keeper ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.rundir import (
    CONSOLE_FILE,
    KEEPER_FILE,
    find_job_end,
    read_job_file,
    read_json,
    this_host,
)
from runtime.journal import Record


def _open_run(command: str, name: str) -> tuple[Path, dict[str, Any]] | int:
    """The run directory ``name`` and its keeper.json, if the run is ours and running; else the
    reason on stderr and status 2 (bad input: nothing was changed)."""
    from harness.rundir import RunDirError, find_run, read_json

    try:
        run_dir = find_run(name)
        info = read_json(run_dir / KEEPER_FILE)
        end = find_job_end(run_dir / "journal.jsonl")
    except (RunDirError, ValueError, OSError) as exc:
        return _refuse(command, str(exc))
    if end is not None:
        return _refuse(
            command,
            f"run {run_dir} has ended ({_outcome(end)}): nothing runs there any more; its "
            f"report: ftharness report {run_dir}",
        )
    if info is None:
        return _refuse(
            command,
            f"{run_dir} has no {KEEPER_FILE}: not a run that `ftharness run` started (a chaos "
            "experiment runs in its own terminal), or it has not started yet",
        )
    if info.get("host") not in (None, this_host()):  # a standby on another node took over
        return _refuse(
            command,
            f"run {run_dir}: its keeper runs on {info['host']} (pid {info.get('pid')}) since its "
            f"first node was lost: run `ftharness {command}` there, or use SLURM (scancel)",
        )
    if not keeper_alive(info):
        return _refuse(
            command,
            f"run {run_dir} is not running: its keeper (pid {info.get('pid')}) is gone and the "
            "journal has no job.end (the run was killed)",
        )
    return run_dir, info


def _refuse(command: str, why: str) -> int:
    print(f"ftharness {command}: {why}", file=sys.stderr)
    return 2


def _outcome(end: Record) -> str:
    return f"{end.get('status')}: {end.get('reason')}; {end.get('steps')} steps committed"


class _Follower:
    """New output of a running run: its console.log when detached (what a terminal would show),
    else its journal, shown as the progress display shows it (harness.job.progress)."""

    def __init__(self, run_dir: Path, info: dict[str, Any]) -> None:
        self.console = run_dir / CONSOLE_FILE if info.get("detached") else None
        self.path = self.console or run_dir / "journal.jsonl"
        self.offset = 0
        self.progress: Any = None
        self.recoveries = _Recoveries()
        with contextlib.suppress(OSError):
            size = self.path.stat().st_size
            # console: the last screenfuls; journal: only what comes next (the past is a report)
            self.offset = max(0, size - (1 << 16)) if self.console else size
        if self.console is None:
            from harness.job.progress import Progress

            cfg, _ = read_job_file(run_dir)
            self.progress = Progress(cfg, self.recoveries)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        if self.console is None:
            data = data[: data.rfind(b"\n") + 1]  # whole records only
        self.offset += len(data)
        if self.console is not None:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            return
        for line in data.splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(line)
                if isinstance(record, dict):
                    self.recoveries.on_record(record)
                    self.progress.on_record(record)


class _Recoveries:
    """What the progress line counts of recoveries (harness.job.progress), from the journal."""

    def __init__(self) -> None:
        self.open: set[Any] = set()
        self.completed = 0

    @property
    def open_count(self) -> int:
        return len(self.open)

    def on_record(self, r: Record) -> None:
        if r.get("event") == "recovery.phase":
            if r.get("phase") == "participating":
                self.open.discard(r.get("recovery_id"))
                self.completed += 1
            else:
                self.open.add(r.get("recovery_id"))


def attach(args: argparse.Namespace) -> int:
    """``ftharness attach RUN``: follow a running run until it ends; status 0 if it ended ok,
    1 if not. Ctrl-C stops following, not the run."""
    opened = _open_run("attach", args.run)
    if isinstance(opened, int):
        return opened
    run_dir, info = opened
    follower = _Follower(run_dir, info)
    journal = run_dir / "journal.jsonl"
    end: Record | None = None
    try:
        while end is None and keeper_alive(info):
            follower.poll()
            end = find_job_end(journal)
            time.sleep(0.2)
        deadline = time.monotonic() + 30.0  # the outcome line comes after job.end
        while follower.console is not None and keeper_alive(info) and time.monotonic() < deadline:
            follower.poll()
            time.sleep(0.1)
        follower.poll()
    except KeyboardInterrupt:
        print(
            f"\nftharness attach: stopped following; the run goes on (ftharness stop {run_dir} "
            "stops it)",
            file=sys.stderr,
        )
        return 0
    end = end or find_job_end(journal)
    if end is None:
        print(
            f"ftharness attach: the keeper of {run_dir} ended, and the journal has no job.end "
            "(the run was killed)",
            file=sys.stderr,
        )
        return 1
    if follower.console is None:
        print(f"\n{end.get('job')}: {_outcome(end)}; journal {journal}")
    return 0 if end.get("status") == "ok" else 1


def stop(args: argparse.Namespace) -> int:
    """``ftharness stop RUN``: SIGTERM to the run's keeper, which has its controller stop the job
    cleanly (the journal ends with job.end); waits up to ``--timeout`` for it. Status 0 once the
    run has ended, 1 if it has not in time."""
    opened = _open_run("stop", args.run)
    if isinstance(opened, int):
        return opened
    run_dir, info = opened
    pid = info["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return _refuse("stop", f"run {run_dir}: its keeper (pid {pid}) is gone")
    print(
        f"ftharness stop: stopping run {run_dir} (SIGTERM to its keeper, pid {pid}); waiting up "
        f"to {args.timeout:g} s",
        file=sys.stderr,
        flush=True,
    )
    journal = run_dir / "journal.jsonl"
    deadline = time.monotonic() + args.timeout
    end = None
    while time.monotonic() < deadline:
        end = find_job_end(journal)
        if end is not None and not keeper_alive(info):
            break
        time.sleep(0.2)
    if end is None:
        print(
            f"ftharness stop: run {run_dir} has not ended after {args.timeout:g} s: it may still "
            f"be stopping (ftharness status {run_dir})",
            file=sys.stderr,
        )
        return 1
    print(f"{end.get('job')}: stopped ({_outcome(end)}); journal {journal}")
    return 0


def status(args: argparse.Namespace) -> int:
    """``ftharness status RUN``: a running run's keeper, controller, hosts and groups (what runs
    where, from the journal) and its last committed step."""
    opened = _open_run("status", args.run)
    if isinstance(opened, int):
        return opened
    run_dir, info = opened
    from harness.rundir import CONTROLLER_FILE
    from runtime.control_file import ControlFileError, read_control
    from runtime.journal import read_journal

    now = time.time()
    detached = f", detached (output in {run_dir / CONSOLE_FILE})" if info.get("detached") else ""
    lines = [f"run {run_dir}: running for {now - float(info.get('started', now)):.0f} s{detached}"]
    lines.append(f"  keeper      pid {info['pid']}")
    try:
        control = read_control(run_dir / CONTROLLER_FILE)
    except ControlFileError as exc:
        lines.append(f"  controller  unknown: {exc}")
    else:
        if control is None:
            lines.append("  controller  not serving yet")
        else:
            host, port = control.address
            lines.append(
                f"  controller  pid {control.pid}, epoch {control.epoch}, at {host}:{port}"
            )
    journal = run_dir / "journal.jsonl"
    records = read_journal(journal) if journal.exists() else []
    lines += _where(records)
    commits = [r for r in records if r["event"] == "step.commit"]
    if commits:
        last = commits[-1]
        step = max(r["step"] for r in commits)
        lines.append(f"  committed   step {step} ({now - last['t']:.1f} s ago)")
    else:
        lines.append("  committed   no step yet")
    takeovers = sum(r["event"] == "controller.takeover" for r in records)
    lines.append(f"  takeovers   {takeovers}")
    print("\n".join(lines))
    return 0


def _where(records: list[Record]) -> list[str]:
    """Which processes run where, from their ``proc.start`` records less those that failed."""
    ranks: dict[tuple[int, int], Record] = {}
    spares: dict[Any, Record] = {}
    for r in records:
        event = r["event"]
        if event == "job.restart":
            ranks.clear()
        elif event == "proc.start" and r.get("replica") is not None:
            ranks[(r["replica"], r.get("rank", 0))] = r
            spares.pop(r.get("pid"), None)
        elif event == "proc.start":
            spares[r.get("pid")] = r
        elif event == "failure" and r.get("pid") is not None:
            spares.pop(r["pid"], None)
            key = (r.get("replica"), r.get("rank", 0))
            if key in ranks and ranks[key].get("pid") == r["pid"]:
                del ranks[key]
    hosts = sorted({str(r.get("host")) for r in [*ranks.values(), *spares.values()]})
    lines = [f"  hosts       {', '.join(hosts) or 'none yet'}"]
    by_replica: dict[int, list[Record]] = {}
    for (replica, _), r in sorted(ranks.items()):
        by_replica.setdefault(replica, []).append(r)
    for replica, procs in by_replica.items():
        where = ", ".join(f"rank {r.get('rank', 0)} pid {r.get('pid')}" for r in procs)
        lines.append(f"  group {replica:<5} on {procs[0].get('host')}: {where}")
    for r in spares.values():
        lines.append(f"  spare       on {r.get('host')}: pid {r.get('pid')}")
    return lines


def keeper_alive(info: dict[str, Any] | None) -> bool:
    """Whether the keeper ``keeper.json`` describes is still running (the same process: its pid
    with the start time it recorded, so a recycled pid does not count)."""
    import psutil

    if not info or not isinstance(info.get("pid"), int):
        return False
    try:
        proc = psutil.Process(info["pid"])
        alive = proc.status() != psutil.STATUS_ZOMBIE
        return alive and abs(proc.create_time() - float(info.get("create_time", 0))) < 0.5
    except (psutil.Error, TypeError, ValueError):
        return False


def start_detached(run_dir: Path, *, wait_s: float = 30.0) -> int | None:
    """Start the keeper of ``run_dir`` in a session of its own (no terminal: it outlives this
    one), its output in ``RUN/console.log``; return its pid once it has written keeper.json, or
    None (said on stderr) if it died first."""
    console = os.open(run_dir / CONSOLE_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.keeper.keeper", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=console,
            start_new_session=True,
        )
    finally:
        os.close(console)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ValueError):
            info = read_json(run_dir / KEEPER_FILE)
            if info is not None and info.get("pid") == proc.pid:
                proc.returncode = 0  # it lives on after us; nothing here waits for it
                return proc.pid
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    print(
        f"ftharness run: the keeper did not start (see {run_dir / CONSOLE_FILE})", file=sys.stderr
    )
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return None
