"""Which sockets of a dead group's survivors the agent shuts down (runtime.sockets, pure part)."""

from __future__ import annotations

import pytest

from runtime.sockets import Conn, _addr, communicator_links, store_ports

LO = "127.0.0.1"


def conn(fd: int, local: tuple[str, int], remote: tuple[str, int] = ("0.0.0.0", 0)) -> Conn:
    return Conn(fd, 1000 + fd, local, remote, listening=remote[1] == 0)


def three_ranks() -> dict[int, list[Conn]]:
    """The sockets of three survivors' ranks as torchft's gloo process group leaves them (read
    from a real run, see tests/integration/test_survivor_unblock.py): pid 10 (group 0) hosts the
    rendezvous TCPStore (port 5000, with a client of its own) and gloo listener 6000; pid 20
    (group 1) and pid 30 (group 2) are its peers; each also talks to the quorum tap (7000,
    another process) and its group's store (7100)."""
    return {
        10: [
            conn(3, (LO, 5000)),  # the TCPStore server ...
            conn(4, (LO, 40001), (LO, 5000)),  # ... and its own client
            conn(5, (LO, 5000), (LO, 40001)),
            conn(6, (LO, 5000), (LO, 40002)),  # pid 20's store client
            conn(7, (LO, 6000)),  # gloo's listener
            conn(8, (LO, 6000), (LO, 41000)),  # gloo pair with pid 20 (accepted)
            conn(9, (LO, 6000), (LO, 42000)),  # gloo pair with pid 30 (accepted)
            conn(11, (LO, 43000), (LO, 7000)),  # the quorum tap
            conn(12, (LO, 43001), (LO, 7100)),  # the group's store
        ],
        20: [
            conn(4, (LO, 40002), (LO, 5000)),  # client of pid 10's TCPStore: left alone
            conn(5, (LO, 41000), (LO, 6000)),  # gloo pair with pid 10
            conn(7, (LO, 6100)),  # gloo's listener
            conn(8, (LO, 6100), (LO, 42100)),  # gloo pair with pid 30 (accepted)
            conn(9, (LO, 43100), (LO, 7000)),
        ],
        30: [
            conn(5, (LO, 42000), (LO, 6000)),
            conn(6, (LO, 42100), (LO, 6100)),
            conn(7, ("10.0.0.1", 6200)),  # a listener on the host's address
            conn(8, ("10.0.0.1", 6200), ("10.0.0.2", 50000)),  # accepted from another host
            conn(9, ("10.0.0.1", 44000), ("10.0.0.2", 6300)),  # dialled to another host
        ],
    }


def fds(picked: dict[int, list[Conn]]) -> dict[int, list[int]]:
    return {pid: sorted(c.fd for c in cs) for pid, cs in picked.items()}


def test_a_tcpstore_server_is_known_by_the_client_of_its_own():
    assert store_ports(three_ranks()[10]) == {5000}
    assert store_ports(three_ranks()[20]) == set()


def test_only_links_between_groups_are_picked_never_the_stores_or_other_processes():
    snap = three_ranks()
    groups = {10: 0, 20: 1, 30: 2}
    # group 3 died elsewhere: every survivor's cross-group gloo pair, and the connection pid 30
    # accepted from another host (its other end is that host's agent's to shut down)
    assert fds(communicator_links(snap, groups, [10, 20, 30])) == {
        10: [8, 9],
        20: [5, 8],
        30: [5, 6, 8],
    }


def test_ranks_of_one_group_keep_their_connections():
    snap = three_ranks()
    same = {10: 0, 20: 0, 30: 1}  # pids 10 and 20 in one group (e.g. an intra-group group)
    assert fds(communicator_links(snap, same, [10, 20])) == {10: [9], 20: [8]}


def test_a_pid_not_in_the_snapshot_is_skipped():
    assert communicator_links({}, {10: 0}, [10]) == {10: []}


@pytest.mark.parametrize(
    ("hex_addr", "want"),
    [
        ("0100007F:1F90", ("127.0.0.1", 8080)),
        ("0000000000000000FFFF00000100007F:1F90", ("127.0.0.1", 8080)),  # v4-mapped
        ("00000000000000000000000001000000:0050", ("::1", 80)),
    ],
)
def test_proc_net_tcp_addresses_are_decoded(hex_addr, want):
    assert _addr(hex_addr) == want
