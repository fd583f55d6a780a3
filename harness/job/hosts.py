"""The job's hosts: where a group goes (``harness.job.placement``'s rule), which hosts are kept out
for a while (a cooldown), and the agents restarted in the background when a host is lost.

A lost host gets a fresh agent once any cooldown is over, so the groups that come back to it later
find it ready (with its warm spares forked). Respawns never run on a group's restart path: a
group that needs a host waits in :meth:`HostPool.place` until one is ready. Under SLURM a node
that SLURM shows down, drained or gone is never used again, and with ``slurm.replace =
"new_job"`` a replacement node is asked for in a new job.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from harness.job.placement import HostState, place
from harness.job.site import Site
from runtime.controller import Controller
from runtime.failure import Cause, Failure
from runtime.host_handle import HostAgentHandle


class HostPool:
    """The hosts of one job on ``controller``. Thread-safe; ``say`` tells the user."""

    def __init__(
        self, site: Site, controller: Controller, run_dir: Path, say: Callable[[str], None]
    ) -> None:
        self.site = site
        self.cfg = site.cfg
        self.controller = controller
        self.run_dir = run_dir
        self._say = say
        self._change = threading.Condition(threading.RLock())  # guards the fields below
        self._cooldown: dict[str, float] = {}  # host -> monotonic end of its cooldown
        self._respawning: set[str] = set()  # hosts whose agent is restarted in the background
        self._closed = False
        site.node_events.listener = self._on_node_gone

    def names(self) -> list[str]:
        return self.site.host_names()

    def start(self) -> None:
        """Every host's agent: spawned by the launcher, or (``launcher = "external"``) dialled
        in by the user within ``timeouts.host_join``."""
        if self.cfg.launcher == "external":
            self._wait_for_external()
            return
        self._say(f"starting {len(self.names())} host agent(s) (each imports torch once)")
        for name in self.names():
            self.spawn(name)

    def close(self) -> None:
        """The job is stopping: no more respawns."""
        with self._change:
            self._closed = True
            self._change.notify_all()

    # -- place ----------------------------------------------------------------------------------
    def place(self, replica: int) -> HostAgentHandle:
        """The host for a group now (the placement rule); waits while none is ready."""
        with self._change:
            while True:
                decision = place(replica, self._states(), time.monotonic())
                for name in decision.respawn:
                    self._respawn(name)
                if decision.host is not None:
                    return self.controller.hosts[decision.host]
                self._change.wait(decision.wait_s)

    def _states(self) -> list[HostState]:
        hosts, slurm = self.controller.hosts, self.site.slurm
        return [
            HostState(
                name=n,
                up=n in hosts and not hosts[n].lost,
                cooling_until=self._cooldown.get(n, 0.0),
                respawning=n in self._respawning,
                spare=slurm is not None and n in slurm.spares,
                gone=slurm is not None and n in slurm.gone,
            )
            for n in self.names()
        ]

    # -- cooldowns and lost hosts ---------------------------------------------------------------
    def set_cooldown(self, host: str, seconds: float) -> None:
        """Keep ``host`` out for ``seconds``; its agent is restarted when the cooldown ends."""
        with self._change:
            self._cooldown[host] = time.monotonic() + seconds
        timer = threading.Timer(seconds, self._respawn_if_lost, (host,))
        timer.daemon = True
        timer.start()

    def on_failure(self, failure: Failure) -> None:
        """A failure listener: a lost host gets a fresh agent once its cooldown is over."""
        if failure.cause is Cause.LOST_HOST and failure.host is not None:
            with self._change:
                left = self._cooldown.get(failure.host, 0.0) - time.monotonic()
            if left <= 0:
                self._respawn_if_lost(failure.host)

    def _respawn_if_lost(self, host: str) -> None:
        with self._change:
            h = self.controller.hosts.get(host)
            if self._closed or (h is not None and not h.lost):
                return
            if self._cooldown.get(host, 0.0) > time.monotonic():
                return
            self._respawn(host)

    def _respawn(self, name: str) -> None:
        """Start a fresh agent on ``name`` on a background thread (lock held)."""
        if name in self._respawning:
            return
        self._respawning.add(name)

        def run() -> None:
            try:
                self.spawn(name)
            except Exception as exc:
                self._say(f"could not restart the agent of {name}: {exc}")
            finally:
                with self._change:
                    self._respawning.discard(name)
                    self._change.notify_all()

        threading.Thread(target=run, daemon=True, name=f"ftharness-respawn-{name}").start()

    # -- agents ---------------------------------------------------------------------------------
    def spawn(self, name: str) -> HostAgentHandle:
        """A host agent on ``name``, with its warm spares (``recovery.spares_per_host``)."""
        host = self.controller.spawn_host(name)
        self._keep_spares(host)
        return host

    def _keep_spares(self, host: HostAgentHandle) -> None:
        if self.cfg.recovery.spares_per_host:
            host.keep_spares(self.cfg.recovery.spares_per_host, log_dir=str(self.run_dir / "logs"))

    def _wait_for_external(self) -> None:
        """Agents on other machines dial in with ``ftharness agent``; the secret they need is
        written to a file only this user can read."""
        secret = self.run_dir / "agent.secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.controller.secret.hex() + "\n")
        host, port = self.controller.address
        self._say(
            f"waiting up to {self.cfg.timeouts.host_join:g} s for {self.cfg.hosts} host agent(s); "
            f"on each host I, with a copy of {secret} (mode 0600), run: ftharness agent "
            f"--controller {host}:{port} --secret-file {secret.name} --name hostI"
        )
        for h in self.controller.wait_for_hosts(self.names(), self.cfg.timeouts.host_join):
            self._keep_spares(h)

    # -- SLURM ----------------------------------------------------------------------------------
    def _on_node_gone(self, node: str, why: str) -> None:
        """SLURM shows a node down or drained, or it left the job: never place or respawn
        there again (the placement rule reads ``gone``)."""
        self._say(f"{why}: no group goes there again")
        with self._change:
            self._change.notify_all()
            closed = self._closed
        if self.cfg.slurm.replace == "new_job" and not closed:
            threading.Thread(target=self._replace_node, args=(node,), daemon=True).start()

    def _replace_node(self, lost: str) -> None:
        """``slurm.replace = "new_job"``: a new single-node job for the node SLURM took away; its
        node joins the job as a spare with a ready agent (placement then prefers it)."""
        assert self.site.slurm is not None
        try:
            self._say(f"asking SLURM for a node to replace {lost} (a new single-node job)")
            node = self.site.slurm.request_node()
            self._say(f"replacement node {node} allocated; starting its agent")
            self.spawn(node)
        except Exception as exc:
            self._say(f"no replacement for {lost}: {exc}")
            return
        with self._change:
            self._change.notify_all()
