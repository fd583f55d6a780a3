"""Simulated torchft quorum members against a quorum service, for ``ftharness bench scale``.

A simulated member is what a torchft Manager's ManagerServer is to the quorum service and
nothing more: it heartbeats and asks for quorums with a ``QuorumMember`` (replica id with the
job's tag and a uuid, as a Manager sends it; addresses; step; world size) over gRPC, one
connection per member. Requests are the raw protobuf bytes of ``harness.quorum.tree``'s codec,
so torchft's Lighthouse and the tree quorum receive the very same bytes.

Processes (so that the service, the load and the measurement do not share a GIL):

* the **service** process hosts one quorum service (:func:`serve`): the tree quorum
  (``harness.quorum.tree.TreeQuorum``) or torchft's Lighthouse (``LighthouseServer``, Rust);
* ``procs`` **load** processes (:func:`load`) each hold a share of the members, one gRPC channel
  (connection) each, and fire their requests as non-blocking calls from one thread; a reply's
  time is taken first thing in its completion callback.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC), comparable across the processes of one host.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

QUORUM = "/torchft.LighthouseService/Quorum"
HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
CALL_TIMEOUT_S = 120.0
_CTX = mp.get_context("spawn")


def member_bytes(replica_id: str, replica: int, step: int) -> bytes:
    """A Manager's ``QuorumMember``: replica_id 1, address 2, store_address 3, step 4,
    world_size 5 (the field numbers of ``harness.quorum.tree``)."""
    from harness.quorum.wire import encode_field

    return (
        encode_field(1, replica_id.encode())
        + encode_field(2, f"http://127.0.0.1:{20000 + replica}".encode())
        + encode_field(3, f"127.0.0.1:{40000 + replica}/torchft/{replica}".encode())
        + encode_field(4, step)
        + encode_field(5, 1)
    )


# --- the service process -------------------------------------------------------------------------


def serve(kind: str, n: int, heartbeat_timeout_s: float, conn: Connection) -> None:
    """Host a quorum service for ``n`` replica groups; answer commands on ``conn`` until
    ``("stop",)``. First sends ``(address, [replica_id per group])``: the tree quorum's ids are
    the ones it admits; the Lighthouse's have the same form and length (it admits anyone)."""
    import psutil

    from harness.quorum.rule import member_id

    # torchft's Lighthouse logs every request and every quorum in full on stderr: keep them off
    # the bench's output (writing them still costs what it costs in a job).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)

    tree: Any = None
    lighthouse: Any = None
    if kind == "tree":
        from harness.quorum.tree import TreeQuorum

        # Every waiting quorum request holds one of the server's threads.
        tree = TreeQuorum(
            min_replicas=1,
            join_timeout_s=60.0,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_requests=2 * n + 64,
        )
        ids = [tree.admit(r) for r in range(n)]
        address = tree.address
    else:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=60_000,
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
        secret = os.urandom(32)
        ids = [member_id(secret, r, 0) for r in range(n)]
    conn.send((address, ids))
    me = psutil.Process()
    while True:
        cmd, *args = conn.recv()
        if cmd == "pending":  # wait until this many requests are pending (tree only)
            count, timeout_s = args
            deadline = time.monotonic() + timeout_s
            while len(tree.status()["participants"]) < count and time.monotonic() < deadline:
                time.sleep(0.002)
            conn.send(len(tree.status()["participants"]))
        elif cmd == "fail":  # the supervision tree saw group ``replica`` die
            t = time.monotonic()
            tree.replica_failed(args[0])
            conn.send(t)
        elif cmd == "cpu":
            c = me.cpu_times()
            conn.send(c.user + c.system)
        elif cmd == "stop":
            if tree is not None:
                tree.shutdown()
            else:
                lighthouse.shutdown()
            conn.send(None)
            return


# --- the load processes --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One member's call: when it asked, when the reply (or error) came, and what came."""

    replica: int
    asked: float
    replied: float
    error: str | None
    size: int
    digest: int


