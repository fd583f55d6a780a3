"""torchft glue: the Lighthouse, each replica group's store, and each rank's Manager.

This is the one module of the harness that imports torchft (besides ``harness/rank/transport.py``,
the "dataplane" checkpoint transport, named in :data:`TRANSPORTS`).

Roles (torchft's, unchanged):

* The **Lighthouse** (one per job) computes each step's quorum: the replica groups that heartbeat
  and asked to join. A group that stops heartbeating for ``lighthouse_heartbeat_timeout`` is
  dropped, so survivors stall at most about that long after a group dies.
* A **Manager** (one per rank) runs the per-step commit protocol: ``start_quorum`` (join the
  quorum, reconfigure the cross-group process group, heal from a peer if behind),
  ``allreduce`` (average gradients across participating groups), ``should_commit`` (every rank
  of the group agrees the step was clean). Rank 0 of a group also runs the group's ManagerServer,
  which talks to the Lighthouse.
* Each replica group has its **own TCPStore**, on a free port of its host, served by a process of
  the host agent's (``runtime.group_store``), as torchrun's agent serves it.

Addresses. Every address a rank gives a peer is its host's advertised address
(``runtime.actor.host_address()``, chosen by the host agent: ``runtime.netaddr``), never the
machine's hostname, which on real clusters often resolves to loopback or to another network.
torchft advertises ``socket.gethostname()`` in three places, each overridden here: the process
group's rendezvous store (:class:`ProcessGroupGloo`), the ManagerServer's address (the Manager's
``hostname``) and the HTTP checkpoint server's (:class:`HTTPAddressTransport`). A user's own
torchft program gets the same through ``harness/rank/program_site``.

Listeners. The Lighthouse listens on ``bind_host`` only, each group's TCPStore on its host's
advertised address only (torch's TCPStore server binds every interface unless handed a bound
socket: ``runtime.group_store.bound_store`` hands it one), each rank's process-group
rendezvous store on its host's advertised address only (:class:`ProcessGroupGloo`). Two
listeners of torchft's cannot be told an address, and listen on every interface (``[::]``,
dual-stack) whatever ``bind_host`` says;
``tests/integration/test_listeners.py`` lists them and checks that nothing else does:

* the **ManagerServer** of each group's rank 0: ``torchft.manager.Manager`` binds
  ``f"[::]:{port}"``; only the port is configurable (``TORCHFT_MANAGER_PORT``);
* the **HTTP checkpoint server** of every rank (``transport = "torchft_http"`` only):
  ``HTTPTransport`` binds ``("", 0)`` and takes no address.

Trust. Nothing torchft serves is authenticated. torchft's Lighthouse (Rust) admits any
``replica_id`` that reaches its port (``recovery.quorum = "tree"`` admits only members the job
started: ``harness.quorum.tree``); a member of the quorum can name itself the heal source, and
torchft's own transports unpickle what it sends (``HTTPTransport`` loads with
``torch.load(weights_only=False)``, ``PGTransport`` ``pickle.loads`` its metadata): code
execution in the healing trainer. The ``"dataplane"`` transport decodes without unpickling
(``harness.rank.transport``). Run jobs on a private network, or use the tree quorum and the
dataplane transport.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import secrets
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, TCPStore
from torchft import Manager
from torchft import ProcessGroupGloo as _TorchftProcessGroupGloo
from torchft._torchft import LighthouseServer
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.checkpointing.transport import CheckpointTransport

from harness.config import JobConfig, TimeoutConfig
from harness.rank.healing import OneHealSource, SlowServe
from harness.rank.transport import make_dataplane_transport
from runtime.actor import host_address
from runtime.group_store import bound_store
from runtime.relay import RELAY_ENV


class ProcessGroupGloo(_TorchftProcessGroupGloo):
    """torchft's reconfigurable gloo process group, rendezvousing where no earlier one did.

    torchft rendezvouses every reconfiguration on the first member's store under the prefix
    ``torchft/<quorum id>``, and the keys of earlier rendezvous stay there. torchft's Lighthouse
    numbers its quorums from 1 again after a restart, so a later quorum can reuse a prefix whose
    keys name listeners that closed long ago: gloo's connectFullMesh reads a stale peer address,
    is refused, and the group stalls for its connect timeout (seen in CI: a Lighthouse crash left
    one group out for 15 s, ``tests/e2e/test_fault_kinds.py``).

    Here each member's handle carries a nonce that it renews every time it reconfigures, and the
    communicator id is a digest of the quorum id and all handles. Every member computes the same
    id from the same quorum, and no two rendezvous on a store share one: whoever wrote keys under
    an id has renewed its nonce since, so the id cannot recur. torchft's Lighthouse compares only
    replica ids to decide whether a quorum changed, so a renewed nonce triggers no reconfiguration.

    And the rendezvous store (the first member's hosts each reconfiguration) listens on
    ``address``, this host's advertised address, and the handle names it there. torchft's own
    creates it at ``socket.gethostname()`` and advertises that name: where it resolves to
    loopback (Debian's ``127.0.1.1``), every other host's members dial themselves and each
    reconfiguration times out (``tests/e2e/test_addresses.py``).
    """

    def __init__(self, timeout: timedelta, address: str = "127.0.0.1") -> None:
        super().__init__(timeout=timeout)
        self._nonce = secrets.token_hex(8)
        self.address = address

    def get_reconfigure_handle(self) -> str:
        store: TCPStore | None = self._rendezvous_store  # type: ignore[has-type]
        if store is None:  # torchft's default timeout: torch's (the store only serves)
            store = self._rendezvous_store = bound_store(self.address, None)
        handle = {
            "id": self._handle_id(),
            "store": f"{_url_host(self.address)}:{store.port}",
            "global_rank": self._global_rank,
            "nonce": self._nonce,
        }
        return json.dumps(handle, sort_keys=True)

    def reconfigure(self, opts: Any) -> Any:
        opts.uuid = communicator_id(opts.uuid, list(opts.handles))
        self._nonce = secrets.token_hex(8)
        gone = gone_members(list(opts.handles), own=self._handle_id())
        if gone:
            # torch's store client retries a refused connect until its timeout (x3 tries) and
            # gloo waits as long for a peer that never writes its address: ~2 process-group
            # timeouts for every group of a quorum that a member died just after (seen: 10 s
            # of stall for every group after a heal source was killed mid-heal)
            raise MemberGone(f"members of this quorum are gone (their stores refuse): {gone}")
        return super().reconfigure(opts)


class MemberGone(RuntimeError):
    """A member of the quorum being configured is dead: its rendezvous store refuses."""


#: How long a probe of a member's rendezvous store may take (a dead process's port refuses at
#: once; a probe that times out, a host gone quiet, is left to torch's own timeout).
PROBE_TIMEOUT_S = 1.0


def gone_members(handles: list[str], own: str | None = None) -> list[str]:
    """The stores (``host:port``) named by ``handles`` whose connect is refused: their members'
    processes are gone (each member serves its own, ``ProcessGroupGloo``). ``own``: this
    member's handle id, not probed."""
    out = []
    for raw in handles:
        handle = json.loads(raw)
        if handle.get("id") == own:
            continue
        host, _, port = str(handle["store"]).rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
        except ConnectionRefusedError:
            out.append(str(handle["store"]))
        except OSError:
            continue  # unreachable or slow: torch's own timeout decides
    return out


def communicator_id(quorum_id: int, handles: list[str]) -> int:
    """A positive 62-bit id for the rendezvous of ``handles`` (ordered) in quorum ``quorum_id``."""
    digest = hashlib.sha256(json.dumps([quorum_id, handles]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


#: ``factory(pg, timeout, state_dict_fn) -> CheckpointTransport``; ``pg`` is the rank's
#: cross-group process group, ``state_dict_fn`` returns the state a healing peer needs.
TransportFactory = Callable[[ProcessGroupGloo, timedelta, Callable[[], Any]], CheckpointTransport]


class HTTPAddressTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, naming its server by this host's advertised address
    (torchft's names it ``socket.gethostname()``, which a healing peer may resolve to itself)."""

    def __init__(self, advertise: str, timeout: timedelta) -> None:
        self._advertise = advertise  # first: torchft's __init__ logs address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{_url_host(self._advertise)}:{port}/checkpoint/"


def http_transport(pg: ProcessGroupGloo, timeout: timedelta, sd: Callable[[], Any]) -> Any:
    return HTTPAddressTransport(pg.address, timeout)


def pg_transport(pg: ProcessGroupGloo, timeout: timedelta, sd: Callable[[], Any]) -> Any:
    return PGTransport(pg, timeout=timeout, device=torch.device("cpu"), state_dict=sd)


#: Checkpoint transports by the config's ``transport`` name: the factories themselves, so a
#: reader finds them. A table rather than registration on import: no module has to import this
#: one to add itself (importing the data plane's costs nothing here: torch, torchft and
#: ``runtime.dataplane`` are loaded already).
TRANSPORTS: dict[str, TransportFactory] = {
    "torchft_http": http_transport,
    "torchft_pg": pg_transport,
    "dataplane": make_dataplane_transport,
}


def transport_names() -> list[str]:
    return sorted(TRANSPORTS)


def transport_factory(name: str) -> TransportFactory:
    """The factory of transport ``name``; ValueError naming the known ones."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(transport_names())}")
    return TRANSPORTS[name]


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class Lighthouse:
    """torchft's Lighthouse server bound to ``bind_host`` on a free port; stop with
    :meth:`shutdown`. ``address`` is the ``http://host:port`` that Managers need."""

    def __init__(
        self, *, bind_host: str, min_replicas: int, timeouts: TimeoutConfig, port: int = 0
    ) -> None:
        # ``port``: 0 picks a free one; a restarted Lighthouse passes its old port so the
        # Managers' address stays valid.
        self._server = LighthouseServer(
            bind=f"{bind_host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=int(timeouts.lighthouse_join_timeout * 1000),
            heartbeat_timeout_ms=int(timeouts.lighthouse_heartbeat_timeout * 1000),
        )
        # The server reports the machine's hostname; advertise the address it is bound to.
        port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://{bind_host}:{port}"

    @classmethod
    def for_job(cls, cfg: JobConfig) -> Lighthouse:
        return cls(
            bind_host=cfg.bind_host, min_replicas=cfg.min_replica_size, timeouts=cfg.timeouts
        )

    def shutdown(self) -> None:
        self._server.shutdown()


def host_store(bind_host: str, timeouts: TimeoutConfig) -> tuple[TCPStore, str]:
    """Start a replica group's TCPStore on a free port of ``bind_host``; returns it (keep it
    alive as long as the group runs) and its ``host:port`` for the group's other ranks."""
    store = bound_store(bind_host, _s(timeouts.connect_timeout))
    return store, f"{bind_host}:{store.port}"


def _url_host(address: str) -> str:
    """``address`` as the host part of ``host:port`` (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address else address


def make_manager(
    cfg: JobConfig,
    *,
    replica_id: int,
    rank: int,
    store_addr: str,
    lighthouse_addr: str,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], None],
    member_id: str | None = None,
    quorum_retries: int = 0,
) -> tuple[Manager, ProcessGroupGloo]:
    """torchft's Manager for ``rank`` of replica group ``replica_id``, with its reconfigurable
    gloo process group (returned too, so a fault hook can abort it). ``member_id``: the
    ``replica_id`` the Manager gives the quorum service (the tree quorum admits only the ids it
    handed out, ``TreeQuorum.admit``); None: ``replica_{replica_id}``, for torchft's Lighthouse.

    The quorum is synchronous (``use_async_quorum=False``): ``start_quorum`` returns only once the
    group has joined and, if it was behind, loaded a peer's state. A replacement therefore trains
    its first step on healed weights and the healed data position, and every committed step's
    batch was really trained by every participant. Initial weights are identical by seed, so the
    step-0 sync is skipped (``init_sync=False``); a group that joins late still heals.
    """
    t = cfg.timeouts
    factory = transport_factory(cfg.transport)
    # Where this rank's peers reach it (its rendezvous store, ManagerServer and HTTP checkpoint
    # server): its host's advertised address (the controller's bind address without an agent).
    address = host_address(cfg.bind_host)
    pg = ProcessGroupGloo(timeout=_s(t.process_group_timeout), address=address)
    transport = SlowServe(factory(pg, _s(t.manager_timeout), state_dict))
    host, port = store_addr.rsplit(":", 1)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.min_replica_size,
        use_async_quorum=False,
        timeout=_s(t.manager_timeout),
        quorum_timeout=_s(t.quorum_timeout),
        connect_timeout=_s(t.connect_timeout),
        rank=rank,
        world_size=cfg.ranks,
        store_addr=host,
        store_port=int(port),
        # Through this host's quorum relay where its agent runs one (runtime.relay): a Manager
        # keeps its Lighthouse address for life, and after a takeover on another node the
        # quorum service serves elsewhere; the relay follows it, this address would not.
        lighthouse_addr=os.environ.get(RELAY_ENV) or lighthouse_addr,
        replica_id=member_id or f"replica_{replica_id}",
        # Where the other groups reach this rank's ManagerServer (and heal from it).
        hostname=address,
        # Four beats per timeout, so a live group is never dropped. Not more: each beat is an
        # RPC the quorum service serves (the tree quorum's Python gRPC: ~0.5 ms of CPU each).
        heartbeat_interval=_s(t.lighthouse_heartbeat_timeout / 4),
        checkpoint_transport=transport,
        init_sync=False,
        # Nonzero when the quorum service may restart under the Manager (its controller taken
        # over: harness.job.takeover): torchft's ManagerServer then reconnects and asks again
        # every quorum_timeout / (retries + 1), instead of failing the request on the dead
        # service's connection (the trainer's own call still gives up after quorum_timeout).
        quorum_retries=quorum_retries,
    )
    store = None
    if cfg.ranks > 1:
        prefix = f"harness/heal/{member_id or replica_id}"
        store = PrefixStore(prefix, TCPStore(host, int(port), is_master=False))
    manager._client = OneHealSource(
        manager._client, store, rank, _s(t.manager_timeout), world=cfg.ranks
    )
    return manager, pg


def close_communicator(pg: ProcessGroupGloo, failure: BaseException | None = None) -> None:
    """Destroy this rank's cross-group gloo communicator now that a collective on it failed, so
    every connection it holds closes at once. The next quorum reconfigures a fresh one.

    Why: when a group dies mid-allreduce, only the ranks that were exchanging with it fail at
    once. A survivor that was waiting on *this* rank (gloo's ring passes data survivor to
    survivor) stays blocked in its receive until ``process_group_timeout``, and the quorum waits
    for it. gloo has no call that closes a context's connections: ``abort()`` and ``shutdown()``
    leave them open (measured, three processes: the blocked peer still timed out), and only
    destroying the context closes them. The context lives as long as the process group *or any
    work object from it* is referenced, and ``failure``'s traceback reaches the failed work
    through the frames it passed (torchft records the exception in its Manager). So: drop that
    traceback, drop the process group, and collect the reference cycles that remain.
    """
    if failure is not None:
        failure.__traceback__ = None
        failure.__context__ = None
    pg.abort(errored=False)  # torchft's wrapper forgets its gloo process group
    gc.collect()


def forget_failed_quorum(manager: Manager) -> None:
    """Make a Manager whose ``start_quorum`` failed ask afresh next time.

    torchft re-raises a failed quorum future on the next ``start_quorum``: drop it. And a
    restarted quorum service numbers its quorums from 1 again, which can equal the id this
    Manager holds: forget it, so the next quorum always rebuilds the communicator (otherwise
    groups that skip the rebuild and groups that do not hang each other). These are torchft
    private attributes (torchft-nightly 2026.10.26); this is the one place that touches them.
    """
    manager._quorum_future = None
    manager._quorum_id = -1
