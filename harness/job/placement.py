"""Where a replica group runs: a pure decision over the hosts' states (no I/O, no clock).

The rule, for replica ``r`` on hosts ``h0 .. h(n-1)``:

1. Its home host ``h(r % n)`` if that host is *ready* (its agent is up, it is not lost, not
   cooling down after an eviction, and *checked*: an agent that joined after the job's first
   preflight has passed a round of its own, ``harness.job.preflight.check_host``).
2. Otherwise the first ready host after home, in ring order: groups of an evicted host spread
   over the others instead of piling onto one.
3. No ready host: wait, at most until the earliest cooldown ends (or ``poll_s`` when a host is
   only being restarted).

Spare hosts (``spare``: SLURM's spare nodes) are no group's home: a group's home is
``a(r % m)`` over the ``m`` non-spare hosts ``a``; when its home is not ready a ready spare is
preferred (an idle node taking over a lost one's groups, as node-level hot spares do), then the
ring. A *gone* host (SLURM shows its node down or drained, or the node left the job) is never
chosen and never respawned.

Separately, every host that is lost and past its cooldown (or has none) is to be *respawned*:
the caller starts a fresh agent there in the background, never on a group's restart path, so a
restart is never held up by an agent importing torch (seen as an 8.8 s restart that waited for a
respawn on a group's old home host).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def place(replica: int, hosts: Sequence[HostState], now: float, poll_s: float = 0.05) -> Placement:
    if not hosts:
        raise ValueError("no hosts to place a replica group on")
    respawn = tuple(
        h.name
        for h in hosts
        if not h.up and not h.respawning and not h.gone and h.cooling_until <= now
    )
    n = len(hosts)
    homes = [i for i, h in enumerate(hosts) if not h.spare] or list(range(n))
    home = homes[replica % len(homes)]

    def ready(h: HostState) -> bool:
        return h.up and h.checked and not h.gone and h.cooling_until <= now

    if ready(hosts[home]):
        return Placement(hosts[home].name, respawn, 0.0, "home host")
    why = f"home host {hosts[home].name} not ready"
    for h in hosts:
        if h.spare and ready(h):
            return Placement(h.name, respawn, 0.0, f"{why}: a spare host")
    for i in range(1, n):
        h = hosts[(home + i) % n]
        if ready(h):
            return Placement(h.name, respawn, 0.0, why)
    cooling = [h.cooling_until for h in hosts if h.cooling_until > now]
    wait = min(cooling) - now if cooling and not respawn else poll_s
    return Placement(None, respawn, max(poll_s, wait), "no host ready")