def load(address: str, members: Sequence[tuple[int, str]], conn: Connection) -> None:
    """Hold ``members`` ((replica, replica_id) each), one gRPC channel each, on one asyncio
    loop, and run commands from ``conn``: ``("beat", replicas)`` heartbeats them and answers
    when the beats were sent (once all are answered); ``("ask", t0, step, replicas)`` sends each
    one's quorum request at ``t0`` (answers at once); ``("collect",)`` answers the asked calls'
    :class:`Reply` list and one reply's bytes once all have ended; ``("pulse", period_s,
    silent)`` heartbeats every member but ``silent`` every ``period_s`` in the background (0:
    stop). ``replicas`` None: all of this process's."""
    import asyncio

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="members", daemon=True).start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    sim = run(_Sim.open(address, dict(members)))
    conn.send("ready")
    pending: Any = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            run(sim.close())
            conn.send(None)
            return
        if cmd == "beat":
            conn.send(run(sim.beat(sim.which(args[0]))))
        elif cmd == "ask":
            t0, step, replicas = args
            pending = asyncio.run_coroutine_threadsafe(sim.ask(sim.which(replicas), t0, step), loop)
            conn.send(None)
        elif cmd == "collect":
            conn.send(pending.result())
        elif cmd == "pulse":
            period_s, silent = args
            conn.send(run(sim.pulse(period_s, set(silent))))


