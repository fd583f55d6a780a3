"""Which addresses a running job listens on, and who each listener lets in: the security table
of the README, checked against live jobs. With ``bind_host = "127.0.0.1"`` no listener of the
job's processes (the controller with its tree quorum, quorum tap and Prometheus exporter, the
host agents, the trainers) may bind every interface, except torchft's own servers, which take no
bind address (listed in ``UNFIXABLE`` with the reason; see also ``harness.rank.torchft_glue``'s
docstring).

Read from ``/proc/net/tcp`` and ``/proc/net/tcp6`` while a real job (2 replica groups x 1 rank,
the tree quorum, torchft's HTTP checkpoint transport, the Prometheus exporter) trains, and while
a user's own program (tests/programs/train_ddp.py under ``[program]``) trains behind the quorum
tap: the tap listens on ``bind_host``, its only clients are the groups' rank-0 processes, a
stranger's calls (this process: its own sockets) are refused there and at the tree quorum, and
every quorum member is a tagged incarnation's.

(The host agents listen only for the preflight, with hosts on several machines or namespaces and
before training: ``tests/integration/test_preflight_listener.py`` checks that listener.)
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from faults.fault import Target
from harness.cli import build_parser
from harness.config import load_config
from harness.job.launch import attach_telemetry, run_job
from harness.quorum import rule
from harness.quorum.wire import decode_fields
from runtime.journal import Journal

ROOT = Path(__file__).resolve().parents[2]

#: Listeners torchft opens on every interface, and why they cannot be told otherwise.
UNFIXABLE = {
    "torchft ManagerServer": "torchft.manager.Manager binds f'[::]:{port}'; only the port is "
    "configurable (TORCHFT_MANAGER_PORT), not the address",
    "torchft HTTP checkpoint server": "torchft.checkpointing.http_transport.HTTPTransport binds "
    "('', 0) on an AF_INET6 server and takes no address",
}
# (torchft's process-group rendezvous store listens on every interface too, but ftharness's
# subclass creates it on the host's advertised address: harness.rank.torchft_glue.)

_ANY = {"00000000", "00000000000000000000000000000000", "0000000000000000FFFF000000000000"}


def _tcp_listeners() -> dict[str, tuple[str, int]]:
    """Socket inode -> (local address as /proc writes it, port) of every listening socket."""
    out: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    addr, port = fields[1].split(":")
                    out[fields[9]] = (addr, int(port, 16))
    return out


def _family_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _sample(seen: set[tuple[int, str, int]]) -> None:
    """Add (pid, address, port) for every listener owned by this process or a descendant."""
    listeners = _tcp_listeners()
    for pid in _family_tree(os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listeners:
                seen.add((pid, *listeners[link[8:-1]]))


def _is_python_http_server(port: int) -> bool:
    """Does ``port`` answer an unknown method as Python's http.server does? (torchft's handler
    has only do_GET, which would wait on the checkpoint lock; this never reaches it.)"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"BOGUS / HTTP/1.0\r\n\r\n")
            reply = s.recv(4096)
    except OSError:  # TimeoutError included: not an HTTP server
        return False
    return reply.startswith(b"HTTP/1.") and b"Server: BaseHTTP" in reply


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1].split("/", 1)[0])


def _torchft_ports(members: tuple[rule.Member, ...]) -> dict[int, str]:
    """The ManagerServer and rendezvous-store ports each member reported in its request."""
    ports: dict[int, str] = {}
    for m in members:
        for number, _, value in decode_fields(m.raw):
            if number == 2 and isinstance(value, bytes):  # address: the ManagerServer
                ports[_port(value.decode())] = "torchft ManagerServer"
            if number == 9 and isinstance(value, bytes):  # reconfigure handle (JSON)
                store = json.loads(value.decode())["store"]
                ports[_port(store)] = "torchft process-group rendezvous store"
    return ports


