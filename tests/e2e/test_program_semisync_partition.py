"""A network partition of a semi-synchronous program of the user's own (issue #29 item 3):
tests/programs/train_diloco.py, a plain torchft DiLoCo program that never imports ftharness, as a
job of 3 replica groups on 3 test hosts with networks of their own (``launcher = "netns"``, one
group per host), under both quorum backends. One host is cut off mid-run for longer than
``timeouts.controller_silence``: the controller declares it lost, its group is restarted on
another host and heals from a peer across namespaces, and the cut-off host fences itself.

What a user would check: the experiment passes with the partition recovered (a survivors'
stall and a time to participate in the report); the cut-off incarnation never commits after it
was fenced (every later commit of its group comes from the replacement, on another host); the
replacement healed from a peer (its first sync is past the job's first) and, at every sync it
shares with a peer, holds the peer's parameters and outer optimizer state, by the checksums the
program prints per sync.

Needs root (CI is root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import events, no_leftover_namespaces, run_chaos, sync_checksums

from runtime.launchers import netns

ok, why = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not ok, reason=why)]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "train_diloco.py"
STEPS = 800  # inner steps: 80 syncs
SYNC_EVERY = 10
AT_STEP = 150  # the partition, in inner steps
CUT = "host1"  # runs group 1 only: host0 runs torchft's Lighthouse (quorum = "torchft")
REPLICA = 1

# host_timeout < controller_silence < hold_s: the host is declared lost (its group restarted
# elsewhere) while cut off, and its agent fences itself (stops the program) before the link is
# back. The program's gloo timeout (4 s) stays below the progress timeout, which is generous so
# that a survivor's stall on the cut-off group is not taken for a hang.
EXPERIMENT = """\
name = "semisync_partition"
description = "A DiLoCo program on 3 namespace hosts: one host cut off mid-run."
seed = 1
policies = ["in_place"]
duration_s = 120                      # an upper bound; the job ends when every group finished

[job]
name = "semisync_partition"
launcher = "netns"
replicas = 3
ranks = 1
hosts = 3
steps = {steps}
timeouts = {{ heartbeat_interval = 0.2, heartbeat_timeout = 2.0, lighthouse_join_timeout = 4.0, \
process_group_timeout = 3.0, host_timeout = 2.0, controller_silence = 4.0 }}
recovery = {{ policy = "in_place", quorum = "{quorum}", max_restarts = 20, within_s = 600.0 }}

[job.program]
kind = "torchft"
# STEPS SYNC_EVERY STEP_SECONDS PG_TIMEOUT_S
command = ["python", {program}, "{steps}", "{sync_every}", "0.01", "4"]
sync_every = {sync_every}
progress_timeout_s = 20.0
start_timeout_s = 90.0
# Off: the program's gloo timeout (4 s) ends a survivor's wait on the cut-off host about when the
# rule would restart it (2 s after the host is declared lost); this test is about the cut-off
# group alone. tests/e2e/test_program_fastpath.py tests the rule.
survivor_grace_s = 0.0

[schedule]
kind = "at_steps"
at_steps = [{at_step}]

[faults]
mix = {{ network_partition = 1 }}

[faults.options.network_partition]
hold_s = 6.0

[targets]
kind = "default"
hosts = ["{cut}"]