class _Sim:
    """The members of one load process (on its asyncio loop)."""

    def __init__(self, address: str, ids: dict[int, str]) -> None:
        from grpc import aio

        target = address.removeprefix("http://")
        options = [
            # One connection per member, as separate Managers have (else gRPC shares one).
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", 256 << 20),
        ]
        self.ids = ids
        self.channels = {r: aio.insecure_channel(target, options=options) for r in ids}
        self.quorum = {r: ch.unary_unary(QUORUM) for r, ch in self.channels.items()}
        self.heartbeat = {r: ch.unary_unary(HEARTBEAT) for r, ch in self.channels.items()}
        self._pulse: list[Any] = []
        self._pulse_gap = 0.0

    @classmethod
    async def open(cls, address: str, ids: dict[int, str]) -> _Sim:
        return cls(address, ids)

    def which(self, replicas: Sequence[int] | None) -> list[int]:
        return list(self.ids) if replicas is None else [r for r in replicas if r in self.ids]

    async def pulse(self, period_s: float, silent: set[int]) -> float:
        """Heartbeat every member but ``silent`` every ``period_s`` in the background, each on
        its own, as Managers do (a slow beat delays only that member's next one), instead of
        any pulse before (0: none). Returns once each has beaten once; when stopping, the
        longest time between two beats one member sent (beyond the period: this process was
        too slow)."""
        import asyncio

        for task in self._pulse:
            task.cancel()
        self._pulse = []
        if period_s <= 0:
            return self._pulse_gap
        self._pulse_gap = 0.0
        which = [r for r in self.ids if r not in silent]
        await self.beat(which)  # all known to the service before anything else happens

        async def beat_forever(r: int) -> None:
            sent = time.monotonic()
            while True:
                await asyncio.sleep(max(0.0, sent + period_s - time.monotonic()))
                now = time.monotonic()
                self._pulse_gap = max(self._pulse_gap, now - sent)
                sent = now
                await self.beat([r])

        loop = asyncio.get_running_loop()
        self._pulse = [loop.create_task(beat_forever(r)) for r in which]
        return 0.0

    async def close(self) -> None:
        await self.pulse(0, set())
        for ch in self.channels.values():
            await ch.close()

    async def beat(self, which: list[int]) -> tuple[float | None, list[str]]:
        import asyncio

        import grpc

        async def one(r: int) -> str | None:
            try:
                await self.heartbeat[r](encode_heartbeat(self.ids[r]), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                return str(e.code())
            return None

        sent = time.monotonic()
        errors = await asyncio.gather(*(one(r) for r in which))
        return (sent if which else None), [e for e in errors if e is not None]

    async def ask(self, which: list[int], t0: float, step: int) -> tuple[list[Reply], bytes | None]:
        import asyncio

        import grpc

        from harness.quorum.wire import encode_field

        requests = [(r, encode_field(1, member_bytes(self.ids[r], r, step))) for r in which]
        sample: list[bytes] = []

        async def one(r: int, req: bytes) -> Reply:
            asked = time.monotonic()
            try:
                body = await self.quorum[r](req, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                return Reply(r, asked, time.monotonic(), str(e.code()), 0, 0)
            replied = time.monotonic()
            if not sample:
                sample.append(body)
            return Reply(r, asked, replied, None, len(body), digest(body))

        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        replies = await asyncio.gather(*(one(r, req) for r, req in requests))
        return sorted(replies, key=lambda x: x.replica), (sample[0] if sample else None)


def digest(reply: bytes) -> int:
    """What tells two replies apart cheaply: the quorum id leads a reply and its creation time
    ends it. (A CRC of every byte would cost the load process more than the service spends per
    reply at 1024 groups, and delay the replies behind it.)"""
    return zlib.crc32(reply[:64] + reply[-64:])


def encode_heartbeat(replica_id: str) -> bytes:
    from harness.quorum.wire import encode_field

    return encode_field(1, replica_id.encode())


class Members:
    """``n`` simulated members spread over ``procs`` load processes (round robin)."""

    def __init__(self, address: str, ids: Sequence[str], procs: int) -> None:
        # torchft's Manager appends ":{uuid4}" to the replica_id it was given.
        full = [f"{rid}:{uuid.uuid4()}" for rid in ids]
        self.ids = full
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for p in range(procs):
            mine = [(r, full[r]) for r in range(p, len(full), procs)]
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=load, args=(address, mine, child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for c in self._conns:
            recv_within(c, 120.0)

    def beat(self, replicas: Sequence[int] | None = None) -> float:
        """Heartbeat these members (None: all); returns once all are answered, the time the
        beats were sent (the service saw each after that)."""
        answers = self._all(("beat", None if replicas is None else list(replicas)))
        errors = [e for _, errs in answers for e in errs]
        if errors:
            raise RuntimeError(f"heartbeats refused: {errors[:3]}")
        return min(t for t, _ in answers if t is not None)

    def pulse(self, period_s: float, silent: Sequence[int] = ()) -> float:
        """Every member but ``silent`` heartbeats every ``period_s`` from now on (0: none);
        returns once each has beaten once. Stopping returns the longest time between two
        beats of one member the load processes managed (``_Sim.pulse``)."""
        return max(self._all(("pulse", period_s, list(silent))))

    def _all(self, cmd: tuple) -> list[Any]:
        for c in self._conns:
            c.send(cmd)
        return [recv_within(c, CALL_TIMEOUT_S + 30) for c in self._conns]

    def start(
        self, step: int, replicas: Sequence[int] | None = None, delay_s: float = 0.05
    ) -> None:
        """Every member named asks for the quorum of ``step`` at the same moment; returns at
        once (:meth:`collect` waits for the replies)."""
        t0 = time.monotonic() + delay_s
        for c in self._conns:
            c.send(("ask", t0, step, None if replicas is None else list(replicas)))
        for c in self._conns:
            recv_within(c, 30.0)

    def collect(self) -> tuple[list[Reply], bytes | None]:
        replies: list[Reply] = []
        sample = None
        for c in self._conns:
            c.send(("collect",))
        for c in self._conns:
            got, body = recv_within(c, CALL_TIMEOUT_S + 30)
            replies.extend(got)
            sample = sample or body
        return sorted(replies, key=lambda x: x.replica), sample

    def close(self) -> None:
        for c in self._conns:
            with contextlib.suppress(OSError, EOFError):
                c.send(("stop",))
                recv_within(c, 10.0)
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def recv_within(conn: Connection, timeout_s: float) -> Any:
    """The next message on a pipe to a load process, or TimeoutError after ``timeout_s``."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s} s")
    return conn.recv()


class Service:
    """A quorum service of ``kind`` ("tree" or "lighthouse") in its own process."""

    def __init__(self, kind: str, n: int, heartbeat_timeout_s: float) -> None:
        self.kind = kind
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(
            target=serve, args=(kind, n, heartbeat_timeout_s, child), daemon=True
        )
        self._proc.start()
        child.close()
        self.address, self.ids = recv_within(self._conn, 120.0)

    def call(self, *cmd: Any, timeout_s: float = 120.0) -> Any:
        self._conn.send(cmd)
        return recv_within(self._conn, timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError, TimeoutError):
            self.call("stop", timeout_s=20.0)
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()


def quorum_members(reply: bytes) -> tuple[int, list[str]]:
    """The quorum id and the participants' replica ids of a ``LighthouseQuorumResponse``."""
    from harness.quorum.wire import decode_quorum_response

    qid, members = decode_quorum_response(reply)
    return qid, [m.replica_id for m in members]
