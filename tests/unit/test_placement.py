"""Where a replica group runs (harness.job.placement): home first, spread on loss, respawn in the
background, wait only when no host is ready."""

from __future__ import annotations

import pytest

from harness.job.placement import HostState, place


def hosts(*states: HostState) -> list[HostState]:
    return list(states)


UP = {"up": True}


def test_home_host_when_ready() -> None:
    hs = hosts(HostState(name="h0", **UP), HostState(name="h1", **UP))
    assert place(0, hs, now=10).host == "h0"
    assert place(1, hs, now=10).host == "h1"
    assert place(3, hs, now=10).host == "h1"


def test_groups_of_a_lost_host_spread_in_ring_order() -> None:
    hs = hosts(
        HostState(name="h0", **UP),
        HostState(name="h1", up=False, cooling_until=20),
        HostState(name="h2", **UP),
    )
    d = place(1, hs, now=10)
    assert (d.host, d.respawn) == ("h2", ())  # cooling: not respawned yet
    assert "not ready" in d.reason


def test_a_lost_host_past_its_cooldown_is_respawned_but_never_waited_for() -> None:
    """The 8.8 s restart: a group whose home host was evicted earlier must not wait for that
    host's agent to be restarted when another host is ready."""
    hs = hosts(HostState(name="h0", **UP), HostState(name="h1", up=False, cooling_until=5))
    d = place(1, hs, now=10)
    assert d.host == "h0"
    assert d.respawn == ("h1",)


def test_a_host_already_respawning_is_not_respawned_twice() -> None:
    hs = hosts(HostState(name="h0", **UP), HostState(name="h1", up=False, respawning=True))
    assert place(1, hs, now=10).respawn == ()


def test_no_host_ready_waits_until_the_first_cooldown_ends() -> None:
    hs = hosts(
        HostState(name="h0", up=False, cooling_until=13),
        HostState(name="h1", up=False, cooling_until=11),
    )
    d = place(0, hs, now=10)
    assert d.host is None and d.respawn == ()
    assert d.wait_s == pytest.approx(1.0)


def test_no_host_ready_while_one_respawns_polls() -> None:
    hs = hosts(HostState(name="h0", up=False, respawning=True))
    d = place(0, hs, now=10, poll_s=0.05)
    assert d.host is None and d.wait_s == pytest.approx(0.05)


def test_up_but_cooling_is_not_ready() -> None:
    hs = hosts(HostState(name="h0", up=True, cooling_until=11), HostState(name="h1", **UP))
    assert place(0, hs, now=10).host == "h1"


def test_no_hosts_is_an_error() -> None:
    with pytest.raises(ValueError, match="no hosts"):
        place(0, [], now=0)


def test_a_group_off_its_home_goes_back_home_when_it_next_restarts() -> None:
    """Evicted: group 1 runs on h2 meanwhile; its home host back (up, checked, cooled down), its
    next restart is there again, whatever else runs on h2."""
    away = hosts(
        HostState(name="h0", **UP),
        HostState(name="h1", up=False, cooling_until=20),
        HostState(name="h2", **UP),
    )
    assert place(1, away, now=10, load={"h0": 1, "h2": 1}).host == "h2"
    back = hosts(HostState(name="h0", **UP), HostState(name="h1", **UP), HostState(name="h2", **UP))
    d = place(1, back, now=30, load={"h0": 1, "h2": 2})
    assert (d.host, d.reason) == ("h1", "home host")
    not_checked = [back[0], HostState(name="h1", up=True, checked=False), back[2]]
    assert place(1, not_checked, now=30).host == "h2"  # its agent's preflight still runs


def test_off_home_the_least_loaded_ready_host_is_taken() -> None:
    """Four hosts, three groups: h3 is no group's home and idle; a group whose home is lost goes
    there, not onto the next busy host in the ring."""
    hs = hosts(
        HostState(name="h0", **UP),
        HostState(name="h1", up=False),
        HostState(name="h2", **UP),
        HostState(name="h3", **UP),
    )
    d = place(1, hs, now=10, load={"h0": 1, "h2": 1})
    assert d.host == "h3" and "least loaded" in d.reason
    # Among equally loaded hosts, ring order from home (as without loads).
    assert place(1, hs, now=10, load={"h0": 1, "h2": 1, "h3": 1}).host == "h2"
    assert place(1, hs, now=10).host == "h2"


def test_a_ready_spare_comes_before_the_other_hosts_however_loaded() -> None:
    hs = hosts(
        HostState(name="a0", **UP),
        HostState(name="a1", up=False),
        HostState(name="s0", spare=True, **UP),
    )
    d = place(1, hs, now=10, load={"s0": 3})
    assert d.host == "s0" and "spare" in d.reason
