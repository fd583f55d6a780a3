"""A standby keeper on another node: a SLURM run whose controller's node is lost goes on.

The keeper (``harness.keeper.keeper``) replaces a controller that dies, but it runs on the same
node: under SLURM, the allocation's first node, where the batch script runs. When that node
is lost (power, kernel, hardware), the keeper goes with it. With ``--no-kill`` SLURM keeps the
job and its steps on the other nodes running (measured on the test cluster: the batch host
killed, the job stayed ``RUNNING`` on the rest, a step there ran on); so the run can too, if
something on another node takes the keeper's place. That is this module:

* **Beats.** The keeper of a run that can move (:func:`for_job`: ``launcher = "slurm"``, a job a
  new controller can take over, another node in the allocation) serves beats on a TCP port
  (``harness.keeper.beats.Remote``), named in ``keeper.json`` (``"beat": "HOST:PORT"``): a byte
  every ``BEAT_INTERVAL_S`` to each standby connected, and ``E`` when the keeper ends on purpose
  (the run ended, or it gave up on a controller that kept dying).
* **The standby** is a job step on another node (the allocation's last node other than the
  keeper's), started by the keeper: ``srun -w NODE --overlap ... python -m
  harness.keeper.standby_node RUN``, its output in ``RUN/logs/standby-NODE.out``. It dials the
  beats and reads them. When they stop (the connection ends without ``E``, or is silent for
  ``timeouts.controller_silence``) and the journal has no ``job.end``, it makes sure the
  controller is gone too: its address (``controller.json``) refuses a connection, or answers
  none within a second. A controller that still answers (the keeper alone was killed: the
  controller then stops the run itself) is given ``controller_silence`` more to end the run.
* **Takeover.** Then the standby becomes the run's keeper here: it writes ``keeper.json``
  naming itself (node, pid, beat port) and runs :class:`~harness.keeper.keeper.Keeper` with a
  takeover as its first controller (``controller_proc RUN --takeover``: a new epoch; the
  agents re-dial it through ``controller.json``; each host agent's quorum relay follows it,
  ``runtime.relay``). Its keeper starts a standby of its own on another node in turn.
* **An old keeper that comes back** (its node was cut off, not lost) finds ``keeper.json``
  naming another: it replaces no controller (its own is fenced by the new epoch and exits) and
  waits for the run's end instead of exiting, because a batch script that exits ends the job.
* **The end.** A run that ends under a standby's keeper leaves the batch step on the lost node
  behind, and SLURM would hold the allocation until its time limit: the standby writes the
  run's report (for a run of a chaos experiment, whose ``ftharness chaos`` process died with
  the node, it finishes the experiment: ``ftharness chaos --resume``) and cancels the job
  (``scancel``) last.

Not covered: the shared file system itself failing; a lost node coming back while the job
runs (SLURM may then end the job whose batch step it no longer finds there).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.keeper.beats import END, job_env
from harness.rundir import (
    JOB_FILE,
    KEEPER_FILE,
    LEFT_BEHIND_FILE,
    find_job_end,
    read_json,
    this_host,
    write_json_atomic,
)

if TYPE_CHECKING:
    from harness.keeper.keeper import Keeper

#: How long the standby waits for a probe of the controller's address to answer.
PROBE_S = 1.0


# -- the standby ---------------------------------------------------------------------------------


def _controller_answers(run_dir: Path) -> bool:
    from runtime.control_file import ControlFileError, read_control

    try:
        info = read_control(run_dir / "controller.json")
    except ControlFileError:
        return False
    if info is None:
        return False
    try:
        with socket.create_connection(info.address, timeout=PROBE_S):
            return True
    except OSError:
        return False


def watch(run_dir: Path, beat: tuple[str, int], key: bytes, silence_s: float, say: Any) -> str:
    """Follow the keeper's beats (proving ``key``, the keeper's beat key, first): ``"ended"``
    (the keeper ended on purpose, or the run did) or ``"lost"`` (keeper and controller gone:
    take over)."""
    from runtime.channel import ChannelError, client_handshake

    journal = run_dir / "journal.jsonl"
    conn: socket.socket | None = None
    try:
        conn = socket.create_connection(beat, timeout=silence_s)
        client_handshake(conn, key, silence_s)
    except (OSError, ChannelError) as exc:
        if conn is not None:
            conn.close()
            conn = None
        if find_job_end(journal) is not None:
            return "ended"
        say(f"cannot reach the keeper's beats at {beat[0]}:{beat[1]} ({exc})")
    while conn is not None:
        conn.settimeout(silence_s)
        try:
            data = conn.recv(4096)
        except OSError:  # silent for silence_s (the node is cut off, or powered off)
            data = b""
            say(f"no beat from the keeper for {silence_s:g} s")
        if END in data:
            conn.close()
            return "ended"
        if not data:
            conn.close()
            break
    if find_job_end(journal) is not None:
        return "ended"
    deadline = time.monotonic() + silence_s
    while _controller_answers(run_dir):  # the keeper alone died: its controller ends the run
        if find_job_end(journal) is not None:
            return "ended"
        if time.monotonic() > deadline:
            say(f"the controller still answers but has not ended the run in {silence_s:g} s")
            break
        time.sleep(0.2)
    return "ended" if find_job_end(journal) is not None else "lost"


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.keeper.standby_node RUN`` (a job step the keeper starts)."""
    from harness.keeper.keeper import Keeper, _say
    from harness.rundir import job_from_argv

    job = job_from_argv("python -m harness.keeper.standby_node", argv)
    if job is None:
        return 2
    run_dir, cfg = job
    os.environ.update(job_env())
    info = read_json(run_dir / KEEPER_FILE) or {}
    host, _, port = str(info.get("beat") or "").rpartition(":")
    try:
        key = bytes.fromhex(str(info.get("beat_key") or ""))
    except ValueError:
        key = b""
    if not host or not port.isdigit() or not key:
        _say(f"{run_dir / KEEPER_FILE} names no beat address and key: no standby here")
        return 2
    _say(f"standby on {this_host()} for the keeper on {info.get('host', '?')}")
    if watch(run_dir, (host, int(port)), key, cfg.timeouts.controller_silence, _say) == "ended":
        return 0
    _say(f"the keeper and its controller are gone: taking the run over on {this_host()}")
    lost = str(info.get("host") or "")
    keeper: Keeper = Keeper.for_job(run_dir, cfg, avoid=(lost,) if lost else ())
    code = keeper.run(takeover_first=True)
    # what its keeper had to stop: orphans to a chaos experiment's no_orphans (experiments.runner)
    write_json_atomic(run_dir / LEFT_BEHIND_FILE, {"left_behind": keeper.left_behind})
    _end_allocation(run_dir)
    return code


