"""The keeper's beats to a standby on another node (``harness.keeper.standby_node`` says why and
what the standby does with them): a TCP port named in ``keeper.json``, a byte every
``BEAT_INTERVAL_S`` to each standby connected, ``E`` when the keeper ends on purpose; and the
standby's job step, which the keeper starts.

Only a standby of the job's own counts: a connection first proves it holds the keeper's beat key
(``runtime.channel``'s handshake, within :data:`HANDSHAKE_S`), a random key of each keeper's
that ``keeper.json`` holds (mode 0600 in the 0700 run directory: the job's user alone reads it).
The job secret cannot serve here: the first controller writes it, after the keeper has started
the standby. A stranger's connection is closed unread and does not make the keeper "watched";
a standby that stops reading is dropped after :data:`SEND_S`, so it cannot stall the beats to
the others."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runtime import channel
from runtime.proctree import reap_within

if TYPE_CHECKING:
    from harness.config import JobConfig

#: What a beat is, and what a keeper that ends on purpose sends last.
BEAT, END = b"b", b"E"
#: A connection proves it holds the beat key within this long, or is closed.
HANDSHAKE_S = 5.0
#: A standby whose socket takes no beat within this long (it stopped reading) is dropped.
SEND_S = 2.0
#: Connections that may be proving themselves at once; more are closed at once.
MAX_PENDING = 32


class Remote:
    """The keeper's side: the beat port, and the standby step on ``node``."""

    def __init__(self, run_dir: Path, bind_host: str, node: str, interval_s: float) -> None:
        self.run_dir = run_dir
        self.node = node
        self.interval_s = interval_s
        self._server = socket.create_server((bind_host, 0))
        self.address = f"{bind_host}:{self._server.getsockname()[1]}"
        self.key = channel.new_secret()  # a standby proves it (keeper.json's "beat_key")
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._step: subprocess.Popen | None = None
        self.on_watched: Callable[[], None] | None = None  # once: the first standby connected

    def start(self) -> None:
        """Serve beats, and start the standby step (the keeper reaps its ``srun``)."""
        threading.Thread(target=self._accept, daemon=True, name="keeper-beats-accept").start()
        threading.Thread(target=self._beat, daemon=True, name="keeper-beats").start()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        from runtime.launchers.slurm import project_root, to_file

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (project_root(), env.get("PYTHONPATH", "")) if p
        )
        cmd = [
            "srun", "--nodes=1", "--ntasks=1", "-w", self.node, "--kill-on-bad-exit=0",
            "--overlap", f"--job-name=ftharness-standby-{self.node}", f"--chdir={os.getcwd()}",
            "--input=none", *to_file(str(logs / f"standby-{self.node}.out")),
            sys.executable, "-m", "harness.keeper.standby_node", str(self.run_dir),
        ]  # fmt: skip
        with open(logs / f"srun-standby-{self.node}.log", "ab") as log:
            self._step = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self._step.returncode = 0  # reaped by the keeper's wait, as its controllers are

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                conn.close()  # a flood of connections: the real standby's comes again
                continue
            threading.Thread(
                target=self._admit, args=(conn,), daemon=True, name="keeper-beats-admit"
            ).start()

    def _admit(self, conn: socket.socket) -> None:
        """A connection that proves the beat key becomes a standby that gets beats."""
        try:
            channel.server_handshake(conn, self.key, HANDSHAKE_S)
        except channel.ChannelError:  # AuthError among them: not ours, or too slow
            conn.close()
            return
        finally:
            self._pending.release()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(SEND_S)  # bounds every sendall to it
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._clients.append(conn)
            watched, self.on_watched = self.on_watched, None
        if watched is not None:
            watched()

    def _send(self, data: bytes) -> None:
        with self._lock:
            clients = list(self._clients)
        for conn in clients:
            try:
                conn.sendall(data)
            except OSError:  # gone, or took nothing for SEND_S (TimeoutError)
                with self._lock:
                    if conn in self._clients:
                        self._clients.remove(conn)
                conn.close()

    def _beat(self) -> None:
        while not self._closed.wait(self.interval_s):
            self._send(BEAT)

    def close(self) -> None:
        """The keeper ends on purpose: tell the standby (it exits), then stop serving."""
        self._closed.set()
        self._send(END)
        with self._lock:
            clients, self._clients = self._clients, []
        for conn in clients:
            conn.close()
        self._server.close()
        step = self._step
        if step is None:
            return
        reap_within(step.pid, 10.0, 0.05)  # it exits on the END: not a process left behind


def standby_node(nodes: list[str] | tuple[str, ...], here: str | None) -> str | None:
    """Where the standby runs: the allocation's last node other than this one (spare nodes are
    the last), None with no other node."""
    others = [n for n in nodes if n != here]
    return others[-1] if others else None


def for_job(
    run_dir: Path, cfg: JobConfig, interval_s: float, avoid: tuple[str, ...] = ()
) -> Remote | None:
    """The keeper's :class:`Remote` for ``cfg`` (a job a new controller can take over: the
    caller checked), or None: not SLURM, no allocation here, or no other node (than this one
    and those in ``avoid``: the lost node of a keeper this one replaces)."""
    if cfg.launcher != "slurm":
        return None
    from runtime.launchers.slurm import SlurmError, allocation_from_env, controller_address

    try:
        alloc = allocation_from_env(job_env())
        node = standby_node([n for n in alloc.nodes if n not in avoid], alloc.this_node)
        if node is None:
            return None
        return Remote(run_dir, controller_address(alloc), node, interval_s)
    except (SlurmError, OSError) as exc:
        print(f"[ftharness] no standby on another node: {exc}", file=sys.stderr, flush=True)
        return None


def job_env() -> dict[str, str]:
    """This process's SLURM environment as the job's: inside a step, ``SLURM_NNODES`` counts
    the step's nodes, not the job's."""
    env = dict(os.environ)
    if "SLURM_JOB_NUM_NODES" in env:
        env["SLURM_NNODES"] = env["SLURM_JOB_NUM_NODES"]
    return env
