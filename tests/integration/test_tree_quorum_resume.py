"""The tree quorum survives its controller: a service with a state file is SIGKILLed (its process,
as a controller dies) and a new process resumes it from the file, on a fresh port: the Managers
reach it through their host's relay (``runtime.relay``), which the job points at it. The port
it served on before is never bound again: anyone on the machine could have taken it meanwhile
(issue #49), and is then answered by nobody.

What a user sees: the running torchft Managers never restart; their next quorum requests reach
the new service, which lets them in (same secret and incarnations), numbers its quorums above
every id issued before (no rendezvous on stale keys), and hands out no step lower than one any
member committed. A stale incarnation stays refused, and a torn state file is refused whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from test_tree_quorum import _ask, _beat, _wait_commits
from trainer_procs import commits, start_trainer
from tree_quorum_proc import issued, start_service

from harness.config import CheckpointConfig, JobConfig, TimeoutConfig, config_to_dict
from harness.quorum import durable
from harness.quorum.durable import QuorumStateError
from harness.quorum.service import TreeQuorumService
from runtime.relay import Relay


class _Events:
    def quorum_ids_reset(self) -> None: ...

    def quorum_restarted(self) -> None: ...

    def ask_for_quorum(self) -> None: ...


def _cfg(replicas: int, **timeouts: float) -> JobConfig:
    return JobConfig(
        name="treeq-resume",
        replicas=replicas,
        steps=1_000_000,
        checkpoint=CheckpointConfig(every_steps=0),
        timeouts=TimeoutConfig(**timeouts),
    )


def _kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s whole session and reap it (as a controller dies)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


# --- torchft's own client against a resumed service ----------------------------------------------


def _asking(addr: str, rid: str, out: dict[str, Any], timeout_s: float, **kw: Any) -> Any:
    t = threading.Thread(target=_ask, args=(addr, rid, out, timeout_s), kwargs=kw)
    t.start()
    return t


def _beat_once(addr: str, rids: list[str]) -> None:
    from torchft._torchft import LighthouseClient

    client = LighthouseClient(addr=addr, connect_timeout=timedelta(seconds=5))
    for rid in rids:
        client.heartbeat(rid)


@pytest.mark.timeout(120)
def test_a_resumed_service_waits_for_every_member_it_knew_before_issuing(tmp_path: Path) -> None:
    """After a resume the saved steps are lower bounds only: a member that went on committing
    past its last report (sparse quorum) must take part before any quorum is issued, so the
    quorum's highest step (which torchft heals everyone to) never goes back. A member that shows
    no sign of life holds nothing up past the join timeout; a stale incarnation stays out."""
    cfg = _cfg(4, lighthouse_join_timeout=1.0, lighthouse_heartbeat_timeout=1.0)
    state, log = tmp_path / "quorum.json", tmp_path / "issued"
    proc, info = start_service(config_to_dict(cfg), state, log, admit=4)
    a, b, c, d = (info["member_ids"][str(r)] + f":{n}" for r, n in enumerate("abcd"))
    out: dict[str, Any] = {}
    try:
        _beat_once(info["address"], [a, b, c, d])  # all alive before any asks (as at a start)
        stop = threading.Event()
        beater = threading.Thread(target=_beat, args=(stop, info["address"], [a, b, c, d], 0.1))
        beater.start()
        threads = [
            _asking(info["address"], r, out, 10.0, step=7, world_size=1) for r in (a, b, c, d)
        ]
        for t in threads:
            t.join()
        assert {out[r].quorum_id for r in (a, b, c, d)} == {issued(log)[-1][0]}
        time.sleep(1.0)  # the background writer saved the steps
        stop.set()
        beater.join()
    finally:
        _kill(proc)
    before = [qid for qid, _ in issued(log)]

    resumed = TreeQuorumService.resume(cfg, _Events(), state)
    try:
        addr = resumed.address
        assert addr.rsplit(":", 1)[0] == info["address"].rsplit(":", 1)[0]  # the same host
        # a went on to step 9 without a quorum and heartbeats; d died (no sign of life).
        _beat_once(addr, [a, b, c])
        stop = threading.Event()
        beater = threading.Thread(target=_beat, args=(stop, addr, [a, b, c], 0.1))
        beater.start()
        out.clear()
        t0 = time.monotonic()
        waiting = [_asking(addr, r, out, 20.0, step=7, world_size=1) for r in (b, c)]
        time.sleep(1.5)  # past the join timeout: torchft's rule alone would issue without a
        ticks = resumed.tree.ticks
        time.sleep(1.0)
        assert not out, f"a quorum without a, who may be ahead: {out}"
        assert resumed.tree.ticks - ticks < 30, "the service polls while it waits"  # 100 at 100 Hz
        assert "known before the resume" in resumed.tree.status()["reason"]
        waiting.append(_asking(addr, a, out, 20.0, step=9, world_size=1))
        for t in waiting:
            t.join()
        for r in (a, b, c):
            q = out[r]
            assert not isinstance(q, Exception), q
            assert sorted(m.replica_id for m in q.participants) == [a, b, c]
            assert max(m.step for m in q.participants) == 9
            assert q.quorum_id > max(before)
        assert time.monotonic() - t0 < 15
        stop.set()
        beater.join()
        # The group's next incarnation is admitted: its old one is refused from now on.
        new_b = resumed.admit(1, 1) + ":b1"
        out.clear()
        _ask(addr, b, out, 5.0, step=9)
        assert f"{b} was declared failed" in str(out[b])
        stale = b.split(":")[0] + ":fresh-uuid"  # the old incarnation's tag, any torchft uuid
        _ask(addr, stale, out, 5.0, step=9)
        assert "replaced by incarnation 1" in str(out[stale])
        assert new_b.startswith("replica_1.1.")
    finally:
        resumed.shutdown()


@pytest.mark.timeout(120)
def test_quorum_ids_are_never_reused_across_many_resumes(tmp_path: Path) -> None:
    """Three services in turn, each SIGKILLed after issuing quorums of changing membership (each
    change a new id), each resumed from the file the last one left: every id is new."""
    cfg = _cfg(3, lighthouse_join_timeout=1.0, lighthouse_heartbeat_timeout=3.0)
    state, log = tmp_path / "quorum.json", tmp_path / "issued"
    ids: list[int] = []
    members: dict[str, str] = {}
    prev: list[str] = []
    for life in range(3):
        proc, info = start_service(config_to_dict(cfg), state, log, resume=life > 0, admit=3)
        members = members or info["member_ids"]
        a, b, c = (members[str(r)] + f":{r}" for r in range(3))
        try:
            for group in ([a], [a, b], [a, b, c], [b, c]):
                # Newcomers ask first: the members of the last quorum alone would make a fast
                # quorum of themselves.
                out: dict[str, Any] = {}
                new = [r for r in group if r not in prev]
                threads = [_asking(info["address"], r, out, 10.0, step=life + 1) for r in new]
                time.sleep(0.3)
                threads += [
                    _asking(info["address"], r, out, 10.0, step=life + 1)
                    for r in group
                    if r in prev
                ]
                for t in threads:
                    t.join()
                got = {out[r].quorum_id for r in group}
                assert len(got) == 1, out
                ids.append(got.pop())
                prev = group
        finally:
            _kill(proc)
        assert [qid for qid, _ in issued(log)][-4:] == ids[-4:]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    assert json.loads(state.read_text())["quorum_id_lease"] > max(ids)


@pytest.mark.timeout(60)
def test_a_torn_state_file_is_refused_and_nothing_serves(tmp_path: Path) -> None:
    cfg = _cfg(2)
    state, log = tmp_path / "quorum.json", tmp_path / "issued"
    proc, _ = start_service(config_to_dict(cfg), state, log, admit=2)
    _kill(proc)
    whole = state.read_bytes()
    state.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(QuorumStateError, match=r"quorum\.json: not valid JSON"):
        TreeQuorumService(cfg, _Events(), state, resume=True)
    # In a process of its own, as a keeper starts one: it says why and serves nothing.
    proc, said = start_service(config_to_dict(cfg), state, log, resume=True)
    assert proc.wait(timeout=30) == 3
    assert str(state) in said["error"] and "torn or truncated" in said["error"]


@pytest.mark.timeout(60)
def test_a_stranger_on_the_saved_port_gets_nothing_and_the_resume_serves_elsewhere(
    tmp_path: Path,
) -> None:
    """Issue #49: the moment a controller dies, its quorum port is free, and anyone on the
    machine can bind it (a loop of bind() got it 0.6 s after a SIGKILL). The resumed service
    binds a fresh port and serves there; the stranger's socket gets no connection."""
    cfg = _cfg(2)
    state, log = tmp_path / "quorum.json", tmp_path / "issued"
    proc, info = start_service(config_to_dict(cfg), state, log, admit=2)
    host, port = info["address"].split("://")[-1].rsplit(":", 1)
    _kill(proc)
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            stranger.bind((host, int(port)))
            break
        except OSError:
            assert time.monotonic() < deadline, "the dead service's port never came free"
            time.sleep(0.02)
    stranger.listen(16)
    stranger.setblocking(False)
    resumed = TreeQuorumService.resume(cfg, _Events(), state)
    try:
        assert resumed.address.rsplit(":", 1)[1] != port
        a, b = (info["member_ids"][str(r)] + f":{r}" for r in range(2))
        out: dict[str, Any] = {}
        _beat_once(resumed.address, [a, b])
        for t in [_asking(resumed.address, r, out, 10.0, step=1) for r in (a, b)]:
            t.join()
        assert not isinstance(out[a], Exception) and out[a].quorum_id == out[b].quorum_id
        with pytest.raises(BlockingIOError):
            stranger.accept()  # nobody dialled the old port
        saved = durable.load(state)
        assert f"{saved.host}:{saved.port}" in resumed.address  # a next takeover starts there
    finally:
        resumed.shutdown()
        stranger.close()


