"""Who may call the tree quorum service at all: the connection, not the id (issue #49).

The tree quorum admits a Manager by its tagged replica id (``harness.quorum.rule``), and the
built-in trainer's tag sits in its group's TCPStore, which any local user could read (the store
now admits the job's user only, where it can: ``runtime.group_store``): a stranger who read it
and called the service directly was answered as the group. But with the tree quorum
no one of the job calls the service directly: every Manager, and every program's through the
tap, reaches it through its host agent's quorum relay (``runtime.relay``,
``harness.job.site.wants_quorum_relay``), and the tap runs in the controller. So a call is let
in only if its TCP connection is held:

* by this process (the controller: a program's quorum tap forwarding to the service), or
* by a host agent that provably runs on this machine (``program_admission.host_is_local``: the
  local launcher, the netns test hosts, the SLURM test cluster), or one of its descendants: its
  relay (``runtime.peer_process.holders``, read from ``/proc`` through the agent's pid, so
  across network namespaces too);
* from another machine's agent (``external``, a real SLURM cluster: its ``/proc`` cannot be read
  here), a fallback: the connection must come from one of those agents' addresses.

A verified connection is re-checked per call with one ``readlink``
(``peer_process.Holder.still_holds``); a refusal is remembered for
:data:`program_admission.REFUSAL_MEMORY_S`; the slow look runs one at a time. What stays
open: on another machine, any process of a host that runs one of the job's agents; and the tag
itself still travels in clear between a Manager and its relay (loopback).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from harness.job.program.admission import REFUSAL_MEMORY_S, _addresses, host_is_local
from runtime import peer_process
from runtime.relay import parse_address

log = logging.getLogger(__name__)

#: Connections remembered (verified or refused) before forgetting them all.
_MEMORY = 4096


class QuorumCallers:
    """The rule above, for the service listening at ``server()`` (``http://host:port``, asked
    per look: a restarted service moves); ``hosts()``: the job's host agents now
    (``runtime.host_handle.HostAgentHandle``)."""

    def __init__(self, hosts: Callable[[], Iterable[Any]], server: Callable[[], str]) -> None:
        self._hosts = hosts
        self._server = server
        self._lock = threading.Lock()
        self._verifying = threading.Lock()
        self._verified: dict[str, tuple[peer_process.Holder, ...] | None] = {}
        self._refused: dict[str, tuple[float, str]] = {}
        self._local: dict[tuple[str, int], bool] = {}  # (host, pid): runs on this machine

    def refusal(self, peer: str) -> str | None:
        """Why the caller on connection ``peer`` (gRPC's peer string) may not call, or None."""
        with self._lock:
            if peer in self._verified:
                held = self._verified[peer]
                if held is None or peer_process.still_held(held):  # None: a remote agent's
                    return None
                del self._verified[peer]
            refused = self._refused.get(peer)
            if refused is not None and time.monotonic() - refused[0] < REFUSAL_MEMORY_S:
                return refused[1]
        with self._verifying:  # a flood of new connections costs one thread
            held, why = self._look(peer)
        with self._lock:
            if len(self._verified) + len(self._refused) > _MEMORY:
                self._verified.clear()
                self._refused.clear()
            if why is None:
                self._verified[peer] = held
            else:
                self._refused[peer] = (time.monotonic(), why)
        if why is not None:
            log.warning("tree quorum: refused %s", why)  # once per look, not per call
        return why

    def _look(self, peer: str) -> tuple[tuple[peer_process.Holder, ...] | None, str | None]:
        client = peer_process.parse_peer(peer)
        try:
            listening = parse_address(self._server())
        except ValueError:
            listening = None
        if client is None or listening is None:
            return None, f"a connection from {peer!r}: not a TCP peer"
        server = peer_process.server_endpoint(*listening)
        roots, remote = [os.getpid()], []
        for h in list(self._hosts()):
            key = (getattr(h, "name", ""), int(getattr(h, "pid", 0) or 0))
            local = self._local.get(key)
            if local is None:
                local = host_is_local(h)
                if local is not None:
                    self._local[key] = local
            if local:
                roots.append(key[1])
            elif local is False:
                remote.append(h)
        for root in roots:
            held = peer_process.holders(root, client, server)
            if held:
                return held, None
        for h in remote:
            if client.ip in _addresses(getattr(h, "address", "")):
                return None, None
        return None, (
            f"a connection from {peer} held by no process of this job (the Managers reach the "
            "quorum through their host agent's relay)"
        )