@pytest.mark.timeout(300)
def test_no_listener_of_a_running_job_binds_every_interface(tmp_path: Path) -> None:
    cfg = load_config(
        str(ROOT / "experiments" / "tiny.toml"),
        [
            "replicas=2",
            "ranks=1",
            "steps=100000",
            "recovery.quorum=tree",
            "transport=torchft_http",
            "telemetry.prometheus_port=0",
            "checkpoint.every_steps=0",
        ],
    )
    assert cfg.bind_host == "127.0.0.1"
    journal = Journal(tmp_path / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    telemetry = attach_telemetry(cfg, journal, quiet=True)
    seen: set[tuple[int, str, int]] = set()
    found: dict[str, Any] = {}
    stop = threading.Event()

    def watch(job: Any) -> None:
        try:
            deadline = time.monotonic() + 200
            both = None
            while both is None or time.monotonic() < both + 1.5:  # a few samples with both in
                assert time.monotonic() < deadline, "the two groups never formed a quorum"
                _sample(seen)
                quorum = job.quorum.tree.last_quorum()
                if both is None and quorum is not None and len(quorum.members) == 2:
                    both = time.monotonic()
                time.sleep(0.1)
            quorum = job.quorum.tree.last_quorum()
            _sample(seen)
            found["quorum"] = quorum
            found["trainers"] = {
                pid for r in range(2) for pid in job.faults.pids(Target(replica=r))
            }
            found["torchft"] = _torchft_ports(quorum.members)
            wildcard = sorted({(pid, port) for pid, addr, port in seen if addr in _ANY})
            found["wildcard"] = {
                (pid, port): found["torchft"].get(port)
                or ("torchft HTTP checkpoint server" if _is_python_http_server(port) else None)
                for pid, port in wildcard
            }
        except BaseException as e:
            found["error"] = e
        finally:
            stop.set()

    def started(job: Any) -> None:
        threading.Thread(target=watch, args=(job,), daemon=True).start()

    try:
        outcome = run_job(
            cfg, tmp_path, journal=journal, quiet=True, on_started=started, stop_event=stop
        )
    finally:
        telemetry.shutdown()
        journal.close()
    if "error" in found:
        raise found["error"]
    assert outcome["status"] == "ok", outcome["reason"]

    # Every Manager was let in under a name the job admitted (harness.quorum.tree).
    assert all(rule.parse_member_id(m.replica_id) for m in found["quorum"].members)
    # The Prometheus exporter listens on bind_host.
    prom_host, prom_port = telemetry.prometheus_address
    assert prom_host == cfg.bind_host
    assert any(port == prom_port and addr == "0100007F" for _, addr, port in seen)

    unexplained = {k: v for k, v in found["wildcard"].items() if v is None}
    assert not unexplained, (
        f"listeners on every interface, (pid, port): {sorted(unexplained)}; trainers are "
        f"{sorted(found['trainers'])}, this process (controller) is {os.getpid()}; "
        f"{found['torchft']} {[decode_fields(m.raw) for m in found['quorum'].members]}"
    )
    # The exceptions are torchft's, in trainer processes, and each one is documented.
    for (pid, _), what in found["wildcard"].items():
        assert pid in found["trainers"] and what in UNFIXABLE
    # (So that this test notices when torchft learns to bind an address: they are all there.)
    assert set(found["wildcard"].values()) == set(UNFIXABLE)


def test_the_prometheus_exporter_binds_what_help_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("run", "chaos"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "bind_host" in help_text and "127.0.0.1:PORT" not in help_text, help_text
    # And the exporter does bind the job's bind_host (127.0.0.2 is loopback too, on Linux).
    cfg = load_config(
        str(ROOT / "experiments" / "tiny.toml"),
        ["bind_host=127.0.0.2", "telemetry.prometheus_port=0"],
    )
    journal = Journal(tmp_path / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    telemetry = attach_telemetry(cfg, journal, quiet=True)
    try:
        host, port = telemetry.prometheus_address
        assert host == "127.0.0.2"
        assert ("0200007F", port) in set(_tcp_listeners().values())
    finally:
        telemetry.shutdown()
        journal.close()


def _clients_of(port: int) -> set[str]:
    """Socket inodes of every established connection *to* local port ``port`` (client ends)."""
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
                    out.add(fields[9])
    return out


def _owners(inodes: set[str]) -> dict[str, int]:
    """Socket inode -> the pid (this process or a descendant) holding it."""
    out: dict[str, int] = {}
    for pid in _family_tree(os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                out[link[8:-1]] = pid
    return out


def _stranger_calls(tap: str, tree: str, store: str, program_id: str) -> dict[str, str]:
    """What the quorum tap and the tree quorum answer a stranger (this process, its own
    sockets) that knows the group's store address and one of its Managers' own ids."""
    import grpc

    from harness.quorum.wire import SERVICE, encode_field

    def member(rid: str) -> bytes:
        fields = encode_field(1, rid.encode()) + encode_field(3, store.encode())
        return encode_field(1, fields + encode_field(4, 10**5) + encode_field(5, 1))

    calls = {
        "tap heartbeat, made-up id": (tap, "Heartbeat", encode_field(1, b"train_ddp_0:x")),
        "tap heartbeat, the program's id": (tap, "Heartbeat", encode_field(1, program_id.encode())),
        "tap quorum, the group's store": (tap, "Quorum", member("train_ddp_0:x")),
        "tap quorum, the program's id": (tap, "Quorum", member(program_id)),
        "tree heartbeat, untagged": (tree, "Heartbeat", encode_field(1, b"replica_0:x")),
        "tree quorum, untagged": (tree, "Quorum", member("replica_0:x")),
    }
    out = {}
    for what, (address, method, payload) in calls.items():
        with grpc.insecure_channel(address.split("://")[-1]) as channel:
            try:
                channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=5)
                out[what] = "OK"
            except grpc.RpcError as e:
                out[what] = e.code().name
    return out


@pytest.mark.timeout(300)
def test_the_quorum_tap_listens_on_bind_host_and_admits_only_the_ranks_the_job_started(
    tmp_path: Path,
) -> None:
    program = ROOT / "tests" / "programs" / "train_ddp.py"
    cfg = load_config(
        str(ROOT / "experiments" / "tiny.toml"),
        [
            "replicas=2",
            "ranks=1",
            "steps=100000",
            "recovery.quorum=tree",
            f"program.command={json.dumps(['python', str(program), '100000', '0.02'])}",
            "program.start_timeout_s=120",
        ],
    )
    journal = Journal(tmp_path / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    seen: set[tuple[int, str, int]] = set()
    found: dict[str, Any] = {}
    stop = threading.Event()

    def watch(job: Any) -> None:
        try:
            deadline = time.monotonic() + 200
            tree = job.quorum.tree
            while True:
                assert time.monotonic() < deadline, "the two groups never formed a quorum"
                _sample(seen)
                quorum = tree.last_quorum()
                if quorum is not None and len(quorum.members) == 2:
                    break
                time.sleep(0.1)
            tap = job.groups_kind.tap
            found["tap"] = (tap.bind_host, tap.port)
            found["tap_clients"] = _owners(_clients_of(tap.port))  # before the stranger calls
            found["agents"] = {h.pid for h in job.controller.hosts.values()}
            found["members"] = tree.last_quorum().replica_ids
            group = job.groups_kind._groups[0]  # what a local user can learn: the store, the ids
            found["stranger"] = _stranger_calls(
                tap.address, job.quorum.address, group.store, sorted(group.ids)[0]
            )
            found["after"] = tree.last_quorum().replica_ids
        except BaseException as e:
            found["error"] = e
        finally:
            stop.set()

    def started(job: Any) -> None:
        threading.Thread(target=watch, args=(job,), daemon=True).start()

    try:
        outcome = run_job(
            cfg, tmp_path, journal=journal, quiet=True, on_started=started, stop_event=stop
        )
    finally:
        journal.close()
    if "error" in found:
        raise found["error"]
    assert outcome["status"] == "ok", outcome["reason"]

    # The tap listens on bind_host, in the controller; no listener of the controller binds
    # every interface.
    host, port = found["tap"]
    assert host == cfg.bind_host
    # (gRPC's server listens on 127.0.0.1 through an IPv6 socket: ::ffff:127.0.0.1, as /proc
    # writes it, is the same loopback address.)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert any(pid == os.getpid() and a in loopback and p == port for pid, a, p in seen), seen
    assert not [(pid, p) for pid, addr, p in seen if pid == os.getpid() and addr in _ANY]
    # Its only clients are the groups' host agents: their quorum relays, through which every
    # Manager reaches it (the relay lets through only its agent's own processes).
    assert found["tap_clients"], "no Manager connected to the tap"
    assert set(found["tap_clients"].values()) <= found["agents"], found
    # A stranger is refused everywhere, even with the group's store and a Manager's own id.
    assert set(found["stranger"].values()) == {"PERMISSION_DENIED"}, found["stranger"]
    # Every quorum member is a tagged incarnation's: the tap forwards a Manager under its
    # incarnation's id, then the program's own id.
    for rid in (*found["members"], *found["after"]):
        parsed = rule.parse_member_id(rid)
        assert parsed is not None and rid.split(":", 1)[1].startswith(
            f"train_ddp_{parsed.replica}:"
        ), rid
