"""Who may take part in the quorum as a replica group of a user's own program: the rule the
quorum tap (``harness.quorum.tap``) applies, through
``harness.job.program.groups.ProgramGroups.admit``.

A program's Managers pick their own replica ids and know no secret, so a call is admitted by
*who makes it*: the group's rank-0 process, which the job started (its host agent forked it).
:func:`admit` finds the group a call claims to belong to; :func:`refusal` checks who makes it:

* **Rank 0's host agent runs on this machine** (:func:`host_is_local`: the agent's pid, as it
  reported it, holds the agent's end of its own connection to the controller; this holds for
  the local launcher, the netns test hosts and the SLURM test cluster, and cannot be faked by a
  process that does not hold that socket): the call's TCP connection must be held by rank 0's
  process or one of its descendants, and rank 0 must be a child of that agent
  (``runtime.peer_process``). Verified once per connection (tens of milliseconds: /proc
  reads), then re-checked per call with one ``readlink``. Any number of Manager ids per
  incarnation, all from that process.
* **On another machine** (the ``external`` launcher, a real SLURM cluster: its /proc cannot be
  read here), a fallback: the connection must come from the host's address
  (``HostAgentHandle.address``, a name resolved once per incarnation); only a quorum request
  (which names the group by its store) binds an id, so a heartbeat of an id not bound yet is
  refused; one Manager id per incarnation, the first one admitted (the caller enforces this
  under its lock).
  **Residual risk**: any process on that host (any user) that learns the group's store address
  (torch's TCPStore has no authentication and its port is visible) and asks for a quorum before
  the group's own Manager does is admitted as the group for that incarnation, with whatever
  step it claims (up to the job's last step): it can become the heal source of the other groups
  (torchft's HTTP transport unpickles what it sends). The group's own Manager is then refused,
  so the group fails (or is found hung after ``program.progress_timeout_s``) and is restarted
  as a new incarnation, which fences that id. A process on any other machine (the
  controller's included) is never admitted for that group.

A refusal is remembered per connection for :data:`REFUSAL_MEMORY_S` (a flood of calls on one
connection costs one look at /proc), and the slow look runs one at a time (:data:`_VERIFYING`:
a flood of new connections costs one thread, not all of the tap's).

Not guaranteed: a process the job started is trusted with everything (code it runs, a child it
starts); the rule says nothing about traffic between the tap and the quorum service or about
torchft's own servers (ManagerServer, checkpoint transport, stores), which take no credentials.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.quorum.tap import Admission
from runtime import peer_process

#: How long a connection refused by the rule stays refused without a new look at /proc.
REFUSAL_MEMORY_S = 1.0
#: One look at /proc at a time (the slow path, see the module doc).
_VERIFYING = threading.Lock()
#: Why a heartbeat of an id not bound yet is refused where the caller's process is not known.
_BIND_FIRST = "an unknown id, relayed or from another machine: it must ask for a quorum first"
#: Connections remembered per group incarnation (verified or refused) before forgetting all.
_MEMORY = 1024


@dataclass
class GroupAdmission:
    """What the rule knows of one incarnation of a group: whether its host is this machine
    (None: not known yet), the connections verified as its rank 0's (peer -> the sockets), and
    the connections refused lately (peer -> (monotonic time, reason))."""

    local: bool | None = None
    host_ips: frozenset[str] | None = None  # on another machine: the host's addresses
    verified: dict[str, tuple[peer_process.Holder, ...]] = field(default_factory=dict)
    refused: dict[str, tuple[float, str]] = field(default_factory=dict)

    def relayed(self, peer: str, agent: int) -> bool:
        """Whether ``peer``'s verified connection is held by the host agent (pid ``agent``)
        itself: its quorum relay's (``runtime.relay``), not rank 0's."""
        held = self.verified.get(peer)
        return bool(held) and all(h.pid == agent for h in held or ())


class Group(Protocol):
    """One incarnation of a program's replica group (``harness.job.program.groups._Group``)."""

    replica: int
    incarnation: int
    member_id: str  # its name at the quorum service ("": none)
    ids: set[str]  # its Managers' own ids, admitted so far
    procs: list[Any]  # its ranks' ``runtime.proc_handle.ProcRecord``s
    training: cf.Future
    admission: GroupAdmission


