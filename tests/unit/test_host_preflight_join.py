"""The preflight of an agent that joins later (``harness.job.hosts``, ``harness.job.placement``):
no group is placed on it until its own round passed; a round that fails keeps it out (the job
goes on), until its next agent passes; the round never holds up a group that needs a host."""

from __future__ import annotations

import threading
import time

from harness.config import load_config
from harness.job.hosts import HostPool
from harness.job.placement import HostState, place
from harness.job.site import Site
from runtime.launchers import ExternalLauncher


class _Agent:
    """A host's agent as HostPool sees it: a new object for every new agent."""

    def __init__(self, name: str) -> None:
        self.name, self.lost = name, False


class _Controller:
    def __init__(self, names: list[str]) -> None:
        self.hosts = {n: _Agent(n) for n in names}


def _pool(tmp_path, controller: _Controller, said: list[str], failed: list[str]) -> HostPool:
    cfg = load_config("experiments/tiny.toml", ["hosts=2", "recovery.spares_per_host=0"])
    site = Site(cfg=cfg, launcher=ExternalLauncher())
    return HostPool(site, controller, tmp_path, said.append, fail=failed.append)  # type: ignore[arg-type]


class _Check:
    """The per-host round: answers from ``results`` in turn (None: passed), after ``delay_s``."""

    def __init__(self, *results: str | None, delay_s: float = 0.0) -> None:
        self.results = list(results)
        self.delay_s = delay_s
        self.calls: list[tuple[str, list[str]]] = []
        self.done = threading.Event()

    def __call__(self, name: str, peers) -> str | None:
        self.calls.append((name, peers()))  # the hosts to check it with, when the round starts
        time.sleep(self.delay_s)
        self.done.set()
        return self.results.pop(0)


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_placement_rule_skips_a_host_whose_agent_is_not_checked():
    hosts = [HostState(name="h0", up=True), HostState(name="h1", up=True, checked=False)]
    assert place(1, hosts, 0.0).host == "h0"  # h1 is home, but not checked: the ring
    assert place(1, hosts, 0.0).respawn == ()  # up: not to be respawned
    alone = [HostState(name="h1", up=True, checked=False)]
    assert place(0, alone, 0.0).host is None  # wait for its round


def test_a_joining_host_is_placed_on_only_after_its_round_passed_and_never_waits_a_restart(
    tmp_path,
):
    controller = _Controller(["host0", "host1"])
    said: list[str] = []
    pool = _pool(tmp_path, controller, said, [])
    check = _Check(None, delay_s=1.0)
    pool.arm_preflight(check, controller.hosts.values())
    assert pool.place(1).name == "host1" and not check.calls  # the first round checked it
    controller.hosts["host1"] = _Agent("host1")  # its agent was lost and restarted
    t0 = time.monotonic()
    assert pool.place(1).name == "host0"  # not on host1 while its round runs ...
    assert time.monotonic() - t0 < 0.5  # ... and the restart did not wait for the round
    _wait(lambda: check.calls)
    assert check.calls == [("host1", ["host0"])]  # with the checked live hosts
    _wait(lambda: pool.place(1).name == "host1")  # passed: home again
    assert len(check.calls) == 1  # once per agent
    pool.close()


def test_a_failed_round_keeps_the_host_out_until_its_next_agent_passes(tmp_path):
    controller = _Controller(["host0", "host1"])
    failed: list[str] = []
    pool = _pool(tmp_path, controller, [], failed)
    table = "preflight failed: 1 of 3 network path(s) do not work\n  host1  host0  ..."
    check = _Check(table, None)
    pool.arm_preflight(check, controller.hosts.values())
    controller.hosts["host1"] = _Agent("host1")
    pool.place(1)
    _wait(lambda: pool.kept_out())
    assert pool.kept_out()["host1"].startswith("kept out by its preflight (preflight failed: 1")
    for _ in range(5):  # a group whose home is host1 is restarted, again and again: elsewhere
        assert pool.place(1).name == "host0"
    assert len(check.calls) == 1  # that agent is not checked again
    assert not failed  # the job goes on with host0
    controller.hosts["host1"] = _Agent("host1")  # its next agent
    _wait(lambda: pool.place(1).name == "host1")
    assert len(check.calls) == 2 and not pool.kept_out()
    pool.close()


def test_with_every_host_kept_out_or_gone_the_job_fails(tmp_path):
    controller = _Controller(["host0", "host1"])
    failed: list[str] = []
    pool = _pool(tmp_path, controller, [], failed)
    pool.arm_preflight(lambda name, peers: f"preflight failed: {name} ...", [])
    threading.Thread(target=pool.place, args=(0,), daemon=True).start()  # waits for a host
    _wait(lambda: failed)
    assert failed[0].startswith("no host left to run a replica group on: host0: kept out by")
    assert "host1: kept out by its preflight (preflight failed: host1 ...)" in failed[0]
    pool.close()
