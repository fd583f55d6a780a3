"""``ftharness bench scale``: what the control plane costs as the job grows, on this machine,
with lightweight simulated members instead of trainers.

**Quorum** (``experiments.bench.sim_members``): for each number of replica groups N, the tree
quorum (``harness.quorum.tree``, Python) and torchft's Lighthouse (Rust) in the same run, each in
its own process, driven by the same simulated members (one gRPC connection each, the same
request bytes) from ``procs`` load processes. Each service first sees every member heartbeat
and answers one full round (so its previous quorum holds all N, as in a running job). Then:

* ``tree_ms`` / ``lighthouse_ms``: ``--reps`` rounds (default 5) in which every member asks for
  the next step's quorum at the same moment (a steady-state step: the fast quorum). ``p50``,
  ``p95``, ``max``: over all members of all rounds, the time from a member's request to its
  reply. ``after_last_ask``: the same from the round's last request (the moment the quorum
  became complete) to each reply: what the service adds once it has everything.
  ``ask_spread``: median over rounds of last request - first (what the load processes take to
  send N requests: a floor under ``p50`` that is not the service's). ``service_cpu_per_round``:
  CPU (user + system) of the service's process per round. ``reply_kb``: one reply's size (it
  lists every participant, so a round moves N times that).
* ``failover_ms``: one group fails, 3 times in a row (a different group each time); over the
  survivors, the time from the failure mark to their next quorum (``max``: every survivor has
  it). Tree: the survivors' requests are pending, the mark is ``replica_failed`` (the
  supervision tree saw the death). Lighthouse: it learns of a death only by the silence of the
  group's heartbeats, so the figure is its heartbeat timeout (``heartbeat_timeout_s``, default
  the harness's ``lighthouse_heartbeat_timeout``, 1 s) plus up to one quorum tick (100 ms) plus
  the reply. Every member heartbeats every quarter timeout (a Manager beats every 100 ms; 1024
  groups doing that would swamp this host) in a separate Lighthouse with that timeout; the
  survivors' requests are in, then the dead group's beats stop: the mark is when its last one
  left (the worst case, a group that dies just after a beat; a Manager's 100 ms interval takes
  ~50 ms off on average). If live members are dropped all the same (heartbeats not
  getting through in time: seen at 1024 groups here), it is measured again with a 5 times longer
  timeout; ``heartbeat_timeout_s`` says which (``retried_because``: what went wrong first),
  ``beat_gap_max_ms`` the longest the simulator let one member go between two beats, and
  ``{"error": why}`` is a figure not measured.

**Agents** (``experiments.bench.sim_agents``): a real controller, alone in its process, with H
simulated host agents (selectors loops in 2 processes) dialled in and beating every 1 s:
``controller_cpu`` (fraction of one core over a ``window_s`` window), ``missed_beats``,
``lost_hosts``, ``max_beat_gap_s``, ``threads``, ``rss_mb`` (module doc of sim_agents),
``agent_send_lag_max_ms`` (how late the simulator itself sent: the bound on these figures).

Not guaranteed: the figures are of this machine, whose 2 cores are shared by the services, the
load processes and anything else running; ``ask_spread`` and ``agent_send_lag_max_ms`` say how
much the simulators themselves cost. The last stdout line is the JSON object:
``{"quorum": [{"groups", "tree_ms", "lighthouse_ms", "failover_ms": {"tree",
"lighthouse"}}...], "agents": [{"hosts", "controller_cpu", "missed_beats", ...}...], ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dashboards.metrics import percentile
from experiments.bench.sim_agents import measure_agents
from experiments.bench.sim_members import Members, Reply, Service, quorum_members

Log = Callable[[str], None]


def _ms(xs: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(1000 * (percentile(xs, 50) or 0.0), 2),
        "p95": round(1000 * (percentile(xs, 95) or 0.0), 2),
        "max": round(1000 * max(xs), 2),
    }


def _check(replies: list[Reply], sample: bytes | None, expect: list[str], what: str) -> None:
    """Every member got the same reply, and it lists exactly the members expected."""
    bad = [r for r in replies if r.error is not None]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} members got no quorum ({bad[0].error})")
    if len(replies) != len(expect) or sample is None:
        raise RuntimeError(f"{what}: {len(replies)} replies for {len(expect)} members")
    if len({(r.size, r.digest) for r in replies}) != 1:
        raise RuntimeError(f"{what}: members got different quorums")
    _, ids = quorum_members(sample)
    if sorted(ids) != sorted(expect):
        raise RuntimeError(f"{what}: quorum of {len(ids)} members, expected {len(expect)}")


#: Heartbeat timeout of the services in the latency rounds: nothing goes stale there.
LONG_TIMEOUT_S = 600.0


@contextlib.contextmanager
def _session(
    kind: str, n: int, heartbeat_timeout_s: float, procs: int, first_round: bool = True
) -> Iterator[tuple[Service, Members]]:
    """A service with ``n`` connected members; with ``first_round``, all of them heartbeat
    and then got their first quorum (so the previous quorum holds all of them, as in a
    running job)."""
    service = Service(kind, n, heartbeat_timeout_s)
    members = None
    try:
        members = Members(service.address, service.ids, procs)
        if first_round:
            members.beat()  # every member connected and known: the first quorum waits for all
            members.start(1)
            _check(*members.collect(), members.ids, f"{kind} n={n} first quorum")
        yield service, members
    finally:
        if members is not None:
            members.close()
        service.close()


def _latency(service: Service, members: Members, rounds: int, steps: Iterator[int]) -> dict:
    own: list[float] = []
    after_last: list[float] = []
    spread: list[float] = []
    cpu0 = service.call("cpu")
    for _ in range(rounds):
        members.start(next(steps))
        replies, sample = members.collect()
        _check(replies, sample, members.ids, f"{service.kind} round")
        last_ask = max(r.asked for r in replies)
        own += [r.replied - r.asked for r in replies]
        after_last += [r.replied - last_ask for r in replies]
        spread.append(last_ask - min(r.asked for r in replies))
    cpu = service.call("cpu") - cpu0
    return {
        **_ms(own),
        "after_last_ask": _ms(after_last),
        "ask_spread": round(1000 * statistics.median(spread), 2),
        "service_cpu_per_round": round(1000 * cpu / rounds, 2),
        "reply_kb": round(replies[0].size / 1024, 1),
    }


def _failover(
    service: Service,
    members: Members,
    failovers: int,
    steps: Iterator[int],
) -> tuple[list[float], float | None]:
    """Fail one group at a time, ``failovers`` times; each survivor's time from the failure
    mark to its next quorum, and (Lighthouse) the longest gap between two heartbeats one
    member sent meanwhile."""
    n = len(members.ids)
    alive = list(range(n))
    dead_ones: list[int] = []
    out: list[float] = []
    gaps: list[float] = []
    for j in range(failovers):
        dead = alive.pop(0)
        if service.kind == "tree":
            members.start(next(steps), alive)
            pending = service.call("pending", len(alive), 60.0)
            if pending != len(alive):
                raise RuntimeError(f"tree n={n}: only {pending}/{len(alive)} asked")
            mark = service.call("fail", dead)
        else:
            # Everyone heartbeats (every quarter timeout: Managers beat every 100 ms, which
            # for 1024 groups would swamp this host) while the survivors' requests go in;
            # then the dead group's beats stop after one last beat, the mark.
            members.pulse(service.heartbeat_timeout_s / 4, silent=dead_ones)
            members.start(next(steps), alive)
            time.sleep(0.3 + 0.001 * n)  # the requests are in (the Lighthouse cannot say)
            dead_ones.append(dead)
            members.pulse(service.heartbeat_timeout_s / 4, silent=dead_ones)
            mark = members.beat([dead])
        replies, sample = members.collect()
        gap = members.pulse(0)
        what = f"{service.kind} failover {j}"
        if service.kind != "tree":
            gaps.append(gap)
            what += f" (each member beat at most {gap:.2f} s apart)"
        _check(replies, sample, [members.ids[r] for r in alive], what)
        if min(r.replied for r in replies) < mark:
            raise RuntimeError(f"{what}: the quorum came before the failure")
        out += [r.replied - mark for r in replies]
    return out, (max(gaps) if gaps else None)


def measure_quorum(
    kind: str,
    n: int,
    *,
    rounds: int,
    failovers: int,
    heartbeat_timeout_s: float,
    procs: int,
    log: Log,
) -> dict[str, Any]:
    """Quorum latency and failover of one service ``kind`` with ``n`` replica groups."""
    steps = itertools.count(2)
    failover: dict[str, Any]
    with _session(kind, n, LONG_TIMEOUT_S, procs) as (service, members):
        latency = _latency(service, members, rounds, steps)
        log(f"{kind} n={n}: quorum {latency}")
        if kind == "tree":
            failover = _ms(_failover(service, members, failovers, steps)[0])
    if kind != "tree":
        # Detection is the heartbeat timeout. No first round: with or without a previous
        # quorum holding the dead group, the rule waits for it until its heartbeat expires.
        # (A first round of 1024 groups would have to finish within the 1 s timeout.)
        failover = {}
        retried: list[str] = []
        for timeout_s in (heartbeat_timeout_s, 5 * heartbeat_timeout_s):
            try:
                with _session(kind, n, timeout_s, procs, first_round=False) as (service, members):
                    fo, gap = _failover(service, members, failovers, steps)
                failover = {**_ms(fo), "heartbeat_timeout_s": timeout_s}
                failover["beat_gap_max_ms"] = round(1000 * (gap or 0.0), 1)
                break
            except (RuntimeError, TimeoutError) as e:  # the rest of the run is worth having
                # Live members dropped: the heartbeats did not get through in time.
                log(f"{kind} n={n}: failover with a {timeout_s:g} s heartbeat timeout: {e}")
                retried.append(f"{timeout_s:g} s: {e}")
                failover = {"error": str(e)}
        if retried and "error" not in failover:
            failover["retried_because"] = retried
    log(f"{kind} n={n}: failover {failover}")
    return {"quorum_ms": latency, "failover_ms": failover}


SIZES = (8, 64, 256, 1024)
HOSTS = (16, 128, 512)
QUICK_SIZES = (8, 64)
QUICK_HOSTS = (16, 128)


def run(
    *,
    sizes: Sequence[int] = SIZES,
    hosts: Sequence[int] = HOSTS,
    rounds: int = 5,
    failovers: int = 3,
    heartbeat_timeout_s: float = 1.0,
    beat_interval_s: float = 1.0,
    window_s: float = 20.0,
    procs: int = 2,
    log: Log = lambda msg: None,
) -> dict[str, Any]:
    """Every figure of the bench (module doc) as the JSON-ready object it prints."""
    quorum = []
    for n in sizes:
        row: dict[str, Any] = {"groups": n}
        failover = {}
        for kind in ("tree", "lighthouse"):
            t0 = time.monotonic()
            r = measure_quorum(
                kind,
                n,
                rounds=rounds,
                failovers=failovers,
                heartbeat_timeout_s=heartbeat_timeout_s,
                procs=procs,
                log=log,
            )
            row[f"{kind}_ms"] = r["quorum_ms"]
            failover[kind] = r["failover_ms"]
            log(f"{kind} n={n}: {time.monotonic() - t0:.1f} s")
        row["failover_ms"] = failover
        quorum.append(row)
    agents = []
    for h in hosts:
        a = measure_agents(h, interval_s=beat_interval_s, window_s=window_s)
        log(f"agents: {a}")
        agents.append(a)
    out: dict[str, Any] = {"quorum": quorum, "agents": agents}
    out["settings"] = {
        "rounds": rounds,
        "failovers": failovers,
        "lighthouse_heartbeat_timeout_s": heartbeat_timeout_s,
        "agent_beat_interval_s": beat_interval_s,
        "agent_window_s": window_s,
        "load_procs": procs,
        "cpus": os.cpu_count(),
    }
    if len(quorum) > 1:
        first, last = quorum[0], quorum[-1]
        out["goals"] = {
            # tree quorum at the most groups vs the fewest (goal <= 2), and vs the Lighthouse
            # at the most groups (goal <= 1); p50 of the members' request -> quorum
            "tree_growth_p50": _ratio(last["tree_ms"]["p50"], first["tree_ms"]["p50"]),
            "tree_over_lighthouse_p50": _ratio(
                last["tree_ms"]["p50"], last["lighthouse_ms"]["p50"]
            ),
            "tree_over_lighthouse_max": _ratio(
                last["tree_ms"]["max"], last["lighthouse_ms"]["max"]
            ),
        }
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench scale] {msg}", file=sys.stderr, flush=True)

    result = run(
        sizes=QUICK_SIZES if args.quick else SIZES,
        hosts=QUICK_HOSTS if args.quick else HOSTS,
        rounds=args.reps or (3 if args.quick else 5),
        failovers=1 if args.quick else 3,
        window_s=5.0 if args.quick else 20.0,
        log=log,
    )
    print(json.dumps(result))
    return 0