def admit(
    replica_id: str,
    peer: str,
    store_address: str | None,
    *,
    lock: threading.Lock,
    groups: Mapping[int, Group],
    by_store: Mapping[str, Group],
    stale_ids: Collection[str],
    tap: peer_process.Endpoint,
    spawn_timeout_s: float,
) -> Admission | str:
    """Whether the Manager calling itself ``replica_id`` on connection ``peer`` (gRPC's peer
    string) may take part: the admission of its group's current incarnation, or why not; binds
    the id to the group (``ids``) when admitted. ``groups``: the current incarnation of each
    group, ``by_store``: the same by store address, ``stale_ids``: the ids of replaced
    incarnations, all guarded by ``lock``; ``tap``: the tap's listening end.

    Which group: a quorum request names it by ``store_address`` (each incarnation has a store
    of its own); a heartbeat (``store_address`` None) by an id admitted before, or else by the
    process it comes from (:func:`refusal`). Always refused: an id of a replaced incarnation,
    an id of another group, a second id of an incarnation on another machine."""
    with lock:
        if replica_id in stale_ids:
            return f"{replica_id!r} belongs to a replaced incarnation of its replica group"
        current = list(groups.values())
        owner = next((g for g in current if replica_id in g.ids), None)
        if store_address is not None:
            g = by_store.get(store_address)
            if g is None:
                return f"{replica_id!r}: store {store_address!r} is no current replica group's"
            if owner is not None and owner is not g:
                return f"{replica_id!r} is a Manager of replica group {owner.replica}"
            candidates = [g]
        else:
            candidates = (
                [owner] if owner is not None else [g for g in current if not g.training.done()]
            )
    why = f"{replica_id!r}: no replica group of this job is running"
    for g in candidates:
        if not g.procs:
            why = f"replica group {g.replica} has not started yet"
            continue
        refused = refusal(
            g.admission,
            replica=g.replica,
            rank0=g.procs[0],
            peer=peer,
            tap=tap,
            binds=store_address is not None or owner is not None,
            spawn_timeout_s=spawn_timeout_s,
        )
        if refused is not None:
            why = refused
            continue
        with lock:
            if groups.get(g.replica) is not g:
                return f"replica group {g.replica} incarnation {g.incarnation} was replaced"
            relayed = g.admission.relayed(peer, g.procs[0].host.pid)
            if (not g.admission.local or relayed) and g.ids and replica_id not in g.ids:
                return (
                    f"replica group {g.replica} incarnation {g.incarnation} (relayed, or on "
                    f"another machine: one Manager id per incarnation) is {sorted(g.ids)[0]!r}"
                )
            g.ids.add(replica_id)
        return Admission(g.replica, g.incarnation, g.member_id)
    return why


def host_is_local(host: Any) -> bool | None:
    """Whether the host agent ``host`` (a ``runtime.host_handle.HostAgentHandle``) provably runs
    on this machine, in this pid namespace: its pid here holds its end of its own connection to
    the controller. (A pid reported from another machine names some unrelated process here, or
    none; it cannot hold that socket.) None: cannot tell now (the agent is not connected)."""
    conn = getattr(host, "conn", None)
    if conn is None or not host.pid:
        return None
    try:
        agent = peer_process.endpoint(conn.sock.getpeername())
        controller = peer_process.endpoint(conn.sock.getsockname())
    except (OSError, ValueError):
        return None
    return peer_process.holders(host.pid, agent, controller) is not None


def _addresses(host: str) -> frozenset[str]:
    """Every address ``host`` (an address or a name) stands for, normalized; empty if none."""
    try:
        return frozenset({peer_process.normal_ip(host)})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM) if host else []
    except OSError:
        return frozenset()
    return frozenset(peer_process.normal_ip(str(info[4][0])) for info in infos)


def refusal(
    state: GroupAdmission,
    *,
    replica: int,
    rank0: Any,
    peer: str,
    tap: peer_process.Endpoint,
    binds: bool,
    spawn_timeout_s: float,
) -> str | None:
    """Why the call from ``peer`` (gRPC's peer string) is not one of group ``replica``'s
    Managers, or None (see the module doc). ``rank0``: the group's rank-0 process record
    (``runtime.proc_handle.ProcRecord``); ``tap``: the tap's listening end; ``binds``: the call
    would bind its id (a quorum request, or an id bound before); ``spawn_timeout_s``: how long to
    wait for rank 0's pid. The caller checks the one-id-per-incarnation fallback itself."""
    client = peer_process.parse_peer(peer)
    if client is None:
        return f"{peer}: not a TCP connection"
    host = rank0.host
    if state.local is None:
        state.local = host_is_local(host)
        if state.local is None:
            return f"replica group {replica}'s host agent is not connected"
    if not state.local:
        if state.host_ips is None:
            state.host_ips = _addresses(host.address)
        if client.ip not in state.host_ips:
            return f"{peer} is not replica group {replica}'s host ({host.address or '?'})"
        if not binds:
            return _BIND_FIRST
        return None
    held = state.verified.get(peer)
    if held is not None and peer_process.still_held(held):
        return None if binds or not state.relayed(peer, host.pid) else _BIND_FIRST
    refused = state.refused.get(peer)
    if refused is not None and time.monotonic() - refused[0] < REFUSAL_MEMORY_S:
        return refused[1]
    try:
        pid = rank0.ready.result(timeout=spawn_timeout_s)
    except Exception:  # a program that did not start has no connections
        pid = None
    with _VERIFYING:
        if not pid or not peer_process.descends_from(pid, host.pid):
            held, why = None, f"replica group {replica}'s rank 0 is no process of its host agent"
        else:
            held = peer_process.holders(pid, client, tap)
            why = (
                f"the connection from {client.ip}:{client.port} is not held by replica group "
                f"{replica}'s rank 0 (pid {pid}) or a process it started: not a Manager this "
                "job started"
            )
            # or its host agent's relay, which vouches for it (runtime.relay.from_this_tree).
            # The agent holds its end of every connection it relays, and a worker it has just
            # forked holds copies of them until it closes them (runtime.relay): a connection
            # the agent holds is the relay's, whoever else has a copy. (Taken for rank 0's own,
            # a copy in another group's fresh rank 0 bound a relayed Manager to that group.)
            if held is not None:
                held = peer_process.held_by(host.pid, held) or held
            else:
                relay = peer_process.holders(host.pid, client, tap)
                if relay and all(h.pid == host.pid for h in relay):
                    held = relay
    memo: dict[str, Any] = state.verified if held is not None else state.refused
    if len(memo) > _MEMORY:
        memo.clear()
    memo[peer] = held if held is not None else (time.monotonic(), why)
    if held is not None and not binds and state.relayed(peer, host.pid):
        return _BIND_FIRST
    return None if held is not None else why
