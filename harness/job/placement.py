"""Where a replica group runs: a pure decision over the hosts' states (no I/O, no clock).

The rule, for replica ``r`` on hosts ``h0 .. h(n-1)``:

1. Its home host ``h(r % n)`` if that host is *ready* (its agent is up, it is not lost, not
   cooling down after an eviction, and *checked*: an agent that joined after the job's first
   preflight has passed a round of its own, ``harness.job.preflight.check_host``).
2. Otherwise the ready host running the fewest groups (``load``: host -> how many groups run
   there now, not counting this one), the first after home in ring order among equals: groups of
   an evicted host spread over the others instead of piling onto one, and an idle host (one no
   group calls home, or one whose groups left) is taken before a busy one.
3. No ready host: wait, at most until the earliest cooldown ends (or ``poll_s`` when a host is
   only being restarted).

Spare hosts (``spare``: SLURM's spare nodes) are no group's home: a group's home is
``a(r % m)`` over the ``m`` non-spare hosts ``a``; when its home is not ready a ready spare is
preferred (an idle node taking over a lost one's groups, as node-level hot spares do; the least
loaded first), then the other hosts. A *gone* host (SLURM shows its node down or drained, or the
node left the job) is never chosen and never respawned.

A group is placed anew only when it (re)starts: one running off its home host stays there until
its next restart, which goes home if that host is ready again.

Separately, every host that is lost and past its cooldown (or has none) is to be *respawned*:
the caller starts a fresh agent there in the background, never on a group's restart path, so a
restart is never held up by an agent importing torch (seen as an 8.8 s restart that waited for a
respawn on a group's old home host).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class HostState:
    name: str
    up: bool  # an agent is connected and not lost
    cooling_until: float = 0.0  # monotonic time before which no group may be placed there
    respawning: bool = False  # a fresh agent is being started there
    spare: bool = False  # holds no group until another host is lost
    gone: bool = False  # never to be used again (e.g. its node is down in SLURM)
    checked: bool = True  # its agent passed the preflight (False: its round runs, or it failed)


@dataclass(frozen=True)
class Placement:
    host: str | None  # where to place the group now, or None: wait
    respawn: tuple[str, ...]  # hosts whose agent should be restarted (in the background)
    wait_s: float  # with host None: how long to wait before deciding again
    reason: str


def ready(h: HostState, now: float) -> bool:
    """Whether a group may be placed on ``h`` now (module doc, rule 1)."""
    return h.up and h.checked and not h.gone and h.cooling_until <= now


def home_of(replica: int, hosts: Sequence[HostState]) -> int:
    """The index in ``hosts`` of ``replica``'s home host (module doc)."""
    homes = [i for i, h in enumerate(hosts) if not h.spare] or list(range(len(hosts)))
    return homes[replica % len(homes)]


def place(
    replica: int,
    hosts: Sequence[HostState],
    now: float,
    poll_s: float = 0.05,
    load: Mapping[str, int] | None = None,
) -> Placement:
    if not hosts:
        raise ValueError("no hosts to place a replica group on")
    respawn = tuple(
        h.name
        for h in hosts
        if not h.up and not h.respawning and not h.gone and h.cooling_until <= now
    )
    n = len(hosts)
    home = home_of(replica, hosts)
    if ready(hosts[home], now):
        return Placement(hosts[home].name, respawn, 0.0, "home host")
    why = f"home host {hosts[home].name} not ready"
    # The others in ring order after home; ``min`` keeps the first of the least loaded.
    ring = [hosts[(home + i) % n] for i in range(1, n)]
    others = [h for h in ring if ready(h, now)]
    if others:
        load = load or {}
        spares = [h for h in others if h.spare]
        best = min(spares or others, key=lambda h: load.get(h.name, 0))
        busy = load.get(best.name, 0)
        where = "a spare host" if best.spare else f"the least loaded ready host ({busy} group(s))"
        return Placement(best.name, respawn, 0.0, f"{why}: {where}")
    cooling = [h.cooling_until for h in hosts if h.cooling_until > now]
    wait = min(cooling) - now if cooling and not respawn else poll_s
    return Placement(None, respawn, max(poll_s, wait), "no host ready")