@pytest.mark.timeout(60)
def test_a_crash_of_the_service_restarts_it_in_place_and_it_goes_on_saving(
    tmp_path: Path,
) -> None:
    """The quorum-service fault (``crash``) keeps working with a state file: the service comes
    back in this process on a fresh port (the job points the relays at it), ids go on, and the
    file follows it."""
    restarted: list[bool] = []
    events = _Events()
    events.quorum_restarted = lambda: restarted.append(True)  # type: ignore[method-assign]
    state = tmp_path / "quorum.json"
    service = TreeQuorumService(_cfg(2), events, state)
    service.start()
    try:
        a, b = service.admit(0, 0) + ":a", service.admit(1, 0) + ":b"
        addr = service.address
        ids = []
        for step in (3, 4):
            out: dict[str, Any] = {}
            _beat_once(service.address, [a, b])  # both alive before either asks
            for t in [_asking(service.address, r, out, 10.0, step=step) for r in (a, b)]:
                t.join()
            ids.append({out[a].quorum_id, out[b].quorum_id})
            if step == 3:
                service.crash()
        assert restarted == [True] and service.address != addr
        assert len(ids[0]) == len(ids[1]) == 1 and max(ids[0]) < min(ids[1])
    finally:
        service.shutdown()
    saved = durable.load(state)
    assert saved.quorum_id_lease > max(ids[1]) and saved.incarnations == {0: 0, 1: 0}
    assert f"{saved.host}:{saved.port}" in service.address and set(saved.reported) == {a, b}


