"""Which address a host advertises (runtime/netaddr.py) and the ``[network]`` keys that choose
it (harness/config.py): pure, on made-up interface tables and on this machine's real ones."""

from __future__ import annotations

import pytest

from harness.config import ConfigError, load_config
from runtime import netaddr

HAVE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.168.1.7"], "ib0": ["10.1.0.7", "10.1.0.8"]}


def choose(**kw: str) -> str:
    return netaddr.choose(host="node7", default="192.168.1.7", have=HAVE, **kw)


def test_the_default_is_the_address_the_controller_connection_leaves_from() -> None:
    assert choose() == "192.168.1.7"


def test_an_explicit_advertise_wins_over_the_job_setting() -> None:
    assert choose(advertise="172.16.0.1", interface="ib0") == "172.16.0.1"


def test_an_interface_or_a_network_picks_the_hosts_address_there() -> None:
    assert choose(interface="ib0") == "10.1.0.7"
    assert choose(cidr="10.1.0.0/16") == "10.1.0.7"
    assert choose(cidr="10.1.0.8/32") == "10.1.0.8"
    assert choose(interface="eth0") == "192.168.1.7"
    # The connection's own address where it is on the chosen interface.
    assert netaddr.choose(host="n", default="10.1.0.8", have=HAVE, interface="ib0") == "10.1.0.8"


def test_a_setting_that_matches_nothing_names_the_host_and_what_it_has() -> None:
    with pytest.raises(netaddr.NoAddress) as e:
        choose(interface="ib1")
    assert "host node7" in str(e.value) and "'ib1'" in str(e.value)
    assert "no such interface" in str(e.value) and "eth0 192.168.1.7" in str(e.value)
    with pytest.raises(netaddr.NoAddress, match=r"host node7: network.cidr = '10.9.0.0/16'"):
        choose(cidr="10.9.0.0/16")


def test_this_machines_interfaces_are_read_for_real() -> None:
    have = netaddr.addresses()
    assert "127.0.0.1" in have["lo"]
    assert netaddr.choose(host="here", default="x", interface="lo") == "127.0.0.1"
    with pytest.raises(netaddr.NoAddress, match=r"host here: .* no such interface"):
        netaddr.choose(host="here", default="x", interface="nosuchif0")
    assert netaddr.interface_of("127.0.0.1") is None  # loopback: nothing to pin collectives to


def test_workers_get_the_interface_for_gloo_and_nccl_and_the_address() -> None:
    assert netaddr.worker_env("127.0.0.1") == {"FTHARNESS_ADVERTISE": "127.0.0.1"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["network.interface=eth0", "network.cidr=10.0.0.0/8"], "set one of them"),
        (["network.interface=10.0.0.0/8"], "not an interface name"),
        (["network.cidr=10.0.0.0/33"], "not a network"),
    ],
)
def test_network_settings_are_checked_when_the_config_is_built(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("experiments/tiny.toml", overrides)


def test_network_settings_load() -> None:
    cfg = load_config("experiments/tiny.toml", ["network.cidr=10.0.0.0/8"])
    assert (cfg.network.interface, cfg.network.cidr) == ("", "10.0.0.0/8")
