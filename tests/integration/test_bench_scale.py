"""``ftharness bench scale`` at tiny sizes, for real: the tree quorum and torchft's Lighthouse in
their own processes, simulated members over gRPC in load processes, a real controller with
simulated host agents dialled in (``ExternalLauncher``). Checks the JSON contract and that
every figure was measured; no timing thresholds, except what the protocol itself implies (the
Lighthouse cannot see a death before its heartbeat timeout)."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import pytest

from experiments.bench.scale import run
from experiments.bench.sim_agents import run_agents
from runtime import channel
from runtime.controller import Controller
from runtime.launchers import ExternalLauncher
from runtime.spec import ControllerSpec, HeartbeatSpec


@pytest.mark.timeout(240)
def test_scale_bench_at_tiny_sizes_measures_every_figure() -> None:
    out = run(sizes=(4, 8), hosts=(4,), rounds=2, failovers=1, window_s=3.0)
    json.dumps(out)  # the bench prints it
    assert [q["groups"] for q in out["quorum"]] == [4, 8]
    for q in out["quorum"]:
        for kind in ("tree_ms", "lighthouse_ms"):
            lat = q[kind]
            assert 0 < lat["p50"] <= lat["p95"] <= lat["max"], (kind, lat)
            assert 0 <= lat["after_last_ask"]["p50"] <= lat["max"]
            assert lat["ask_spread"] >= 0 and lat["service_cpu_per_round"] >= 0
        fo = q["failover_ms"]
        assert set(fo) == {"tree", "lighthouse"}
        assert 0 < fo["tree"]["p50"] <= fo["tree"]["max"]
        # The Lighthouse hears of a death only when the heartbeat goes stale.
        timeout_s = fo["lighthouse"]["heartbeat_timeout_s"]
        assert timeout_s >= out["settings"]["lighthouse_heartbeat_timeout_s"]
        assert fo["lighthouse"]["p50"] >= 1000 * timeout_s
    (agents,) = out["agents"]
    assert agents["hosts"] == 4
    assert agents["missed_beats"] == 0 and agents["lost_hosts"] == 0
    assert 0 <= agents["controller_cpu"] < 1
    assert agents["beats_seen"] >= 4  # every host beat during the window
    assert set(out["goals"]) == {
        "tree_growth_p50",
        "tree_over_lighthouse_p50",
        "tree_over_lighthouse_max",
    }


@pytest.mark.timeout(60)
def test_a_simulated_agent_dials_in_beats_and_is_lost_when_gone() -> None:
    """The simulator against the real controller: an agent the controller did not start
    (ExternalLauncher) dials in, its beats are heard, and when it goes away the host is lost."""
    secret = channel.new_secret()
    spec = ControllerSpec(agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=5.0), preload=())
    with Controller(spec, secret=secret, launcher=ExternalLauncher()) as ctl:
        ctl.host_table.expect(["sim0"])
        ours, theirs = mp.Pipe()
        args = (["sim0"], ctl.address, secret, 0.1, theirs)
        threading.Thread(target=run_agents, args=args, daemon=True).start()
        (h,) = ctl.wait_for_hosts(["sim0"], 20.0)
        assert ours.recv() == 1 and not h.lost
        first = h.last_beat
        deadline = time.monotonic() + 10
        while h.last_beat == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.last_beat > first  # an AgentBeat arrived and was registered
        ours.send("stop")  # the simulated agent closes its connection
        sent, _ = ours.recv()
        assert sent >= 1
        deadline = time.monotonic() + 10
        while not h.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.lost