[hypotheses]
committed_steps_rise = true
every_fault_recovered = true
journal_complete = true
no_orphans = true
"""


_no_leftover_namespaces = pytest.fixture(autouse=True)(no_leftover_namespaces)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("quorum", ["tree", "torchft"])
def test_a_partitioned_semisync_group_is_replaced_and_heals_to_its_peers_state(tmp_path, quorum):
    (tmp_path / "exp.toml").write_text(
        EXPERIMENT.format(
            steps=STEPS,
            sync_every=SYNC_EVERY,
            at_step=AT_STEP,
            quorum=quorum,
            program=json.dumps(str(PROGRAM)),
            cut=CUT,
        )
    )
    report, _ = run_chaos(tmp_path, ROOT)
    run = tmp_path / "run" / "in_place"
    passed = {h["name"]: h["passed"] for h in report["hypotheses"]}
    assert passed.get("every_fault_recovered[in_place]") is True, report["hypotheses"]

    # the partition's recovery: group 1's, with a survivors' stall and a time to participate
    recs = report["summary"]["policies"]["in_place"]["recoveries"]
    mine = [r for r in recs if r["replica"] == REPLICA]
    assert len(mine) == 1 and mine[0]["kind"] == "network_partition", recs
    rec = mine[0]
    for key in ("detection_s", "stall_s", "participate_s", "steps_lost"):
        assert rec[key] is not None, (key, rec)
    assert {"detected", "replacement_started", "healed", "participating"} <= set(rec["phases"])

    # the host was declared lost, and the group restarted on another host
    failures = [r for r in events(run, "failure") if r.get("replica") == REPLICA]
    assert failures and failures[0]["cause"] == "lost_host", failures
    t_fence = failures[0]["t"]
    starts = [r for r in events(run, "group.start") if r["replica"] == REPLICA]
    assert [s["incarnation"] for s in starts] == [0, 1], starts
    assert starts[0]["host"] == CUT and starts[1]["host"] != CUT, starts
    new_host = starts[1]["host"]

    # the cut-off incarnation never commits after the fence; the replacement does, to the end
    commits = events(run, "step.commit")
    assert all(c["sync_every"] == SYNC_EVERY and c["step"] % SYNC_EVERY == 0 for c in commits)
    before = [c for c in commits if c["replica"] == REPLICA and c["t"] <= t_fence]
    after = [c for c in commits if c["replica"] == REPLICA and c["t"] > t_fence]
    assert before and all(c["host"] == CUT for c in before), before[-3:]
    stale = [c for c in after if c["host"] != new_host]
    assert stale == [], f"the cut-off incarnation committed after it was fenced: {stale[:2]}"
    assert after and max(c["step"] for c in after) == STEPS - SYNC_EVERY, after[-3:]
    for r in range(3):  # every group trained to the job's last sync
        assert max(c["step"] for c in commits if c["replica"] == r) == STEPS - SYNC_EVERY, r
    healed = [h for h in events(run, "trainer.healed") if h["t"] > t_fence]
    # The replacement healed. A survivor may heal too, from the other survivor: when the cut fell
    # inside a sync's ring allreduce, one survivor's completed and the other's timed out, so the
    # latter is a sync behind at the next quorum (torchft heals every member below max_step).
    # Either way the checksums below show every group holding its peers' state.
    replaced = [h for h in healed if h["replica"] == REPLICA]
    assert replaced, healed
    assert replaced[0]["host"] == new_host and replaced[0]["step"] > AT_STEP, healed

    # the replacement healed from a peer (its first sync is past the job's first) and, at every
    # sync it shares with a peer, holds the peer's parameters and outer optimizer state
    logs = {r: sync_checksums(run / "logs" / f"replica{r}-rank0.log") for r in range(3)}
    assert [len(logs[r]) for r in range(3)] == [1, 2, 1], {r: len(v) for r, v in logs.items()}
    survivors = [logs[0][0], logs[2][0]]
    common = sorted(set(survivors[0]) & set(survivors[1]))
    assert common and all(survivors[0][s] == survivors[1][s] for s in common), common
    peer = {**survivors[0], **survivors[1]}
    old, new = logs[REPLICA]
    # the cut-off incarnation trained before the cut (from sync 1, or from sync 2 when it started
    # after its peers' first sync, under load, and healed into it: torchft's join at start)
    assert old and min(old) < AT_STEP // SYNC_EVERY and max(old) < min(new), (
        sorted(old),
        sorted(new),
    )
    first = min(new)
    assert first > AT_STEP // SYNC_EVERY, sorted(new)  # healed, not trained from step 0
    assert peer.get(first) == new[first], (first, peer.get(first), new[first])
    for inc in (old, new):
        shared = sorted(set(inc) & set(peer))
        assert shared, sorted(inc)
        differing = [s for s in shared if inc[s] != peer[s]]
        assert not differing, f"replica {REPLICA} differs from its peers at syncs {differing}"
