"""A program of the user's own takes part in the quorum only as the processes the job started
(issue #31): a user's unmodified torchft program (tests/programs/train_ddp.py under
``[program]``) behind the quorum tap, with the tree quorum, and a stranger on the same machine,
in a process of its own, that knows everything a local user can find out (both ports, the
group's store address, the program's own Manager ids).

What a user sees: the stranger's made-up heartbeats, to the tree quorum and through the tap, are
refused and the groups keep committing while it beats (before the fix, ten of them stalled
every commit); its quorum requests at the job's last step, through the tap with the group's real
store address and even with the program's real Manager ids, and straight to the tree quorum, are
refused, so it never becomes a heal source (torchft heals from the highest step, and its HTTP
transport unpickles what it is sent); no quorum ever has a member the job did not start. The
program still trains, and a group killed with SIGKILL comes back, heals from the survivor and
commits again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from faults.fault import Target
from harness.config import load_config
from harness.job.launch import run_job
from harness.quorum import rule
from runtime.journal import HEALED, STEP_COMMIT, Journal

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "train_ddp.py"
STEPS = 100_000  # open-ended: the test stops the job once it has seen what it needs

# The stranger: heartbeats made-up ids to the tree quorum and through the tap from the start
# (every 0.1 s, as a Manager does), until told on stdin what a local user could find out; then
# asks for quorums at the job's last step and prints every status code it got (JSON).
STRANGER = r"""
import collections, json, sys, threading
import grpc
from harness.quorum.wire import SERVICE, encode_field

tree, tap = sys.argv[1].split("://")[-1], sys.argv[2].split("://")[-1]
GHOSTS = [f"replica_{i}:ghost{i}" for i in range(10)]
beats = {"tree": collections.Counter(), "tap": collections.Counter()}
stop = threading.Event()

def call(channel, method, payload, timeout):
    try:
        channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=timeout)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name

def beat():
    channels = {name: grpc.insecure_channel(addr) for name, addr in (("tree", tree), ("tap", tap))}
    while not stop.is_set():
        for name, channel in channels.items():
            for ghost in GHOSTS:
                beats[name][call(channel, "Heartbeat", encode_field(1, ghost.encode()), 2)] += 1
        stop.wait(0.1)

def member(rid, step):
    return encode_field(1, encode_field(1, rid.encode()) + encode_field(2, b"http://127.0.0.1:1/evil")
        + encode_field(3, known["store"].encode()) + encode_field(4, step) + encode_field(5, 1))

threading.Thread(target=beat, daemon=True).start()
known = json.loads(sys.stdin.readline())
top, quorums = known["step"], {}
with grpc.insecure_channel(tap) as channel:
    quorums["tap, made-up id"] = call(channel, "Quorum", member("train_ddp_0:evil", top), 5)
    for rid in known["ids"]:
        quorums["tap, the program's own id"] = call(channel, "Quorum", member(rid, top), 5)
with grpc.insecure_channel(tree) as channel:
    for rid in ("train_ddp_0:evil", "replica_0:evil", f"replica_0.0.{'f' * 16}.0:evil"):
        quorums[f"tree, {rid}"] = call(channel, "Quorum", member(rid, top), 5)
stop.set()
print(json.dumps({"beats": {k: dict(v) for k, v in beats.items()}, "quorums": quorums}), flush=True)
"""


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(420)
def test_strangers_are_refused_and_the_program_trains_and_recovers_from_a_kill(
    tmp_path: Path,
) -> None:
    command = ["python", str(PROGRAM), str(STEPS), "0.02"]
    cfg = load_config(
        str(ROOT / "experiments" / "tiny.toml"),
        [
            "replicas=2",
            "ranks=1",
            f"steps={STEPS}",
            "recovery.quorum=tree",
            f"program.command={json.dumps(command)}",
            "program.start_timeout_s=120",
        ],
    )
    journal = Journal(tmp_path / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    records: list[dict[str, Any]] = []
    journal.add_sink(records.append)
    found: dict[str, Any] = {"members": set()}
    stop = threading.Event()

    def commits(replica: int, after: float = 0.0) -> list[dict[str, Any]]:
        return [
            r
            for r in list(records)
            if r["event"] == STEP_COMMIT and r.get("replica") == replica and r["t"] > after
        ]

    def sample_members(job: Any) -> None:
        tree = job.quorum.tree  # the tree quorum behind the tap (harness.quorum.service)
        while not stop.is_set():
            quorum = tree.last_quorum()
            if quorum is not None:
                found["members"].update(quorum.replica_ids)
            time.sleep(0.05)

    def watch(job: Any) -> None:
        stranger = None
        try:
            threading.Thread(target=sample_members, args=(job,), daemon=True).start()
            stranger = subprocess.Popen(
                [sys.executable, "-c", STRANGER, job.quorum.address, job.groups_kind.tap.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            t_beats = time.time()
            # Both groups start and commit while the stranger beats.
            for r in (0, 1):
                _wait(lambda r=r: len(commits(r, t_beats)) >= 5, 180, f"group {r} committing")
            group = job.groups_kind._groups[0]  # what a local user can learn: the store, the ids
            known = {"store": group.store, "ids": sorted(group.ids), "step": cfg.steps}
            assert stranger.stdin is not None and stranger.stdout is not None
            stranger.stdin.write(json.dumps(known) + "\n")
            stranger.stdin.flush()
            found["stranger"] = json.loads(stranger.stdout.readline() or "{}")
            t_done = time.time()
            found["committed_while_beating"] = {r: len(commits(r, t_beats)) for r in (0, 1)}
            found["after_attack"] = {r: len(commits(r, t_done)) for r in (0, 1)}

            # A kill: the group comes back, heals from the survivor, and commits again.
            (pid,) = job.faults.pids(Target(replica=0))
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            _wait(
                lambda: any(
                    r["event"] == HEALED and r.get("replica") == 0 and r["t"] > t_kill
                    for r in list(records)
                ),
                240,
                "group 0 healed after the kill",
            )
            healed = min(
                r["t"]
                for r in list(records)
                if r["event"] == HEALED and r.get("replica") == 0 and r["t"] > t_kill
            )
            for r in (0, 1):
                _wait(lambda r=r: len(commits(r, healed)) >= 3, 120, f"group {r} after the heal")
            found["incarnation"] = job.groups_kind._groups[0].incarnation
        except BaseException as e:
            found["error"] = e
        finally:
            if stranger is not None and stranger.poll() is None:
                stranger.kill()
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
    print(
        f"stranger: {found['stranger']}; commits while it beat: {found['committed_while_beating']}"
    )

    # Every call of the stranger was refused, at once and without reaching anyone.
    beats, quorums = found["stranger"]["beats"], found["stranger"]["quorums"]
    assert set(beats["tree"]) == {"PERMISSION_DENIED"}, beats
    assert set(beats["tap"]) == {"PERMISSION_DENIED"}, beats
    assert "tap, the program's own id" in quorums
    assert set(quorums.values()) == {"PERMISSION_DENIED"}, quorums
    # The groups committed while it beat, and went on after it asked.
    assert all(n >= 5 for n in found["committed_while_beating"].values())
    # No quorum had a member the job did not start: each is a tagged incarnation's Manager
    # (the tap's name for it: the tag, then the program's own id).
    assert found["members"]
    for rid in found["members"]:
        parsed = rule.parse_member_id(rid)
        assert parsed is not None, rid
        assert rid.split(":", 1)[1].startswith(f"train_ddp_{parsed.replica}:"), rid
    assert found["incarnation"] == 1
