"""Running a training program of the user's own, unmodified, in place of the built-in trainer
(``[program]`` in the job config: ``harness.program_config``).

How each piece of the job-level protocol (``harness.job.protocol``) applies to a program:

* **Spawn.** Each rank of each replica group is started by its host agent as a plain process
  (``runtime.program_proc``) with the environment a torchft launcher gives
  (``harness.job.program.env``): the group's id and count, the quorum service, the group's own
  store (a fresh one per incarnation), rank and world size; for torchtitan also its
  ``--fault_tolerance.*`` flags; warm (a fork of the agent's interpreter) where ``program.warm``
  allows. Output goes to ``RUN/logs/replica<r>-rank<k>.log``; a failure shows its tail.
* **Detect.** An exit or a signal is reaped by the agent as for any worker. A program sends no
  heartbeat: its liveness is its progress. Every group's Manager asks for a quorum once per step
  through a tap in front of the quorum service (``harness.quorum.tap``), and a group with no
  request in flight and none for ``program.progress_timeout_s`` (``start_timeout_s`` after it
  started) is hung: rank 0 is failed like a missed heartbeat and killed.
* **Unblock.** A dead or stopped group's peers are unblocked from outside (``runtime.sockets``);
  one that asks for no quorum within ``program.survivor_grace_s`` then is failed as hung.
* **Admit.** The tap lets in only a group's rank-0 process (``/proc``: ``.admission``).
* **Observe.** The tap's view is journalled as the group's progress, so every report works
  unchanged: a request at a higher step than the group's last is a ``step.commit`` (at the time
  of the request: a few milliseconds after the real commit), a jump of more than one step is a
  heal (``trainer.healed``: the group loaded a peer's state, seen when it next asks; so it is
  late by one step's time), a request at the same step is a ``step.abort``. Steps are journaled
  as inner steps, the Manager's step x ``program.sync_every`` (a LocalSGD or DiLoCo program asks
  once per sync), so steps lost count inner steps too. Rank 0 (whose Manager talks to the quorum
  service) stands for the group. Not observed: loss, samples, checksums, data positions.
* **Stop, place, restart**: as for the built-in trainer: the processes are supervised procs of
  the group's supervisor. A program that exits with code 0 has finished (not a failure); the
  job is done when every group has.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.job.program import admission as program_admission
from harness.job.program import env as program_env
from harness.job.program import takeover as program_takeover
from harness.job.program.deaths import DeathWatch
from harness.job.program.env import launcher_env, program_argv, run_in_program
from harness.job.program.group import ProgramGroup as _Group
from harness.job.program.group import ProgramJob
from harness.job.program.progress import (
    blocked_survivor,
    ended_early,
    gap_warning,
    hung_detail,
    hung_for,
    past_last_step,
    step_events,
)
from harness.job.program.unblock import RemoteUnblock
from harness.job.site import wants_quorum_relay
from harness.job.takeover import GroupPlan, TakenOver
from harness.program_config import WARM_NEEDS, cold_reason
from harness.quorum import rule
from harness.quorum.tap import Admission, QuorumTap, Request, upstream_id
from runtime import peer_process
from runtime.actor import wire_name
from runtime.failure import Failure
from runtime.journal import HEALED, STEP_ABORT, STEP_COMMIT
from runtime.mesh import ProcMesh
from runtime.messages import SpawnProgram
from runtime.relay import VIA_RELAY


class ProgramGroups:
    """The program's replica groups of one job: spawns them, watches them through the quorum
    tap, and journals their progress. ``harness.job.protocol`` calls :meth:`start`,
    :meth:`start_groups` and :meth:`stop`; the tap calls the observer methods."""

    def __init__(self, job: ProgramJob) -> None:
        self.job = job
        self.cfg = job.cfg
        self._lock = threading.Lock()
        self._groups: dict[int, _Group] = {}
        self._by_store: dict[str, _Group] = {}
        self._stale_ids: set[str] = set()
        self._deaths: set[tuple[int, int]] = set()  # (replica, incarnation) seen failing
        self._stop = threading.Event()
        self.tap: QuorumTap | None = None
        # Where the job's controller can be taken over: RUN/program.json (program_takeover)
        self.survivable = job.survivable
        # Its programs reach the tap through their host agent's relay (harness.job.site)
        self.relayed = wants_quorum_relay(self.cfg)
        self.durable: program_takeover.ProgramState | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        def tap(port: int) -> QuorumTap:
            return QuorumTap(
                bind_host=self.cfg.bind_host,
                upstream=lambda: self.job.quorum.address,
                observer=self,
                max_requests=max(64, 4 * self.cfg.replicas + 16),
                port=port,
            )

        takeover = self.job.plan is not None
        self.tap, self.durable = program_takeover.open_tap(
            tap, self.job.run_dir, takeover=takeover, survivable=self.survivable
        )
        c = self.job.controller
        self._deaths_watch = DeathWatch.attach(self.job, self._groups.get, self._check_all_done)
        for listener in (self._after_the_others, RemoteUnblock(c, self._inc), self._survivors_due):
            c.add_failure_listener(listener)
        if self.cfg.program.warm is None and (why := cold_reason(self.cfg.program)):
            self.job.say(f"program: every rank starts cold: {why}. {WARM_NEEDS}")
        threading.Thread(target=self._watch, daemon=True, name="ftharness-program-watch").start()

    def poison(self, key: int, effect: str = "unreadable") -> None:
        raise ValueError("poison_data needs the built-in trainer: a program reads its own data")

    def break_device(self, replica: int) -> None:
        raise ValueError("broken_device needs the built-in trainer: a program has its own device")

    def stop(self) -> None:
        """The job is stopping: no more hang reports, every group's training ends."""
        self._stop.set()
        with self._lock:
            groups = list(self._groups.values())
        for g in groups:
            if not g.training.done():
                g.training.set_result(None)

    def quorum_ids_reset(self) -> None:
        """The quorum service restarted numbering from the start: the tap continues its ids."""
        if self.tap is not None:
            self.tap.upstream_restarted()

    def close(self) -> None:
        """After every process is stopped: a program still asking would see the tap gone."""
        if self.tap is not None:
            self.tap.shutdown()

    def start_groups(
        self,
        replicas: list[int],
        hosts: dict[int, Any],
        incarnation: dict[int, int],
        stores: dict[int, str],
        cold: bool = False,
        member_ids: dict[int, str] | None = None,
    ) -> tuple[ProcMesh, dict[int, cf.Future]]:
        """Start every rank of ``replicas`` (on ``hosts``, with their fresh ``stores``); return
        them as a mesh {"replica", "rank"} and each group's training future (done when all its
        ranks exited with code 0). ``cold``: fresh interpreters even with ``program.warm`` (a
        full restart pays the imports a scheduler's restart pays). ``member_ids``: each group's
        name at the quorum service (``QuorumService.admit``), its Managers' name upstream."""
        assert self.tap is not None, "start() first"
        c = self.job.controller
        logs = Path(self.job.run_dir) / "logs"
        hooks = Path(self.job.run_dir) / "hooks"
        if self.cfg.program.hooks:
            hooks.mkdir(mode=0o700, exist_ok=True)
        cwd = self.cfg.program.cwd or os.getcwd()
        items: dict[tuple[int, ...], Any] = {}
        training: dict[int, cf.Future] = {}
        for i, r in enumerate(replicas):
            store_addr = stores[r]
            recs: list[Any] = []  # filled below: the group is known before its first request
            g = self._register(r, incarnation[r], store_addr, recs, (member_ids or {}).get(r, ""))
            if self.durable is not None:  # its store, durable before its programs start
                self.durable.groups[r] = program_takeover.GroupState(incarnation[r], store_addr)
                program_takeover.save(self.job.run_dir, self.durable)
            for k in range(self.cfg.ranks):
                log = program_env.start_log(logs, r, k, incarnation[r])
                env = launcher_env(
                    self.cfg,
                    replica=r,
                    rank=k,
                    # where the job relays the quorum (SLURM), the agent's relay to the tap:
                    # the address a new controller on another node is reached at too
                    lighthouse=VIA_RELAY if self.relayed else self.tap.address,
                    store_addr=store_addr,
                    hook_dir=str(hooks),
                    survivable=self.survivable,
                    incarnation=incarnation[r],
                    error_file=str(program_env.error_file(logs, r, k)),
                )
                spawn = SpawnProgram(
                    proc_id="",  # assigned by the controller
                    coords={"replica": r, "rank": k},
                    argv=program_argv(self.cfg, replica=r),
                    env=env,
                    cwd=cwd,
                    log_path=str(log),
                    warm=self.cfg.program.starts_warm and not cold,
                )
                rec = c.spawn_program(hosts[r], spawn)
                items[(i, k)] = rec.ref
                recs.append(rec)
            training[r] = self._track(g)
        # Wait for the pids (faults need them); a failed start is its supervisor's to handle.
        cf.wait([x.ready for x in self._all_recs(replicas)], timeout=c.spec.spawn_timeout_s)
        return ProcMesh(c, {"replica": len(replicas), "rank": self.cfg.ranks}, items), training

    def adopt(self, job: TakenOver, plan: GroupPlan) -> ProcMesh | None:
        return program_takeover.adopt(job, self, plan)

    def absorbs(self, failure: Failure) -> bool:
        return self._deaths_watch.after_finish(failure)

    def quorum_upstream(self) -> str | None:
        return self.tap.address if self.tap is not None else None

    def readmit(
        self,
        replica: int,
        incarnation: int,
        store: str,
        recs: list[Any],
        member_id: str,
        last_step: int | None,
    ) -> cf.Future:
        """A group a dead controller started, still running (``program_takeover.adopt``): the
        tap admits its programs again (by ``store``, rank 0's process and ``member_id``), its
        steps go on from ``last_step`` (the journal's), its exits are watched as for a group
        started here; return its training future."""
        g = self._register(replica, incarnation, store, list(recs), member_id)
        with self._lock:
            g.last_step, g.last, g.resumed = last_step, time.monotonic(), last_step is not None
        return self._track(g)

    def _inc(self, replica: int, proc_id: str) -> int | None:  # for RemoteUnblock
        with self._lock:
            g = self._groups.get(replica)
        return g.incarnation if g and any(x.ref.proc_id == proc_id for x in g.procs) else None

    def _all_recs(self, replicas: list[int]) -> list[Any]:
        with self._lock:
            return [rec for r in replicas for rec in self._groups[r].procs]

    def _register(
        self, replica: int, incarnation: int, store: str, recs: list[Any], member_id: str
    ) -> _Group:
        """The group's new incarnation replaces the old one (whose ids are stale from now)."""
        g = _Group(replica, incarnation, store, recs, time.monotonic(), cf.Future(), member_id)
        with self._lock:
            old = self._groups.get(replica)
            if old is not None:
                self._stale_ids |= old.ids
                self._by_store.pop(old.store, None)
                if not old.training.done():
                    old.training.set_result(None)
            self._groups[replica] = g
            self._by_store[store] = g
        return g

    def _track(self, g: _Group) -> cf.Future:
        """``g.training`` ends once every rank of ``g`` has exited with code 0."""
        left = [len(g.procs)]

        def one_finished(_: cf.Future) -> None:
            with self._lock:
                left[0] -= 1
                done = left[0] == 0 and self._groups.get(g.replica) is g
            if done and not g.training.done():
                self._exited(g)
                g.training.set_result(None)
                self._check_all_done()

        for rec in g.procs:
            rec.finished.add_done_callback(one_finished)
        return g.training

    def _exited(self, g: _Group) -> None:
        """Every rank of ``g`` exited with code 0: say so if it stopped short of the job's last
        step (the other groups train on; the job ends when every group is done)."""
        why = ended_early(g.last_step, self.cfg.steps, self.cfg.program.steps_per_quorum)
        if why is not None:
            self.job.say(f"replica group {g.replica} {why}; it is done, the others train on")

    def _check_all_done(self) -> None:
        """A group is done: the job is, once every group is, or once every group that is not
        is still rejoining after a failure while the others finished the job's last step (it
        has no peer left to heal from: its recovery is overtaken, ``runtime.journal.OVERTAKEN``,
        and it is stopped with the job instead of waiting out the quorum's timeout)."""
        with self._lock:
            groups = list(self._groups.values())
        if len(groups) < self.cfg.replicas:
            return
        left = [g for g in groups if not g.training.done()]
        if left:
            every = self.cfg.program.steps_per_quorum
            done = [g for g in groups if g.training.done()]
            if all(ended_early(g.last_step, self.cfg.steps, every) for g in done):
                return  # none reached the last step
            rejoining = self.job.tracker.stateless_replicas()  # failed, not back yet
            if any(g.replica not in rejoining for g in left):
                return  # one still trains
            for g in left:
                if self.job.tracker.overtaken(g.replica):
                    self.job.say(
                        f"replica group {g.replica} was still rejoining when every other group "
                        "finished the job's last step: the job is done (no peer is left to heal "
                        "it from)"
                    )
        self.job.finished()

    def member_ids(self, replica: int) -> tuple[str, ...]:
        """The current incarnation's Managers' ids at the quorum service (tap.upstream_id)."""
        with self._lock:
            g = self._groups.get(replica)
            return tuple(sorted(upstream_id(g.member_id, i) for i in g.ids)) if g else ()

    # -- faults ---------------------------------------------------------------------------------
    def run_in_worker(self, proc_id: str, func: Callable[..., Any], *args: Any) -> None:
        rec = self.job.controller.procs.get(proc_id)  # its hook: program_env.run_in_program
        if rec is None or rec.pid is None:
            raise RuntimeError(f"{wire_name(func)}: {proc_id} has no process")
        hooks = Path(self.job.run_dir) / "hooks" if self.cfg.program.hooks else None
        run_in_program(rec.pid, hooks, wire_name(func), *args)

    # -- the tap's observer ---------------------------------------------------------------------
    def admit(self, replica_id: str, peer: str, store_address: str | None) -> Admission | str:
        """The tap's question (``harness.quorum.tap.Observer``): by the process that holds the
        call's connection, the group's rank 0 (``harness.job.program.admission``)."""
        assert self.tap is not None
        return program_admission.admit(
            replica_id,
            peer,
            store_address,
            lock=self._lock,
            groups=self._groups,
            by_store=self._by_store,
            stale_ids=self._stale_ids,
            tap=peer_process.server_endpoint(self.tap.bind_host, self.tap.port),
            spawn_timeout_s=self.job.controller.spec.spawn_timeout_s,
        )

    def asked(self, req: Request) -> None:
        every = self.cfg.program.steps_per_quorum
        gap = None
        with self._lock:
            g = self._groups.get(req.replica)
            if g is None or req.replica_id not in g.ids:
                return
            g.waiting += 1
            now = time.monotonic()
            resumed, g.resumed = g.resumed, False  # its first request since a takeover
            if g.last_step is not None and g.last is not None and not resumed:
                g.gaps.append(now - g.last)
            # Watched until its second request since the death: a rank may ask once more (a
            # quorum already without the dead group) and block in the step after it.
            g.survived_asks += 1
            if g.survived_asks >= 2:
                g.survived = None
            if g.last is not None and g.long_gaps >= 0 and g.last_step is not None and not resumed:
                # twice in a row: the program's pace, not one stall behind a fault
                gap = gap_warning(now - g.last, self.cfg.program.progress_timeout_s, every)
                g.long_gaps = 0 if gap is None else g.long_gaps + 1
                gap, g.long_gaps = (gap, -1) if g.long_gaps == 2 else (None, g.long_gaps)
            g.last = now
            events = step_events(g.last_step, req.step)
            if resumed and req.step == g.last_step:
                events = []  # the request its dead controller saw, asked again: not an abort
            g.last_step = req.step if g.last_step is None else max(g.last_step, req.step)
            participants = g.participants
            host = g.procs[0].host.name
        if gap is not None:
            self.job.say(f"replica group {req.replica} {gap}")
        # Steps are journaled as inner steps: Manager step x program.sync_every (1 for DDP), so
        # every report (steps lost, at_steps, the progress line) counts what a program trains.
        base: dict[str, Any] = dict(replica=req.replica, rank=0, host=host, observed="quorum")
        if every > 1:
            base["sync_every"] = every
        step = req.step * every
        emit = self.job.journal.emit
        for event in events:
            if event == "healed":
                emit(HEALED, t=req.t, step=step, **base)
            elif event == "commit":
                emit(STEP_COMMIT, t=req.t, step=step, participants=participants, **base)
            elif event == "abort":
                reason = f"asked for a quorum again at step {step} without committing"
                if every > 1:
                    reason += f" (the {every} inner steps since its last sync are discarded)"
                emit(STEP_ABORT, t=req.t, step=step + every, reason=reason, **base)
        if step > self.cfg.steps and not g.training.done():
            self._past_last_step(g, req.step)

    def _past_last_step(self, g: _Group, step: int) -> None:
        """``g`` trained the job's ``steps`` and asks for more, which the quorum service refuses
        (``rule.step_refusal``): it is done, not hung; the job ends when every group is."""
        why = past_last_step(step, self.cfg.steps, self.cfg.program.steps_per_quorum)
        self.job.say(
            f"replica group {g.replica} {why}: it is done (set steps to the program's own step "
            "count to train on)"
        )
        g.training.set_result(None)
        self._check_all_done()

    def answered(self, req: Request, members: list[rule.Member] | None) -> None:
        with self._lock:
            g = self._groups.get(req.replica)
            if g is None or req.replica_id not in g.ids:
                return
            g.waiting = max(0, g.waiting - 1)
            g.last = time.monotonic()
            if members:
                g.participants = len(members)

    # -- liveness and the console ---------------------------------------------------------------
    def _watch(self) -> None:
        p = self.cfg.program
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                groups = list(self._groups.values())
            for g in groups:
                if g.hung or g.training.done() or not g.procs:
                    continue
                silent = hung_for(
                    now=now,
                    started=g.started,
                    last=g.last,
                    waiting=g.waiting,
                    start_s=p.start_timeout_s,
                    progress_s=p.progress_timeout_s,
                )
                detail = None
                if silent is not None:
                    detail = hung_detail(g.replica, silent, g.last is not None, p.steps_per_quorum)
                elif (blocked := self._blocked(g, now)) is not None:
                    silent, detail = blocked
                if silent is None or detail is None:
                    continue
                g.hung = True
                since = time.time() - silent
                self.job.controller.report_hung(g.procs[0].ref.proc_id, silent, since, detail)

    def _survivors_due(self, failure: Failure) -> None:
        """A group's death (its first failure): the others are due to ask again (_blocked)."""
        replica = (failure.coords or {}).get("replica")
        if self._stop.is_set() or replica is None or failure.proc is None:
            return
        inc = self._inc(replica, failure.proc)  # takes the lock
        with self._lock:
            if inc is None or (replica, inc) in self._deaths:
                return
            self._deaths.add((replica, inc))
        self._survived(replica, time.monotonic())

    def _blocked(self, g: _Group, now: float) -> tuple[float, str] | None:
        """``blocked_survivor``; if so, its recovery is opened, explained by the death's fault,
        and the other groups' clocks start again (it may be what holds them: one at a time)."""
        blocked = blocked_survivor(
            replica=g.replica,
            survived=g.survived,
            last_step=g.last_step,
            gaps=g.gaps,
            last=g.last,
            waiting=g.waiting,
            now=now,
            steps=self.cfg.steps,
            sync_every=self.cfg.program.steps_per_quorum,
            floor_s=self.cfg.program.survivor_grace_s,
        )
        if blocked is not None and g.survived is not None:
            self.job.tracker.failed_as_survivor(g.replica, g.survived[0], time.time())
            self._survived(g.replica, now)
        return blocked

    def _survived(self, dead: int, now: float) -> None:
        with self._lock:
            for g in self._groups.values():
                if g.replica != dead:
                    g.survived, g.survived_asks = (dead, now), 0

    def _after_the_others(self, failure: Failure) -> None:
        """A rank of a group's current incarnation failed after every other group finished the
        job's last step: the job is done. The others hold the final weights, and no peer is left
        to heal a replacement from (under torchft's Lighthouse it would train alone from step 0;
        under the tree quorum it would wait for a step no live member holds, then be judged
        hung, again and again)."""
        replica = (failure.coords or {}).get("replica")
        if self._stop.is_set() or replica is None or failure.proc is None:
            return
        if self._inc(replica, failure.proc) is None:
            return  # not a current rank (an old incarnation, a spare)
        with self._lock:
            others = [g for r, g in self._groups.items() if r != replica]
        every = self.cfg.program.steps_per_quorum
        if len(others) < self.cfg.replicas - 1 or not all(g.training.done() for g in others):
            return
        if all(ended_early(g.last_step, self.cfg.steps, every) for g in others):
            return  # none reached the last step: the job is not done
        self.job.say(
            f"replica group {replica} failed after every other group finished the job's last "
            "step: the job is done (nothing is left to heal it from)"
        )
        self.job.finished()
