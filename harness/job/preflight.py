"""The preflight: before any group trains, every host reaches every other host, or the job stops.

Once the host agents have dialled in and the quorum service serves, :func:`check_network` runs
one connectivity matrix (``runtime.preflight_matrix``): every agent listens for a moment at its
advertised address, and connects to every other agent's and to the controller's services (the
listener workers and agents dial, the quorum service's address), all in parallel,
each within ``timeouts.preflight``. Any path that does not work (refused, timed out, no route, an
address that is another machine's loopback, not the job's agent answering) stops the job before
training with a table naming both ends (:class:`PreflightFailed`, which ``run_job`` turns into a
failed outcome and rc 1); the journal's ``preflight`` record holds the whole matrix and its time
either way.

Why before training and not when a group first fails: a path that does not work shows up in a
run as a process group's rendezvous or a heal that times out, step after step, far from its cause
(issue #30: a rendezvous store at a hostname that resolves to loopback on the other node).

An agent that joins later (a lost host's agent restarted in the background, a SLURM replacement
node) gets a round of its own (:func:`check_host`, run by ``harness.job.hosts.HostPool`` on a
thread of its own, never on a group's restart path) before any group is placed on it: it probes
every other checked live host and the controller's services, and every such host probes it. A
failure does not stop the job, which is training: the host is kept out of placement until its
agent is restarted next (and passes), the console shows the table, and the journal a ``preflight``
record with ``host`` naming it. Only the paths from and to that host count: a peer that dies
during the round is not held against it.

Skipped (journalled as such) with ``preflight = false`` and with ``launcher = "local"``: every host
is then this machine, reached over loopback; so are the per-host rounds (not journalled).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from runtime.journal import PREFLIGHT
from runtime.preflight import Outcome
from runtime.preflight_matrix import Cell, run_matrix

if TYPE_CHECKING:
    from harness.config import JobConfig
    from harness.job.hosts import HostPool
    from harness.quorum.service import QuorumService
    from runtime.controller import Controller
    from runtime.journal import Journal


class Checked(Protocol):
    """What the preflight reads of the started job it checks (``harness.job.protocol.Job``)."""

    cfg: JobConfig
    journal: Journal

    @property
    def controller(self) -> Controller: ...

    @property
    def hosts(self) -> HostPool: ...

    @property
    def quorum(self) -> QuorumService: ...

    def host_names(self) -> list[str]: ...

    def say(self, text: str) -> None: ...


#: What to look at, per outcome: printed under the table for the outcomes it holds.
HINTS = {
    Outcome.REFUSED: "refused: nothing listens at that address and port on the target (is the "
    "address another machine's?), or a firewall rejects the connection",
    Outcome.TIMED_OUT: "timed out: the packets are dropped on the way (a firewall, a security "
    "group) or the address belongs to no machine the prober can reach",
    Outcome.UNREACHABLE: "unreachable: the prober has no route to that network or host",
    Outcome.LOOPBACK: "loopback: the target advertises a loopback address (its hostname "
    "resolves to 127.x, say), which the other hosts cannot reach it at; make it advertise an "
    "address of the job's network",
    Outcome.WRONG_PEER: "wrong peer: something else answers at that address (another "
    "machine's port, a NAT or proxy)",
    Outcome.UNRESOLVED: "unresolved: the advertised name does not resolve on the prober",
    Outcome.NOT_LISTENING: "not listening: the host could not listen at its own advertised "
    "address (it is not one of its addresses)",
    Outcome.NO_ANSWER: "no answer: the agent did not take part in time (overloaded, or gone)",
}


class PreflightFailed(RuntimeError):
    """The preflight found paths that do not work; the message is the table."""


def services(controller: Any, quorum_address: str) -> list[tuple[str, str, int]]:
    """The controller's services the hosts' processes dial: its listener (workers and agents)
    and the quorum service (the Managers), as (name, address, port)."""
    host, port = controller.address
    out = [("controller", str(host), int(port))]
    if quorum_address:
        rest = quorum_address.split("://", 1)[-1]
        addr, _, qport = rest.rpartition(":")
        if qport.isdigit():
            out.append(("quorum", addr.strip("[]"), int(qport)))
    return out


def check_network(job: Checked) -> None:
    """Run the preflight for a started ``job`` (``harness.job.protocol.Job``: its hosts up, its
    quorum service serving) and journal it; :class:`PreflightFailed` if a path does not work."""
    cfg = job.cfg
    if not cfg.preflight or cfg.launcher == "local":
        why = "preflight = false" if not cfg.preflight else 'launcher = "local": one machine'
        job.journal.emit(PREFLIGHT, status="skipped", reason=why, seconds=0.0)
        return
    controller = job.controller
    hosts = [controller.hosts[n] for n in job.host_names() if n in controller.hosts]
    hosts = [h for h in hosts if not h.lost]
    t0 = time.monotonic()
    cells = run_matrix(
        controller.preflight,
        hosts,
        services(controller, job.quorum.address),
        cfg.timeouts.preflight,
    )
    seconds = time.monotonic() - t0
    failed = [c for c in cells if not c.ok]
    table = render(cells, seconds) if failed else ""
    job.journal.emit(
        PREFLIGHT,
        status="failed" if failed else "ok",
        reason=table,
        seconds=round(seconds, 4),
        hosts=[h.name for h in hosts],
        paths=len(cells),
        failed=len(failed),
        matrix=[asdict(c) for c in cells],
    )
    if failed:
        raise PreflightFailed(table)
    job.say(f"preflight: {len(cells)} network path(s) of {len(hosts)} hosts ok in {seconds:.2f} s")
    # From now on an agent that joins is checked on its own before a group goes there.
    job.hosts.arm_preflight(functools.partial(check_host, job), hosts)


def check_host(job: Checked, name: str, peers: Callable[[], Sequence[str]]) -> str | None:
    """The round of ``name``, an agent that joined after the job's first round (module doc), with
    the live hosts ``peers()`` (already checked: asked as the round starts) of the started
    ``job``: journalled as ``preflight`` with ``host``, and said. None if every path from and to
    ``name`` works; else the table: ``name`` is to be kept out."""
    controller = job.controller
    subject = controller.hosts.get(name)
    if subject is None or subject.lost:
        return f"the agent of {name} is gone"
    others = [h for n in peers() if (h := controller.hosts.get(n)) is not None and not h.lost]
    t0 = time.monotonic()
    cells = run_matrix(
        controller.preflight,
        [subject, *others],
        services(controller, job.quorum.address),
        job.cfg.timeouts.preflight,
        subject=name,
    )
    seconds = time.monotonic() - t0
    if controller.closed:  # the job stopped meanwhile: nothing to say
        return None
    died = {h.name for h in others if h.lost}  # a peer lost meanwhile: not this host's fault
    failed = [
        c
        for c in cells
        if not c.ok and name in (c.src, c.dst) and not {c.src, c.dst} & died
    ]  # fmt: skip
    shown = [c for c in cells if c.ok or c in failed]
    outcome = f"host {name} is not used (its agent joined late; the job trains on without it)"
    table = render(shown, seconds, outcome) if failed else ""
    job.journal.emit(
        PREFLIGHT,
        status="failed" if failed else "ok",
        reason=table,
        seconds=round(seconds, 4),
        host=name,
        hosts=[name, *(h.name for h in others)],
        paths=len(cells),
        failed=len(failed),
        matrix=[asdict(c) for c in cells],
    )
    if not failed:
        job.say(
            f"preflight of host {name} (joined late): {len(cells)} network path(s) from and to "
            f"{len(others)} other host(s) and the controller ok in {seconds:.2f} s"
        )
        return None
    job.say(f"{table}\n  {name} is kept out of placement until its agent is restarted next")
    return table


def render(cells: Iterable[Cell], seconds: float, outcome: str = "training was not started") -> str:
    """The failed paths of ``cells`` as a table, with what to look at for each kind of failure;
    ``outcome``: what the failure means for the job (the headline's end)."""
    cells = list(cells)
    failed = sorted((c for c in cells if not c.ok), key=lambda c: (c.src, c.dst))
    rows = [("from", "to", "address", "result", "why")] + [
        (c.src, c.dst, f"{c.address}:{c.port}" if c.port else c.address, c.outcome, c.detail)
        for c in failed
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"preflight failed: {len(failed)} of {len(cells)} network path(s) do not work "
        f"(checked in {seconds:.2f} s); {outcome}",
        *("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[4]
          for r in rows),
    ]  # fmt: skip
    seen = {Outcome(c.outcome) for c in failed if c.outcome in Outcome._value2member_map_}
    lines += ["", *(f"  {HINTS[o]}" for o in Outcome if o in seen and o in HINTS)]
    lines.append("  (preflight = false skips this check; timeouts.preflight sets its timeout)")
    return "\n".join(lines)


def cells_from_journal(record: dict[str, Any]) -> list[Cell]:
    """The matrix of a ``preflight`` journal record, as cells (reports, tests)."""
    return [Cell(**c) for c in record.get("matrix", ())]