def _end_allocation(run_dir: Path) -> None:
    """The run ended under this keeper: write its report, then cancel the job (its batch step
    on the lost node would hold the allocation until the time limit). A run of a chaos
    experiment (its ``job.json`` names the experiment) lost the ``ftharness chaos`` process with
    the node: the experiment is finished here instead (``ftharness chaos --resume``: the runs
    after this one, then the experiment's report)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(_finish_command(run_dir), stdout=subprocess.DEVNULL, timeout=None)
    job = os.environ.get("SLURM_JOB_ID")
    if job and job.replace("_", "").isdigit():
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", job], timeout=60)


def _finish_command(run_dir: Path) -> list[str]:
    """``ftharness report RUN``, or for a run of a chaos experiment ``ftharness chaos
    EXPERIMENT --out OUT --resume`` (OUT: the experiment's directory, the run's parent)."""
    here = [sys.executable, "-m", "harness"]
    info = read_json(run_dir / JOB_FILE) or {}
    section = (info.get("hook") or {}).get("args") or {}
    experiment = section.get("experiment")
    if not experiment or not (run_dir.parent / "experiment.toml").is_file():
        return [*here, "report", str(run_dir)]
    launcher = [
        ["--launcher", str(o).split("=", 1)[1]]
        for o in section.get("overrides", ())
        if str(o).startswith("launcher=")
    ]
    return [
        *here, "chaos", str(experiment), "--out", str(run_dir.parent), "--resume", "--quiet",
        *(launcher[-1] if launcher else []),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