# --- whole trainers ------------------------------------------------------------------------------


@pytest.mark.timeout(360)
# every step (torchft's way); the sparse quorum (the default) goes through real takeovers in
# tests/e2e/test_controller_takeover.py
@pytest.mark.parametrize("quorum_every", [1], ids=["quorum_every_step"])
def test_trainers_keep_committing_across_a_sigkilled_and_resumed_service(
    tmp_path: Path, quorum_every: int
) -> None:
    cfg = _cfg(2)
    cfg_dict = config_to_dict(cfg)
    cfg_dict["recovery"]["quorum_every_steps"] = quorum_every
    state, log_a, log_b = tmp_path / "quorum.json", tmp_path / "issued_a", tmp_path / "issued_b"
    service, info = start_service(cfg_dict, state, log_a, admit=2)
    relay = Relay("127.0.0.1")  # the trainers' host agent's, as every tree-quorum job has
    relay.start()
    relay.set_upstream(info["address"])
    journals = [tmp_path / f"g{r}.jsonl" for r in range(2)]
    procs = [
        start_trainer(
            cfg_dict,
            replica_id=r,
            rank=0,
            store_addr=None,
            lighthouse_addr=f"http://{relay.address}",
            journal_path=journals[r],
            member_id=info["member_ids"][str(r)],
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 300
    resumed = None
    try:
        for j in journals:
            _wait_commits(j, 12, procs, deadline)
        time.sleep(0.3)
        _kill(service)
        t_kill = time.time()
        at_kill = [len(commits(j)) for j in journals]
        before = [qid for qid, _ in issued(log_a)]
        time.sleep(1.0)  # the trainers are on their own meanwhile
        resumed, again = start_service(cfg_dict, state, log_b, resume=True)
        relay.set_upstream(again["address"])  # what the job tells every host's agent
        for j, n in zip(journals, at_kill, strict=True):
            _wait_commits(j, n + 12, procs, deadline)
        assert all(p.poll() is None for p in procs), "a trainer restarted"
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        for s in (service, resumed):
            if s is not None and s.poll() is None:
                _kill(s)
        relay.close()

    after = [qid for qid, _ in issued(log_b)]
    assert before and after, (before, after)
    assert min(after) > max(before), (before, after)
    records = [commits(j) for j in journals]
    for rs in records:
        steps = [r["step"] for r in rs]
        assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
        assert any(r["t"] > t_kill and r["participants"] == 2 for r in rs)
    by_step = {r["step"]: r["checksum"] for r in records[0] if r["checksum"] is not None}
    common = [r for r in records[1] if r["checksum"] is not None and r["step"] in by_step]
    assert common and all(r["checksum"] == by_step[r["step"]] for r in common)
    gap = max(b["t"] - a["t"] for rs in records for a, b in pairwise(rs) if b["t"] > t_kill)
    print(
        f"resume ({'sparse' if not quorum_every else 'every step'}): longest commit gap {gap:.2f} s"
    )
