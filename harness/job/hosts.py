"""The job's hosts: where a group goes (``harness.job.placement``'s rule), which hosts are kept out
for a while (a cooldown), and the agents restarted in the background when a host is lost.

A lost host gets a fresh agent once any cooldown is over, so the groups that come back to it later
find it ready (with its warm spares forked). Respawns never run on a group's restart path: a
group that needs a host waits in :meth:`HostPool.place` until one is ready. Under SLURM a node
that SLURM shows down, drained or gone is never used again, and with ``slurm.replace =
"new_job"`` a replacement node is asked for in a new job.

Restarts of a host's agent are bounded, for every launcher (``runtime.policy.host_restart``): a
host whose agent cannot be restarted (it fails to start, or never dials in) is tried at most
``recovery.host_max_restarts`` times within ``recovery.host_within_s``, then *given up*, treated
as gone. A restart that fails is tried again on its own after a short back-off (``RETRY_S``), not
only when a group next needs the host: a host evicted while its groups found room elsewhere
must not stay lost for want of a placement. A restart that succeeds starts the count again: a
host that is evicted and comes back (a chaos run's evictions, every few minutes for hours) is
never given up for that. When no host is left (all gone or given up), or the SLURM allocation
has ended, the job fails at once with the reason (``fail``) instead of waiting for a host that
cannot come.

Once the job's first preflight has passed (:meth:`HostPool.arm_preflight`), an agent that joins
later (a respawn, a replacement node, an agent dialled in by hand for a lost host) is no group's
host until its own round (``harness.job.preflight.check_host``) has passed: the round runs on a
thread of its own as soon as the agent is up (a group that needs a host meanwhile goes to a ready
one, as while the agent starts). A host whose round fails is kept out while that agent runs; its
next agent (after a loss) is checked again. A host kept out counts as no host left above.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from harness.job.placement import HostState, place, ready
from harness.job.site import Site
from runtime.controller import Controller
from runtime.failure import Cause, Failure
from runtime.host_handle import HostAgentHandle
from runtime.policy import Action, host_restart

#: The preflight of an agent that joined later: ``check(name, peers)`` -> None if it passed, else
#: why not (``harness.job.preflight.check_host``); ``peers()``: the hosts to check it with.
Check = Callable[[str, Callable[[], list[str]]], str | None]
#: A lost host whose fresh agent failed to come up is tried again this many seconds later, times
#: the restarts it has had in the window (1 s, 2 s, 3 s, ...), without waiting for a group to
#: need it; the restart intensity still bounds the tries.
RETRY_S = 1.0


class HostPool:
    """The hosts of one job on ``controller``. Thread-safe; ``say`` tells the user; ``fail``
    ends the job with a reason (no host left, the allocation ended)."""

    def __init__(
        self,
        site: Site,
        controller: Controller,
        run_dir: Path,
        say: Callable[[str], None],
        *,
        fail: Callable[[str], None] | None = None,
    ) -> None:
        self.site = site
        self.cfg = site.cfg
        self.controller = controller
        self.run_dir = run_dir
        self._say = say
        self._change = threading.Condition(threading.RLock())  # guards the fields below
        self._cooldown: dict[str, float] = {}  # host -> monotonic end of its cooldown
        self._respawning: set[str] = set()  # hosts whose agent is restarted in the background
        self._restarts: dict[str, list[float]] = {}  # host -> its restarts since one succeeded
        self._last_error: dict[str, str] = {}  # host -> why its last restart failed
        self.given_up: dict[str, str] = {}  # host -> why it is never restarted again
        self._fail = fail or (lambda _: None)
        self._failed = False
        self._closed = False
        # The per-host preflight (module doc): None until the job's first round has passed.
        self._check: Check | None = None
        self._passed: dict[str, HostAgentHandle] = {}  # host -> its agent that passed a round
        self._unfit: dict[str, tuple[HostAgentHandle, str]] = {}  # host -> (agent, why) failed
        self._checking: set[str] = set()  # hosts whose round is under way
        # One round at a time, its verdict recorded before the next starts: two agents that join
        # at once check each other in the second one.
        self._rounds = threading.Lock()
        # replica -> the host it was last placed on (its load on that host; the placement rule
        # spreads groups that leave their home host over the least loaded ready hosts)
        self._placed: dict[int, str] = {}
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
        """The job is stopping: no more respawns, and none in flight is waited for."""
        with self._change:
            self._closed = True
            self._change.notify_all()
        self._abandon_respawns("the job is stopping")

    def _abandon_respawns(self, why: str) -> None:
        """Stop waiting for the agents being restarted to dial in (an agent that cannot come,
        its allocation gone, would hold the controller's spawner, and the exit, for the whole
        dial-in timeout)."""
        from runtime.channel import ChannelError

        with self._change:
            names = list(self._respawning)
        table = getattr(self.controller, "host_table", None)
        if table is None:
            return
        for name in names:
            with contextlib.suppress(cf.InvalidStateError):
                table.expect([name])[name].set_exception(
                    ChannelError(f"not waiting for the agent of {name}: {why}")
                )

    # -- place ----------------------------------------------------------------------------------
    def place(self, replica: int) -> HostAgentHandle:
        """The host for a group now (the placement rule); waits while none is ready."""
        with self._change:
            while True:
                load: dict[str, int] = {}
                for r, name in self._placed.items():
                    if r != replica:
                        load[name] = load.get(name, 0) + 1
                decision = place(replica, self._states(), time.monotonic(), load=load)
                for name in decision.respawn:
                    self._respawn(name)
                if decision.host is not None:
                    self._placed[replica] = decision.host
                    return self.controller.hosts[decision.host]
                self._change.wait(decision.wait_s)

    def ready_hosts(self) -> list[str]:
        """The hosts a group could be placed on now (up, checked, not cooling down, not gone)."""
        with self._change:
            now = time.monotonic()
            return [h.name for h in self._states() if ready(h, now)]

    def _states(self) -> list[HostState]:
        hosts, slurm = self.controller.hosts, self.site.slurm
        for n in self.names():
            self._maybe_check(n)  # an agent that joined and is not checked yet: check it now
        return [
            HostState(
                name=n,
                up=n in hosts and not hosts[n].lost,
                cooling_until=self._cooldown.get(n, 0.0),
                respawning=n in self._respawning,
                spare=slurm is not None and n in slurm.spares,
                gone=(slurm is not None and n in slurm.gone) or n in self.given_up,
                checked=self._checked(n),
            )
            for n in self.names()
        ]

    # -- the preflight of agents that join later ------------------------------------------------
    def arm_preflight(self, check: Check, passed: Iterable[HostAgentHandle]) -> None:
        """From now on an agent that joins is placed on only once ``check(name, peers)`` passed
        (its round with ``peers()``, the other checked live hosts as the round starts: of two
        agents that join at once, the second checks the first); ``passed``: the agents the
        job's first round checked."""
        with self._change:
            self._check = check
            self._passed = {h.name: h for h in passed}

    def checked(self, name: str) -> bool:
        """Whether ``name``'s current agent may hold groups as far as the preflight goes (its
        round passed, or no round is due)."""
        with self._change:
            return self._checked(name)

    def _checked(self, name: str) -> bool:
        """(lock held) ``name``'s current agent may hold groups, as far as the preflight goes."""
        if self._check is None:
            return True
        h = self.controller.hosts.get(name)
        return h is not None and self._passed.get(name) is h

    def _maybe_check(self, name: str) -> None:
        """(lock held) Start the round of ``name``'s agent if it is up and neither checked, being
        checked, nor found unfit already (that agent: a new one is checked again)."""
        check = self._check
        h = self.controller.hosts.get(name)
        if check is None or h is None or h.lost or self._closed or self._failed:
            return
        unfit = self._unfit.get(name)
        if name in self._checking or self._passed.get(name) is h or (unfit and unfit[0] is h):
            return
        self._checking.add(name)

        def peers() -> list[str]:
            with self._change:
                return [n for n in self.names() if n != name and self._checked(n) and self._live(n)]

        def run() -> None:
            with self._rounds:
                try:
                    why = "the job is stopping" if self._closed else check(name, peers)
                except Exception as exc:  # a round that cannot run proves nothing: kept out
                    why = f"the preflight of {name} could not run: {type(exc).__name__}: {exc}"
                    self._say(why)
                self._judged(name, h, why)

        threading.Thread(target=run, daemon=True, name=f"ftharness-preflight-{name}").start()

    def _judged(self, name: str, h: HostAgentHandle, why: str | None) -> None:
        """The round of ``name``'s agent ``h`` is over: None, it passed; else why not."""
        with self._change:
            self._checking.discard(name)
            if self.controller.hosts.get(name) is h and not h.lost:
                if why is None:
                    self._passed[name] = h
                    self._unfit.pop(name, None)
                else:
                    first = why.splitlines()[0] if why else "failed"
                    self._unfit[name] = (h, f"kept out by its preflight ({first})")
                    self._fail_if_no_host()
            self._change.notify_all()

    def _live(self, name: str) -> bool:
        h = self.controller.hosts.get(name)
        return h is not None and not h.lost

    def kept_out(self) -> dict[str, str]:
        """Hosts whose current agent (live) failed its preflight, with why."""
        with self._change:
            hosts = self.controller.hosts
            return {n: w for n, (h, w) in self._unfit.items() if hosts.get(n) is h and not h.lost}

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

    def respawn_lost(self, host: str) -> None:
        """A host whose agent did not re-dial after a takeover (``harness.job.takeover``): it
        is lost, and gets a fresh agent as any lost host does."""
        with self._change:
            self._respawn(host)

    def _respawn_if_lost(self, host: str) -> None:
        with self._change:
            h = self.controller.hosts.get(host)
            if self._closed or (h is not None and not h.lost):
                return
            if self._cooldown.get(host, 0.0) > time.monotonic():
                return
            self._respawn(host)

    def _respawn(self, name: str) -> None:
        """Start a fresh agent on ``name`` on a background thread (lock held), within the
        host restart intensity (module doc). Never on a node SLURM took away (every road to a
        restart comes here: a lost host, a cooldown's end, a takeover, a retry)."""
        if name in self._respawning or name in self.given_up or self._closed or self._failed:
            return
        if self.site.slurm is not None and name in self.site.slurm.gone:
            return
        r = self.cfg.recovery
        history = self._restarts.setdefault(name, [])
        decision = host_restart(history, time.monotonic(), r.host_max_restarts, r.host_within_s)
        if decision.action is Action.ESCALATE:
            last = self._last_error.get(name)
            self._give_up(name, decision.reason + (f"; last error: {last}" if last else ""))
            return
        history.append(time.monotonic())
        self._respawning.add(name)
        attempt = f"{len(history)}/{r.host_max_restarts} within {r.host_within_s:g} s"

        def run() -> None:
            try:
                self.spawn(name)
                with self._change:
                    self._restarts[name] = []  # it came back: the count starts again
                    self._maybe_check(name)  # its preflight, before a group goes there
            except Exception as exc:
                with self._change:
                    self._last_error[name] = str(exc)
                    closed = self._closed or self._failed
                if not closed:
                    self._say(f"could not restart the agent of {name} (restart {attempt}): {exc}")
                    retry = threading.Timer(RETRY_S * len(history), self._respawn_if_lost, (name,))
                    retry.daemon = True
                    retry.start()  # tried again on its own, within the restart intensity
            finally:
                with self._change:
                    self._respawning.discard(name)
                    self._change.notify_all()

        threading.Thread(target=run, daemon=True, name=f"ftharness-respawn-{name}").start()

    def _give_up(self, name: str, why: str) -> None:
        """Never restart ``name`` again (lock held); with no host left the job fails."""
        self.given_up[name] = why
        self._say(f"giving up on host {name}: {why}; no group goes there again")
        self._change.notify_all()
        self._fail_if_no_host()

    def _fail_if_no_host(self) -> None:
        """(lock held) Every host gone or given up: no group can ever run again."""
        slurm, kept_out = self.site.slurm, self.kept_out()
        why = {
            n: self.given_up.get(n) or (slurm.gone.get(n) if slurm else None) or kept_out.get(n)
            for n in self.names()
        }
        if self._closed or self._failed or not all(why.values()):
            return
        self._failed = True
        self._fail(
            "no host left to run a replica group on: "
            + "; ".join(f"{n}: {w}" for n, w in why.items())
        )

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
        there again (the placement rule reads ``gone``). The allocation itself ended: the job
        stops now (its steps, the agents with their workers, are gone with it)."""
        ended = self.site.slurm.ended if self.site.slurm is not None else None
        if ended is not None:
            with self._change:
                if self._failed or self._closed:
                    return
                self._failed = True
                self._change.notify_all()
            self._say(f"{ended}: the allocation is over, stopping")
            self._abandon_respawns(ended)
            self._fail(
                f"{ended}: the allocation ended under the job, so its job steps (the host agents "
                "and their workers) are gone and none can start; the last checkpoint written "
                "is the one to resume from"
            )
            return
        self._say(f"{why}: no group goes there again")
        with self._change:
            self._change.notify_all()
            if self.cfg.slurm.replace != "new_job":  # (else a new node is on its way)
                self._fail_if_no_host()
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
            self._maybe_check(node)  # its preflight, before a group goes there
            self._change.notify_all()
