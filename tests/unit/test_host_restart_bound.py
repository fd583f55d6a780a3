"""Restart intensity for hosts (``runtime.policy.host_restart``, ``harness.job.hosts``): a host
whose agent cannot be restarted is retried a bounded number of times, then given up; with no
host left the job fails with the reason, instead of retrying forever."""

from __future__ import annotations

import threading
import time

from harness.config import load_config
from harness.job.hosts import HostPool
from harness.job.site import Site
from runtime.launchers import ExternalLauncher
from runtime.policy import Action, host_restart


def test_host_restart_intensity():
    assert host_restart([], 100.0, 3, 60.0).action is Action.RESTART_ONE
    assert host_restart([50.0, 60.0], 100.0, 3, 60.0).action is Action.RESTART_ONE
    d = host_restart([50.0, 60.0, 70.0], 100.0, 3, 60.0)
    assert d.action is Action.ESCALATE and "3 restarts within 60 s" in d.reason
    assert host_restart([10.0, 20.0, 70.0], 100.0, 3, 60.0).action is Action.RESTART_ONE  # old
    assert host_restart([], 100.0, 0, 60.0).action is Action.ESCALATE  # 0: never restarted


class _Handle:
    def __init__(self, name: str, lost: bool) -> None:
        self.name, self.lost = name, lost


class _Controller:
    """What HostPool uses of a controller: its hosts, and spawn_host, which here fails the way
    an agent that never dials in does (after a short wait), or, with ``outcomes``, fails or
    brings the host back ("fail" / "ok") in that order."""

    def __init__(self, up: list[str], down: list[str], outcomes: list[str] | None = None) -> None:
        self.hosts = {n: _Handle(n, False) for n in up} | {n: _Handle(n, True) for n in down}
        self.spawns: list[str] = []
        self._outcomes = iter(outcomes) if outcomes is not None else None

    def spawn_host(self, name: str) -> _Handle:
        self.spawns.append(name)
        time.sleep(0.01)
        if self._outcomes is None or next(self._outcomes) == "fail":
            raise RuntimeError(f"host agent {name} did not dial in within 40 s")
        self.hosts[name].lost = False
        return self.hosts[name]


def _pool(
    tmp_path, controller: _Controller, hosts: int, said: list[str], failed: list[str], slurm=None
):
    cfg = load_config(
        "experiments/tiny.toml",
        [f"hosts={hosts}", "recovery.host_max_restarts=3", "recovery.spares_per_host=0"],
    )
    site = Site(cfg=cfg, launcher=ExternalLauncher(), slurm=slurm)
    return HostPool(site, controller, tmp_path, said.append, fail=failed.append)  # type: ignore[arg-type]


def test_a_host_that_cannot_be_restarted_is_given_up_and_its_groups_go_elsewhere(tmp_path):
    controller = _Controller(up=["host0"], down=["host1"])
    said: list[str] = []
    failed: list[str] = []
    pool = _pool(tmp_path, controller, 2, said, failed)
    deadline = time.monotonic() + 10
    while "host1" not in pool.given_up and time.monotonic() < deadline:
        assert pool.place(1).name == "host0"  # a restart of group 1, again and again
        time.sleep(0.02)
    assert controller.spawns == ["host1"] * 3  # three restarts, then no more
    assert "restart intensity exceeded: 3 restarts within 600 s" in pool.given_up["host1"]
    assert "did not dial in within 40 s" in pool.given_up["host1"]  # the last error
    assert any(s.startswith("giving up on host host1:") for s in said), said
    assert not failed  # host0 is still there
    for _ in range(5):
        pool.place(1)
    assert controller.spawns == ["host1"] * 3


def test_with_no_host_left_the_job_fails_instead_of_waiting(tmp_path):
    controller = _Controller(up=[], down=["host0", "host1"])
    said: list[str] = []
    failed: list[str] = []
    pool = _pool(tmp_path, controller, 2, said, failed)
    threading.Thread(target=pool.place, args=(0,), daemon=True).start()  # waits for a host
    deadline = time.monotonic() + 10
    while not failed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(failed) == 1, said
    assert failed[0].startswith("no host left to run a replica group on: host0: host restart")
    assert "host1: host restart intensity exceeded" in failed[0]
    assert sorted(controller.spawns) == ["host0"] * 3 + ["host1"] * 3
    pool.close()


def test_a_restart_that_succeeds_starts_the_count_again(tmp_path):
    """A host that is evicted and comes back (a chaos run's evictions) is never given up for
    that: only restarts since the last one that succeeded count."""
    outcomes = ["fail", "fail", "ok", "fail", "fail", "fail", "fail"]
    controller = _Controller(up=["host0"], down=["host1"], outcomes=outcomes)
    said: list[str] = []
    pool = _pool(tmp_path, controller, 2, said, [])

    def restarts_until(cond, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            pool.place(1)
            time.sleep(0.02)

    restarts_until(lambda: not controller.hosts["host1"].lost)  # back after two failures
    assert len(controller.spawns) == 3 and not pool.given_up
    controller.hosts["host1"].lost = True  # evicted again
    restarts_until(lambda: "host1" in pool.given_up)
    assert len(controller.spawns) == 6  # three more failures, not one: the count started again


def test_a_failed_restart_is_tried_again_without_waiting_for_a_placement(tmp_path):
    """A lost host whose fresh agent does not come up (a dial-in timeout under load) gets
    another one on its own after a back-off: before, it stayed lost until a group needed it
    (seen in CI: an evicted host's groups had found room elsewhere, so nothing asked)."""
    from runtime.failure import Cause, Failure

    controller = _Controller(up=["host0"], down=["host1"], outcomes=["fail", "ok"])
    said: list[str] = []
    pool = _pool(tmp_path, controller, 2, said, [])
    lost = Failure(cause=Cause.LOST_HOST, detail="evicted", proc="host1/p0", host="host1")
    pool.on_failure(lost)  # no group is placed from here on
    deadline = time.monotonic() + 10
    while controller.hosts["host1"].lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert controller.spawns == ["host1", "host1"] and not controller.hosts["host1"].lost
    assert any("could not restart the agent of host1 (restart 1/3" in s for s in said), said
    pool.close()


def test_a_node_slurm_took_away_is_never_restarted(tmp_path):
    """A lost host whose SLURM node is down, drained or gone gets no fresh agent, whichever
    road asks for one (its failure, a takeover's ``respawn_lost``); a lost host on a node that
    is still there does."""
    from types import SimpleNamespace

    from runtime.failure import Cause, Failure

    controller = _Controller(up=[], down=["host0", "host1"], outcomes=["ok"])
    said: list[str] = []
    slurm = SimpleNamespace(gone={"host1": "down"}, spares=set(), nodes=["host0", "host1"])
    pool = _pool(tmp_path, controller, 2, said, [], slurm=slurm)
    pool.on_failure(Failure(cause=Cause.LOST_HOST, detail="lost", proc="host1/p0", host="host1"))
    pool.respawn_lost("host1")
    pool.on_failure(Failure(cause=Cause.LOST_HOST, detail="lost", proc="host0/p0", host="host0"))
    deadline = time.monotonic() + 10
    while controller.hosts["host0"].lost and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert controller.spawns == ["host0"], said
    pool.close()
