"""The fault injector: walks a plan against a clock and the committed step, fires, heals.

Order of events for each planned fault (the journal is the only record anyone reads):

1. At its time (seconds since :meth:`Injector.start`) or once ``ctx.committed_step()`` reaches
   its step, a fault that waits for a moment (one with ``ready(ctx, rng)`` and ``wait_s``: a
   controller crash while another group heals) waits until ``ready`` or ``wait_s`` has passed,
   asked every 2 ms (its ``arm``, if it has one, is called once first, to prepare the
   moment); the faults after it do not wait for it (the moment may be theirs to make).
   Then the target is re-checked against the keep-alive set with the *live* placement; a
   protected target is skipped and logged (never fired). A fault that aims when it fires
   (``aim``: the source of a heal under way) is ready only once a candidate it may hit is
   there, gets the first such as its target, and is skipped if there is none by then.
2. ``fault.inject`` is written (``fault_id``, ``kind``, ``target``, ``seed``, ``step``; for a
   fault that waited, ``waited_s`` and ``ready``, and what its ``inject_fields(rng)`` adds).
3. ``fault.fire`` runs. If it raises, ``fault.heal`` is written at once with ``error``.
4. After the fault's ``hold_s``, ``fault.heal`` runs and ``fault.heal`` is written (with
   ``error`` if healing raised; a failed heal is reported, never retried).

:meth:`Injector.close` heals every fault still held, so a stopped experiment leaves no worker
SIGSTOPped or slowed down.

The injector runs in the job's controller. A controller can die (``controller_crash`` kills it
on purpose) and a new one take the job over (``harness.job.takeover``); the plan is in the
journal (``fault.plan``, :func:`plan_record`), and the new controller's injector continues it
(:meth:`Injector.resume`): the same clock, no fault fired twice, the faults still held healed at
their time.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from faults.fault import Fault, FaultContext, Target, make_fault
from faults.schedule import PlannedFault
from faults.targets import KeepAlive, protected_reason
from runtime.journal import FAULT_HEAL, FAULT_INJECT, FAULT_PLAN, Record

log = logging.getLogger(__name__)


#: How often a fault waiting for its moment (``ready``) is asked again.
READY_POLL_S = 0.002


def due_faults(
    plan: Sequence[PlannedFault], fired: int, elapsed_s: float, committed_step: int
) -> list[PlannedFault]:
    """The faults due now, in plan order, starting at index ``fired`` (pure). A fault is due when
    its time has passed or the committed step has reached its step; a later fault never fires
    before an earlier one."""
    out = []
    for f in plan[fired:]:
        by_time = f.at_s is not None and elapsed_s >= f.at_s
        by_step = f.at_step is not None and committed_step >= f.at_step
        if not (by_time or by_step):
            break
        out.append(f)
    return out


def plan_record(records: Sequence[Record]) -> tuple[float, list[PlannedFault]] | None:
    """The injector's start (wall-clock seconds) and whole plan, from the first ``fault.plan``
    record of ``records``; None if it never started."""
    for r in records:
        if r.get("event") == FAULT_PLAN:
            return float(r["t"]), [PlannedFault.from_dict(f) for f in r.get("faults") or []]
    return None


@dataclass(frozen=True, kw_only=True)
class Held:
    """A fired fault waiting for its heal."""

    planned: PlannedFault
    fault: Fault
    target: Target
    heal_at: float


class Injector:
    """Fires ``plan`` through ``ctx``. ``options`` maps a kind to its fault options (e.g.
    ``{"slow_rank": {"delay_s": 1.0}}``). ``healthy`` (optional) returns the replica groups
    healthy right now, for the never-the-last-healthy-group rule. ``clock`` is monotonic seconds.

    Not thread-safe: call :meth:`poll` from one thread, or use :meth:`start_thread`.
    """

    def __init__(
        self,
        plan: Sequence[PlannedFault],
        ctx: FaultContext,
        *,
        seed: int,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        keep_alive: KeepAlive | None = None,
        healthy: Callable[[], Collection[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = list(plan)
        self.ctx = ctx
        self.seed = seed
        self.keep_alive = keep_alive if keep_alive is not None else KeepAlive()
        self.healthy = healthy
        self.clock = clock
        opts = dict(options or {})
        # Build every fault up front: a bad option fails before the first fault fires.
        self._faults = {
            k: make_fault(k, **dict(opts.get(k, {}))) for k in {f.kind for f in self.plan}
        }
        self._t0: float | None = None
        self._next = 0
        self._held: list[Held] = []
        self.fired: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Faults due and waiting for their moment (``ready``), with when they became due.
        self._waiting: list[tuple[PlannedFault, float]] = []

    # -- driving --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the clock: ``at_s`` is measured from here; the plan goes to the journal."""
        self._t0 = self.clock()
        self.ctx.journal.emit(FAULT_PLAN, seed=self.seed, faults=[f.as_dict() for f in self.plan])

    def resume(self, records: Sequence[Record]) -> None:
        """Continue the plan a dead controller's injector walked, from its journal ``records``
        (this injector has the same plan: :func:`plan_record`): its clock (``fault.plan``'s
        time), every fault up to the last it injected done (fired or skipped: faults fire in
        plan order), and the ones injected and not healed held again, to heal at their time."""
        found = plan_record(records)
        if found is None:
            raise ValueError("no fault.plan in the journal: the injector never started")
        started, _ = found
        now_wall, now = time.time(), self.clock()
        self._t0 = now - (now_wall - started)
        order = {f.fault_id: i for i, f in enumerate(self.plan)}
        injected = {r.get("fault_id"): r for r in records if r.get("event") == FAULT_INJECT}
        healed = {r.get("fault_id") for r in records if r.get("event") == FAULT_HEAL}
        done = [order[i] for i in injected if i in order]
        self._next = max(done) + 1 if done else 0
        self.fired = [f.fault_id for f in self.plan if f.fault_id in injected]
        # Faults that were waiting for their moment when the last controller died wait again
        # (any other fault before the last injected one was skipped: a protected target).
        self._waiting = [
            (f, now)
            for f in self.plan[: self._next]
            if f.fault_id not in injected and hasattr(self._faults[f.kind], "ready")
        ]
        for fault_id, r in injected.items():
            if fault_id in healed or fault_id not in order:
                continue
            planned = self.plan[order[fault_id]]
            fault = self._faults[planned.kind]
            heal_at = now - (now_wall - float(r["t"])) + fault.hold_s
            target = Target.from_dict(r.get("target") or {})
            self._held.append(Held(planned=planned, fault=fault, target=target, heal_at=heal_at))

    @property
    def done(self) -> bool:
        """Every planned fault has fired (or been skipped) and healed."""
        return self._next >= len(self.plan) and not self._held and not self._waiting

    def poll(self) -> None:
        """Fire what is due, heal what has been held long enough."""
        if self._t0 is None:
            self.start()
        assert self._t0 is not None
        now = self.clock()
        if self._next < len(self.plan):
            step = (
                self.ctx.committed_step()
                if any(f.at_step is not None for f in self.plan[self._next :])
                else -1
            )
            for planned in due_faults(self.plan, self._next, now - self._t0, step):
                self._next += 1
                if hasattr(self._faults[planned.kind], "ready"):
                    self._arm(planned)
                    self._waiting.append((planned, now))
                else:
                    self._fire(planned)
        for planned, since in list(self._waiting):
            waited = self._ready(planned, since, self.clock())
            if waited is not None:
                self._waiting.remove((planned, since))
                self._fire(planned, waited)
        now = self.clock()
        for held in [h for h in self._held if h.heal_at <= now]:
            self._held.remove(held)
            self._heal(held)

    def start_thread(self, poll_s: float = 0.05) -> threading.Thread:
        """Poll on a daemon thread until :meth:`close` (started or resumed first)."""
        if self._t0 is None:
            self.start()

        def loop() -> None:
            while not self._stop.wait(READY_POLL_S if self._waiting else poll_s):
                try:
                    self.poll()
                except Exception:  # the injector must not die silently mid-experiment
                    log.exception("fault injector poll failed")

        self._thread = threading.Thread(target=loop, name="ftharness-injector", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop polling and heal everything still held."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        while self._held:
            self._heal(self._held.pop(0))

    # -- one fault ------------------------------------------------------------------------------

    def _arm(self, planned: PlannedFault) -> None:
        """Let a fault that waits for its moment prepare it (``arm``), once, as it falls due."""
        arm = getattr(self._faults[planned.kind], "arm", None)
        if arm is None:
            return
        try:
            arm(self.ctx, self._rng(planned))
        except Exception as e:  # it still waits for its moment, which may come by itself
            log.warning("fault %s (%s): arm() failed: %r", planned.fault_id, planned.kind, e)

    def _protected(self, target: Target) -> str | None:
        """Why ``target`` must not be hit now (keep-alive, the last healthy group), or None."""
        return protected_reason(
            target,
            self.keep_alive,
            replica_host=self.ctx.replica_host,
            replicas=self.ctx.replicas,
            healthy=self.healthy() if self.healthy is not None else None,
        )

    def _aimed(self, planned: PlannedFault) -> Target | None:
        """For a fault that aims when it fires (``aim``: its candidates now, best first), the
        first candidate not protected; None if there is none."""
        aim = self._faults[planned.kind].aim  # type: ignore[attr-defined]
        candidates = aim(self.ctx, planned.target)
        return next((t for t in candidates if self._protected(t) is None), None)

    def _live_target(self, planned: PlannedFault) -> Target | None:
        """The planned target with its group's *current* host (groups move after evictions),
        or, for a fault on the controller's node, the node the controller runs on now; for a
        fault that aims when it fires (``aim``), its aim (None: nothing to hit now)."""
        t = planned.target
        if hasattr(self._faults[planned.kind], "aim"):
            return self._aimed(planned)
        if t.replica is not None:
            return replace(t, host=self.ctx.replica_host(t.replica))
        if t.controller and getattr(self._faults[planned.kind], "on_controller_node", False):
            return replace(t, host=self.ctx.controller_host())
        return t

    def _rng(self, planned: PlannedFault) -> random.Random:
        """The fault's own generator: the same draws in ``ready``, ``fire`` and any rerun."""
        return random.Random(f"{self.seed}:{planned.fault_id}")

    def _ready(self, planned: PlannedFault, since: float, now: float) -> dict[str, Any] | None:
        """None while ``planned`` (due since ``since``) waits for its moment; once that came
        or its ``wait_s`` passed, the fields its ``fault.inject`` gets for the wait."""
        fault = self._faults[planned.kind]
        try:
            ok = bool(fault.ready(self.ctx, self._rng(planned)))  # type: ignore[attr-defined]
            if ok and hasattr(fault, "aim"):  # and something there it may hit
                ok = self._aimed(planned) is not None
        except Exception as e:  # its fire fails the same way, and says so in the journal
            log.warning("fault %s (%s): ready() failed: %r", planned.fault_id, planned.kind, e)
            ok = True
        waited = now - since
        if not ok and waited < float(getattr(fault, "wait_s", 0.0)):
            return None
        if not ok:
            log.warning(
                "fault %s (%s): its moment did not come within %.1f s; firing it anyway",
                planned.fault_id,
                planned.kind,
                waited,
            )
        return {"waited_s": round(waited, 3), "ready": ok}

    def _fire(self, planned: PlannedFault, waited: dict[str, Any] | None = None) -> None:
        target = self._live_target(planned)
        if target is None:
            reason: str | None = "nothing it may hit was there to aim at when it fired"
            target = planned.target
        else:
            reason = self._protected(target)
        if reason is not None:
            log.warning(
                "skipping %s %s at %s: %s",
                planned.fault_id,
                planned.kind,
                target.describe(),
                reason,
            )
            self.skipped.append((planned.fault_id, reason))
            return
        fault = self._faults[planned.kind]
        extra = getattr(fault, "inject_fields", None)
        self.ctx.journal.emit(
            FAULT_INJECT,
            fault_id=planned.fault_id,
            kind=planned.kind,
            target=target.as_dict(),
            seed=self.seed,
            step=self.ctx.committed_step(),
            planned=planned.when(),
            **(waited or {}),
            **(extra(self._rng(planned)) if extra is not None else {}),
        )
        self.fired.append(planned.fault_id)
        try:
            fault.fire(self.ctx, target, self._rng(planned))
        except Exception as e:
            log.exception("fault %s (%s) failed to fire", planned.fault_id, planned.kind)
            self.ctx.journal.emit(
                FAULT_HEAL,
                fault_id=planned.fault_id,
                kind=planned.kind,
                error=f"fire failed: {e!r}",
            )
            return
        self._held.append(
            Held(planned=planned, fault=fault, target=target, heal_at=self.clock() + fault.hold_s)
        )

    def _heal(self, held: Held) -> None:
        error = None
        try:
            held.fault.heal(self.ctx, held.target)
        except Exception as e:
            log.exception("fault %s (%s) failed to heal", held.planned.fault_id, held.planned.kind)
            error = f"heal failed: {e!r}"
        fields: dict[str, Any] = {"fault_id": held.planned.fault_id, "kind": held.planned.kind}
        if error:
            fields["error"] = error
        self.ctx.journal.emit(FAULT_HEAL, **fields)
