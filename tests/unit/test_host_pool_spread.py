"""``HostPool.place`` counts where it placed each group, so a group off its home host goes to
the least loaded ready host (``harness.job.placement``), and goes home again once it is ready;
``HostPool.ready_hosts`` says which hosts a group could go to now."""

from __future__ import annotations

from harness.config import load_config
from harness.job.hosts import HostPool
from harness.job.site import Site
from runtime.launchers import ExternalLauncher


class _Handle:
    def __init__(self, name: str) -> None:
        self.name, self.lost = name, False


class _Controller:
    def __init__(self, names: list[str]) -> None:
        self.hosts = {n: _Handle(n) for n in names}

    def spawn_host(self, name: str) -> _Handle:  # a lost host's respawn: never here
        raise AssertionError(f"no respawn expected ({name})")


def test_groups_spread_over_idle_hosts_and_go_home_again(tmp_path) -> None:
    names = ["host0", "host1", "host2", "host3"]  # three groups: host3 is no group's home
    controller = _Controller(names)
    cfg = load_config("experiments/tiny.toml", ["hosts=4", "recovery.spares_per_host=0"])
    pool = HostPool(Site(cfg=cfg, launcher=ExternalLauncher()), controller, tmp_path, print)  # type: ignore[arg-type]
    assert [pool.place(r).name for r in range(3)] == ["host0", "host1", "host2"]
    assert pool.ready_hosts() == names

    pool.set_cooldown("host1", 3600.0)  # evicted: kept out (its agent is not lost here)
    assert "host1" not in pool.ready_hosts()
    assert pool.place(1).name == "host3"  # idle, not host2 (the next in the ring, busy)
    pool.set_cooldown("host0", 3600.0)
    assert pool.place(0).name == "host2"  # host2 and host3 hold one group each: the ring

    pool.set_cooldown("host1", 0.0)  # both back
    pool.set_cooldown("host0", 0.0)
    assert pool.place(1).name == "host1"  # its next restart is at home
    assert pool.place(0).name == "host0"
