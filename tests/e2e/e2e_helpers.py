"""Helpers shared by the end-to-end tests (a plain module: a second conftest.py named module
would shadow the root one under pytest's default import mode)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from experiments.report import ranks_apart
from harness.config import load_config
from runtime.controller import Controller
from runtime.journal import JOB_RESTART, STEP_COMMIT, read_journal
from runtime.launchers import netns
from runtime.spec import ControllerSpec


def tiny_cfg(*overrides: str):
    """The tiny job config with ``a.b=value`` overrides."""
    return load_config("experiments/tiny.toml", list(overrides))


def chaos_argv(tmp_path, *options: str) -> list[str]:
    """``ftharness chaos`` on ``tmp_path/exp.toml``, writing ``tmp_path/run``."""
    exp, out = str(tmp_path / "exp.toml"), str(tmp_path / "run")
    return [sys.executable, "-m", "harness", "chaos", exp, "--out", out, *options]


def run_chaos(tmp_path: Path, root: Path, timeout: float = 140) -> tuple[dict, str]:
    """``ftharness chaos`` on ``tmp_path/exp.toml`` from ``root``; asserts it exited 0 and its
    report passed. Returns the report and the console output."""
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=root, capture_output=True, text=True, timeout=timeout
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["passed"], (report["hypotheses"], out[-4000:])
    return report, out


def kill_group(job: Any, replica: int) -> None:
    """SIGKILL rank 0 of replica group ``replica`` of a running job."""
    from faults.fault import Target

    os.kill(job.faults.pids(Target(replica=replica, rank=0))[0], signal.SIGKILL)


def after_step(job: Any, step: int, action: Callable[[], None], timeout: float = 120) -> None:
    """Run ``action`` once the job has committed ``step`` (on a background thread)."""

    def run() -> None:
        wait_until(lambda: job.faults.committed_step() >= step, time.monotonic() + timeout)
        action()

    threading.Thread(target=run, daemon=True).start()


def wait_until(cond: Callable[[], object], deadline: float, poll_s: float = 0.05) -> bool:
    """Poll ``cond`` until it is true or ``time.monotonic()`` passes ``deadline``; whether it
    became true (a caller that must not go on without it asserts on the result, or on what it
    recorded)."""
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def train_on_then_stop(job: Any, steps: int, stop: threading.Event, deadline: float) -> None:
    """Let the job commit ``steps`` more steps (or reach ``deadline``), then set ``stop`` (the
    ``stop_event`` the run was given): how a timed scenario ends once its checks are done."""
    target = job.faults.committed_step() + steps
    wait_until(lambda: job.faults.committed_step() >= target, deadline)
    stop.set()


#: What the example semi-synchronous programs (tests/programs/train_diloco.py, train_localsgd.py)
#: print after every committed sync.
SYNC_LINE = re.compile(r"^sync (\d+) checksum ([0-9a-f]+)", re.M)


def sync_checksums(log: Path) -> list[dict[int, str]]:
    """Each incarnation's ``{sync: checksum}`` from a program rank's log, in order (the harness
    starts each incarnation's part with an ``=== ftharness:`` header)."""
    parts = log.read_text().split("=== ftharness:")[1:]
    return [{int(s): c for s, c in SYNC_LINE.findall(p)} for p in parts]


def events(run_dir, name: str | None = None) -> list[dict]:
    rs = read_journal(run_dir / "journal.jsonl")
    return [r for r in rs if name is None or r["event"] == name]


def run_ok(cfg: Any, run_dir, **kwargs: Any) -> list[dict]:
    """Run job ``cfg`` in this process (``harness.job.launch.run_job``, quiet, ``kwargs`` passed
    on), assert that it ended ok, check the protocol's invariants on its journal
    (:func:`check_invariants`), and return the journal's records."""
    from harness.job.launch import run_job

    out = run_job(cfg, run_dir, quiet=True, **kwargs)
    assert out["status"] == "ok", out["reason"]
    records = events(run_dir)
    check_invariants(records)
    return records


def check_invariants(records: list[dict]) -> None:
    """The protocol's invariants, from the journal: per group, committed steps only go forward
    (within an incarnation of the job), losses are finite, no data position is trained twice,
    every step committed by several groups has one checksum, and the ranks of a group commit the
    same steps together (``experiments.report.ranks_apart``). Records are taken in the order
    they happened (``t``, stamped where they happened), not the order they reached the journal:
    a record can arrive late from a host behind a slow or cut link."""
    records = sorted(records, key=lambda r: r["t"])
    incarnation = 0
    last_step: dict[tuple, int] = {}
    positions: dict[tuple, set] = defaultdict(set)
    sums: dict[tuple, set] = defaultdict(set)
    for r in records:
        if r["event"] == JOB_RESTART:
            incarnation += 1
            last_step.clear()
            positions.clear()
        if r["event"] != STEP_COMMIT:
            continue
        key = (r["replica"], r["rank"])
        assert r["step"] > last_step.get(key, -1), f"step went back for {key}: {r}"
        last_step[key] = r["step"]
        assert math.isfinite(r["loss"]), r
        assert r["data_pos"] not in positions[key], f"data position trained twice: {r}"
        positions[key].add(r["data_pos"])
        sums[(incarnation, r["step"], r["rank"])].add(r["checksum"])
    differing = {k: v for k, v in sums.items() if len(v) > 1}
    assert not differing, f"replicas disagree at {sorted(differing)[:3]}"
    apart = ranks_apart(records)
    assert apart is None, apart


@contextlib.contextmanager
def bare_netns_hosts(names: list[str]) -> Iterator[tuple[netns.TestNetwork, Controller]]:
    """Test hosts in network namespaces whose agents preload nothing (no torch: seconds), on
    one controller at the gateway; all torn down afterwards (root only)."""
    net = netns.TestNetwork(names).up()
    controller = Controller(
        ControllerSpec(bind_host=net.gateway, preload=()), launcher=netns.NetnsLauncher(net)
    )
    try:
        for name in net.hosts:
            controller.spawn_host(name)
        yield net, controller
    finally:
        controller.shutdown(grace_s=0.5)
        net.down()


def iptables_out(net: netns.TestNetwork, host: str, *rule: str) -> None:
    """Append ``rule`` to the OUTPUT chain inside ``host``'s namespace (gone with it)."""
    subprocess.run(
        ["ip", "netns", "exec", net.hosts[host].netns, "iptables", "-A", "OUTPUT", *rule],
        check=True,
        capture_output=True,
        timeout=30,
    )


def our_namespaces() -> set[str]:
    """The network namespaces of this project's test hosts that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.startswith(netns.PREFIX)}


def no_leftover_namespaces() -> Iterator[None]:
    """A fixture body: fails the test if it left network namespaces behind. A module of
    namespace tests makes it its own: ``pytest.fixture(autouse=True)(no_leftover_namespaces)``."""
    before = our_namespaces()
    yield
    assert our_namespaces() - before == set(), "a test left network namespaces behind"


def fault_recoveries(run_dir, recs: list[dict]) -> list[dict]:
    """A program job's recoveries (``recs``: the report's) but those of survivors the controller
    restarted because they asked for no quorum after a death (cause ``blocked_survivor``,
    ``harness.job.program.progress``: gloo lost the error of a send to the dead group, a few
    kills in a hundred here), the intended recovery rather than a fault of the test's; each of
    those must have its failure in the journal (:func:`blocked_survivors`)."""
    blocked = blocked_survivors(run_dir)
    survivors = [r for r in recs if r.get("cause") == "blocked_survivor"]
    assert len(survivors) <= len(blocked), ("blocked survivors", survivors, blocked)
    return [r for r in recs if r.get("cause") != "blocked_survivor"]


def blocked_survivors(run_dir) -> list[dict]:
    """The failures of survivors restarted for asking for no quorum after a death."""
    return [
        f for f in events(run_dir, "failure") if "asked for no quorum" in (f.get("detail") or "")
    ]


#: A stranger's listener (issue #49): bind HOST:PORT as soon as it is free (within SECONDS),
#: accept whatever connects until stdin closes, then print what it got as one JSON line. Plain
#: standard library, for the system's interpreter: another user cannot run the project's.
STRANGER = r"""
import json, select, socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
deadline, bound, conns, got, accepted = time.monotonic() + seconds, False, [], 0, 0
while time.monotonic() < deadline:
    try:
        s.bind((host, port))
        s.listen(64)
        bound = True
        break
    except OSError:
        time.sleep(0.005)
print(json.dumps({"bound": bound}), flush=True)
watch = [sys.stdin] + ([s] if bound else [])
while True:
    ready, _, _ = select.select(watch + conns, [], [], 1.0)
    if sys.stdin in ready and not sys.stdin.readline():
        break
    for r in ready:
        if r is s:
            c, _ = s.accept()
            accepted += 1
            c.setblocking(False)
            conns.append(c)
        elif r is not sys.stdin:
            data = r.recv(65536)
            got += len(data)
            if not data:
                conns.remove(r)
print(json.dumps({"bound": bound, "accepted": accepted, "bytes": got}), flush=True)
"""


def start_stranger(host: str, port: int, seconds: float) -> subprocess.Popen:
    """:data:`STRANGER` as another local user (``nobody``, through ``setpriv``; as root only,
    else as this user), on ``host:port``. Close its stdin, then read its JSON lines."""
    argv = ["/usr/bin/python3", "-I", "-c", STRANGER, host, str(port), str(seconds)]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
