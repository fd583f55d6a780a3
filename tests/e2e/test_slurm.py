"""Jobs on a real SLURM cluster: slurmctld on this machine, one slurmd per network namespace
(``bin/test-cluster``, started once for this module and torn down after it). Every agent is a
job step on its node; node failures kill a node's slurmd and every process in its namespace.

Needs root and Debian's slurm-wlm and munge (``bin/setup``); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import (
    after_step,
    events,
    kill_group,
    run_ok,
    tiny_cfg,
    train_on_then_stop,
    wait_until,
)

from runtime.launchers import netns, slurm

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "bin" / "test-cluster"
STATE = "/tmp/ftharness-slurm"  # bin/test-cluster's default: one cluster per machine

_ok, _why = netns.available()
_slurm_ok, _slurm_why = slurm.available()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not _ok, reason=_why),
    pytest.mark.skipif(not _slurm_ok, reason=_slurm_why),
]

FAST = ("timeouts.host_timeout=2.0", "timeouts.controller_silence=4.0", "recovery.quorum=tree")
HEAL_OVER_DATAPLANE = ("transport=dataplane", "timeouts.process_group_timeout=10")


def _until_stopped(*overrides: str):
    """Two groups on SLURM (``FAST``) training until the test's stop event: steps far away."""
    return tiny_cfg("launcher=slurm", "replicas=2", "steps=100000", *overrides, *FAST)


def _cluster(*args: str) -> str:
    env = {**os.environ, "FTHARNESS_SLURM_DIR": STATE}
    done = subprocess.run(
        [str(CLUSTER), *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, f"test-cluster {' '.join(args)}: {done.stderr}{done.stdout}"
    return done.stdout


@pytest.fixture(scope="module")
def cluster():
    _cluster("up", "3")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = f"{STATE}/slurm.conf"
    try:
        yield
    finally:
        _cluster("down")
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@contextlib.contextmanager
def allocation(monkeypatch, nodes: int):
    """An allocation of ``nodes`` nodes (``salloc --no-shell --no-kill``), its environment set
    in this process as salloc sets it for its command; cancelled afterwards."""
    done = subprocess.run(
        ["salloc", f"-N{nodes}", "--no-kill", "--no-shell", "-t", "15", "-J", "ftharness-test"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Granted job allocation (\d+)", done.stderr)
    assert m, done.stderr
    job = m.group(1)
    try:
        nodelist = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
        monkeypatch.setenv("SLURM_NNODES", str(nodes))
        yield job
    finally:
        subprocess.run(["scancel", job], timeout=20)


def _revive_all() -> None:
    for node in ("n1", "n2", "n3"):
        _cluster("revive", node)


@contextlib.contextmanager
def nodes(monkeypatch, n: int):
    """:func:`allocation` of ``n`` nodes, and every node of the cluster revived afterwards (a
    test may have failed one): what each test that fails nodes runs its job in."""
    try:
        with allocation(monkeypatch, n) as job:
            yield job
    finally:
        _revive_all()


def test_a_two_node_job_trains_to_its_last_step(cluster, tmp_path, monkeypatch):
    with allocation(monkeypatch, 2):
        cfg = tiny_cfg("launcher=slurm", "replicas=2", "steps=25", *FAST)
        records = run_ok(cfg, tmp_path, timeout=200)
    commits = [r for r in records if r["event"] == "step.commit"]
    assert max(r["step"] for r in commits) >= 25
    assert {(r["replica"], r["host"]) for r in commits} == {(0, "n1"), (1, "n2")}
    assert max(r["participants"] for r in commits) == 2  # the groups met across nodes
    # each agent ran as its own step on its node, with the node's own address
    starts = [r for r in records if r["event"] == "proc.start"]
    assert {r["host"] for r in starts} == {"n1", "n2"}


def test_a_failed_nodes_groups_restart_on_the_spare_node(cluster, tmp_path, monkeypatch):
    """n1 fails (its slurmd and every process of the node killed): its group restarts on the
    spare n3 and heals from n2's group; replicas are equal after the heal; SLURM marks n1 down
    and it is never chosen again."""
    cfg = _until_stopped("slurm.spare_nodes=1", *HEAL_OVER_DATAPLANE)
    stop = threading.Event()
    seen: dict[str, object] = {}

    def started(job):
        def fail():
            seen["spares"] = sorted(job.site.slurm.spares)
            seen["t"] = time.time()
            job.faults.fail_node("n1")
            deadline = time.monotonic() + 150
            wait_until(lambda: job.group_host(0) != "n1", deadline)
            seen["moved_to"] = job.group_host(0)
            # SLURM marks it not responding / down (SlurmdTimeout=10)
            wait_until(lambda: "n1" in job.site.slurm.gone, deadline, poll_s=0.2)
            seen["gone"] = job.site.slurm.gone.get("n1")
            train_on_then_stop(job, 15, stop, deadline)

        after_step(job, 10, fail)

    with nodes(monkeypatch, 3):
        # (run_ok checks that replicas are bitwise equal at every step both groups committed)
        records = run_ok(cfg, tmp_path, on_started=started, stop_event=stop, timeout=240)
    assert seen["spares"] == ["n3"]
    assert seen["moved_to"] == "n3", seen
    assert seen["gone"], "SLURM never showed the failed node unusable"
    failures = [r for r in records if r["event"] == "failure" and r.get("replica") == 0]
    assert failures and failures[0]["cause"] == "lost_host", failures
    t_fail = failures[0]["t"]
    after = [r for r in records if r["event"] == "step.commit" and r["t"] > t_fail]
    assert {r["host"] for r in after if r["replica"] == 0} == {"n3"}
    assert {r["host"] for r in after if r["replica"] == 1} == {"n2"}
    joint = [r for r in after if r["participants"] == 2 and r.get("checksum")]
    assert joint, "the groups never committed together after the heal"
    phases = [r["phase"] for r in records if r["event"] == "recovery.phase" and r["replica"] == 0]
    assert "participating" in phases


def _tiny_toml(tmp_path: Path, file: str, **values: object) -> Path:
    """experiments/tiny.toml with top-level values and checkpoint.every_steps replaced."""
    text = (ROOT / "experiments" / "tiny.toml").read_text()
    for key, value in values.items():
        if key == "every_steps":
            text = re.sub(r"(?m)^every_steps = \d+", f"every_steps = {value}", text)
        else:
            text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {json.dumps(value)}", text)
    path = tmp_path / f"{file}.toml"
    path.write_text(text)
    return path


def _submit(tmp_path: Path, config: Path, run: Path, *extra: str, nodes: int = 2) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "harness", "slurm", "submit", str(config), "--nodes", str(nodes),
         "--out", str(run), *extra],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads((run / "slurm.json").read_text())["job_id"]


def _wait_state(job_id: str, states: tuple[str, ...], timeout: float) -> str:
    from experiments.slurm_submit import job_state

    deadline = time.monotonic() + timeout
    state = job_state(job_id)
    while state not in states and time.monotonic() < deadline:
        time.sleep(0.5)
        state = job_state(job_id)
    return state


def test_slurm_submit_runs_a_job_to_completion_and_writes_its_report(cluster, tmp_path):
    config = _tiny_toml(tmp_path, "sub", name="sub", steps=20, replicas=2)
    run = tmp_path / "run"
    job_id = _submit(tmp_path, config, run, "--", "--time=5")
    script = (run / "sbatch.sh").read_text()
    assert "#SBATCH --no-kill" in script and "#SBATCH --time=5" in script
    state = _wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 200)
    assert state == "COMPLETED", (run / f"slurm-{job_id}.out").read_text()
    report = json.loads((run / "run" / "report.json").read_text())
    assert report["summary"]
    end = [r for r in events(run / "run") if r["event"] == "job.end"]
    assert end and end[0]["status"] == "ok" and end[0]["steps"] >= 20
    status = subprocess.run(
        [sys.executable, "-m", "harness", "slurm", "status", str(run)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert "COMPLETED" in status.stdout and "report.json" in status.stdout


def test_the_time_limit_signal_gives_a_checkpoint_and_a_report(cluster, tmp_path):
    """SLURM's signal before the time limit (here sent now, as --signal=B:USR1@120 would send
    it): the batch script passes it to the controller, which checkpoints at the next step
    (every_steps is far away), stops cleanly, and the report is written."""
    config = _tiny_toml(
        tmp_path, "limit", name="limit", steps=1000000, replicas=2, every_steps=100000
    )
    run = tmp_path / "run"
    job_id = _submit(tmp_path, config, run)
    journal = run / "run" / "journal.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and (
        not journal.exists() or journal.read_text().count('"step.commit"') < 20
    ):
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    state = _wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 150)
    assert state == "COMPLETED", (run / f"slurm-{job_id}.out").read_text()
    records = events(run / "run")
    limit = [r for r in records if r["event"] == "slurm.time_limit"]
    assert limit and limit[0]["checkpoint_step"] is not None, limit
    saves = [r for r in records if r["event"] == "checkpoint.save"]
    assert [r["step"] for r in saves] == [limit[0]["checkpoint_step"]]
    assert Path(saves[0]["path"]).exists()
    end = [r for r in records if r["event"] == "job.end"]
    assert end[0]["status"] == "ok"
    assert (run / "run" / "report.json").exists()


def test_a_drained_node_is_never_chosen(cluster, tmp_path, monkeypatch):
    """The spare n3 is drained (an operator's `scontrol update State=DRAIN`), then n1 fails:
    n1's group goes to n2, not to the drained spare."""
    cfg = _until_stopped("slurm.spare_nodes=1", "slurm.poll_s=0.5")
    stop = threading.Event()
    seen: dict[str, object] = {}

    def scontrol_n3(state: str) -> None:
        subprocess.run(
            ["scontrol", "update", "NodeName=n3", f"State={state}", "Reason=ftharness-test"],
            check=True, timeout=30,
        )  # fmt: skip

    def started(job):
        def drain_then_fail():
            deadline = time.monotonic() + 150
            scontrol_n3("DRAIN")
            wait_until(lambda: "n3" in job.site.slurm.gone, deadline, poll_s=0.1)
            seen["gone"] = job.site.slurm.gone.get("n3")
            job.faults.fail_node("n1")
            wait_until(lambda: job.group_host(0) != "n1", deadline)
            seen["moved_to"] = job.group_host(0)
            train_on_then_stop(job, 10, stop, deadline)

        after_step(job, 10, drain_then_fail)

    with nodes(monkeypatch, 3):
        try:
            records = run_ok(cfg, tmp_path, on_started=started, stop_event=stop, timeout=240)
        finally:
            scontrol_n3("RESUME")  # before the revive, which waits for every node to be usable
    assert "drain" in str(seen["gone"]), seen
    assert seen["moved_to"] == "n2", seen
    starts = [r for r in records if r["event"] == "proc.start" and r.get("replica") is not None]
    assert "n3" not in {r["host"] for r in starts}


def test_with_replace_new_job_slurm_gives_a_node_for_the_one_it_took(
    cluster, tmp_path, monkeypatch
):
    """A 2-node job with no spare and slurm.replace = "new_job": n1 fails, its group doubles up
    on n2; once SLURM shows n1 unusable a single-node job is submitted, its node (n3) joins as a
    spare with a ready agent, and the next group that needs a host (group 0, killed) gets it."""
    cfg = _until_stopped("slurm.replace=new_job", "slurm.poll_s=0.5", *HEAL_OVER_DATAPLANE)
    stop = threading.Event()
    seen: dict[str, object] = {}

    def started(job):
        def fail_then_replace():
            deadline = time.monotonic() + 200
            job.faults.fail_node("n1")
            hosts = job.controller.hosts
            wait_until(lambda: "n3" in hosts and not hosts["n3"].lost, deadline, poll_s=0.1)
            seen["replacement_job"] = job.site.slurm.node_job.get("n3")
            seen["spare"] = "n3" in job.site.slurm.spares
            # a node that joins later holds no group until its own preflight round has passed
            # (harness.job.hosts): group 0 killed before that goes to n2 (seen in CI)
            wait_until(lambda: job.hosts.checked("n3"), deadline, poll_s=0.1)
            kill_group(job, 0)
            wait_until(lambda: job.group_host(0) == "n3", deadline)
            seen["moved_to"] = job.group_host(0)
            train_on_then_stop(job, 10, stop, deadline)

        after_step(job, 10, fail_then_replace)

    with nodes(monkeypatch, 2) as job_id:
        records = run_ok(cfg, tmp_path, on_started=started, stop_event=stop, timeout=280)
    assert seen["replacement_job"] not in (None, job_id) and seen["spare"], seen
    assert seen["moved_to"] == "n3", seen
    late = [r for r in records if r["event"] == "step.commit" and r["replica"] == 0]
    assert late[-1]["host"] == "n3"
    left = subprocess.run(
        ["squeue", "-h", "-j", str(seen["replacement_job"]), "-o", "%T"],
        capture_output=True, text=True, timeout=20,
    ).stdout.strip()  # fmt: skip
    assert left in ("", "COMPLETING", "CANCELLED"), f"the replacement job is still {left}"


def test_chaos_with_launcher_slurm_reports_the_node_failure_recovery(cluster, tmp_path):
    """`salloc -N3 --no-kill ftharness chaos EXP --launcher slurm`, as a user runs it:
    experiments/slurm_node_loss.toml shortened to one node_failure; its report.json has that
    recovery with its participate_s, and the hypotheses pass."""
    text = (ROOT / "experiments" / "slurm_node_loss.toml").read_text()
    text = text.replace("duration_s = 80", "duration_s = 40\nsettle_s = 4")  # ends once recovered
    text = text.replace("at_times = [20, 40, 60]", "at_times = [10]")
    text = text.replace("mix = { node_failure = 1, kill = 1 }", "mix = { node_failure = 1 }")
    text = text.replace('launcher = "slurm"\n', "")  # from the command line instead
    exp = tmp_path / "exp.toml"
    exp.write_text(text)
    out = tmp_path / "run"
    try:
        done = subprocess.run(
            ["salloc", "-N3", "--no-kill", "-t", "10", sys.executable, "-m", "harness", "chaos",
             str(exp), "--launcher", "slurm", "--out", str(out), "--quiet"],
            capture_output=True, text=True, timeout=240, cwd=ROOT,
        )  # fmt: skip
    finally:
        _revive_all()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    recoveries = report["summary"]["policies"]["in_place"]["recoveries"]
    failures = [r for r in recoveries if r["kind"] == "node_failure"]
    assert len(failures) == 1 and failures[0]["participate_s"] is not None, recoveries
    assert report["passed"], report["hypotheses"]


def _ftharness_processes(run: Path) -> list[str]:
    """Processes of the run still alive anywhere on this machine (every node is a namespace of
    it): the controller, and each agent and its forks, whose command lines name the run dir."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run) in cmd and "pytest" not in cmd:
            left.append(f"{p.info['pid']}: {cmd[:200]}")
    return left


def test_a_cancelled_allocation_ends_the_run_within_seconds(cluster, tmp_path, monkeypatch):
    """`scancel` of the allocation under a running `ftharness run --launcher slurm` (as an
    salloc that is revoked: salloc signals nothing to its command): ftharness sees the job gone,
    says so, exits with rc 1 within seconds, leaves no process on any node, and its last
    checkpoint is on disk and loads."""
    from harness.rank.checkpoint import load_latest

    config = _tiny_toml(tmp_path, "cancel", name="cancel", steps=1000000, replicas=2, every_steps=5)
    run = tmp_path / "run"
    journal = run / "journal.jsonl"
    sets = [a for kv in FAST for a in ("--set", kv)]
    with allocation(monkeypatch, 2) as job_id:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness", "run", str(config), "--launcher", "slurm",
             "--out", str(run), *sets],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        try:
            wait_until(
                lambda: journal.exists() and journal.read_text().count('"checkpoint.save"') >= 2,
                time.monotonic() + 150,
                poll_s=0.5,
            )
            t0, t_cancel = time.monotonic(), time.time()
            subprocess.run(["scancel", job_id], check=True, timeout=30)
            _, err = proc.communicate(timeout=60)
            seconds = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert seconds < 30, (seconds, err[-3000:])
    assert f"SLURM job {job_id} is" in err and "the allocation ended" in err, err[-3000:]
    assert "could not restart the agent" not in err, err[-3000:]
    records = events(run)
    end = [r for r in records if r["event"] == "job.end"]
    assert end and end[0]["status"] == "failed" and f"SLURM job {job_id}" in end[0]["reason"]
    print(f"scancel -> job.end {end[0]['t'] - t_cancel:.1f} s, -> exit {seconds:.1f} s")
    saves = [r for r in records if r["event"] == "checkpoint.save"]
    assert saves, "no checkpoint was written before the cancel"
    latest = load_latest(Path(saves[-1]["path"]).parent)
    assert latest is not None, "the last checkpoint does not load"
    assert latest[0] >= saves[-1]["step"], (latest[0], saves[-1])
    deadline = time.monotonic() + 10  # SLURM's KillWait is 5 s on the test cluster
    wait_until(lambda: not _ftharness_processes(run), deadline, poll_s=0.5)
    assert not _ftharness_processes(run), _ftharness_processes(run)


def test_a_cancelled_batch_job_ends_its_run_with_the_reason(cluster, tmp_path):
    """`scancel` of a job submitted with `ftharness slurm submit`: SLURM sends SIGTERM to the
    batch script and the controller; the run stops within SLURM's KillWait with the reason in
    the journal (job.end failed), and nothing of it is left running."""
    config = _tiny_toml(tmp_path, "bcancel", name="bcancel", steps=1000000, replicas=2)
    run = tmp_path / "run"
    job_id = _submit(tmp_path, config, run)
    journal = run / "run" / "journal.jsonl"
    assert wait_until(
        lambda: journal.exists() and journal.read_text().count('"step.commit"') >= 20,
        time.monotonic() + 150,
        poll_s=0.5,
    ), f"job {job_id} never trained"
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    state = _wait_state(job_id, ("CANCELLED", "FAILED", "COMPLETED", "TIMEOUT"), 60)
    assert state == "CANCELLED", state
    end = [r for r in events(run / "run") if r["event"] == "job.end"]
    assert end and end[0]["status"] == "failed", end
    # SLURM's SIGTERM, or the launcher seeing the job gone first: either names the cause
    reason = end[0]["reason"]
    assert "SLURM is ending the job" in reason or f"SLURM job {job_id} is" in reason, reason
    wait_until(lambda: not _ftharness_processes(run), time.monotonic() + 10, poll_s=0.5)
    assert not _ftharness_processes(run), _ftharness_processes(run)


def test_the_controllers_node_lost_the_run_goes_on_from_another_node(cluster, tmp_path):
    """``slurm.controller_node = "reserved"``: n1 (the batch script's node) runs only the keeper
    and the controller, n2 and n3 a group each, and the keeper's standby waits on n3. n1 fails
    (its slurmd and every process of the node killed): the standby takes the run over on n3,
    the agents re-dial it and their quorum relays follow it; no group restarts, no committed
    step is lost, and the run ends ok with its report (harness.keeper.standby_node)."""
    from runtime.launchers.slurm_testcluster import fail_node

    config = _tiny_toml(tmp_path, "moved", name="moved", steps=400, replicas=2)
    config.write_text(config.read_text() + '\n[slurm]\ncontroller_node = "reserved"\n')
    run = tmp_path / "run"
    job_id = _submit(tmp_path, config, run, "--", "--time=10", nodes=3)
    journal = run / "run" / "journal.jsonl"
    try:
        assert wait_until(
            lambda: journal.exists() and journal.read_text().count('"step.commit"') >= 60,
            time.monotonic() + 150,
            poll_s=0.2,
        ), f"job {job_id} never trained: {(run / f'slurm-{job_id}.out').read_text()}"
        keeper = json.loads((run / "run" / "keeper.json").read_text())
        assert keeper["host"] == "n1" and keeper["beat"], keeper
        t_fail = time.time()
        fail_node("n1")
        state = _wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240)
    finally:
        _revive_all()
    standby_out = run / "run" / "logs" / "standby-n3.out"
    said = standby_out.read_text() if standby_out.exists() else "(no standby output)"
    records = events(run / "run")
    end = [r for r in records if r["event"] == "job.end"]
    assert end and end[-1]["status"] == "ok" and end[-1]["steps"] >= 400, (end, said)
    # the standby ended the allocation (its batch step died with n1) once the run had ended
    assert state == "CANCELLED", (state, said)
    assert json.loads((run / "run" / "keeper.json").read_text())["host"] == "n3"
    takeovers = [r for r in records if r["event"] == "controller.takeover"]
    assert takeovers, said
    # nothing restarted: one start per group, no failure of a group
    starts = [r for r in records if r["event"] == "group.start"]
    assert sorted(r["replica"] for r in starts) == [0, 1], starts
    assert not [r for r in records if r["event"] == "failure" and "replica" in r]
    commits = sorted(r["t"] for r in records if r["event"] == "step.commit")
    after = [t for t in commits if t > t_fail]
    before = max(t for t in commits if t <= t_fail)
    assert after and after[0] - before <= 30.0, (after[0] - before, said)
    # every step committed once per group: none went back, none was lost
    for replica in (0, 1):
        steps = [
            r["step"] for r in records if r["event"] == "step.commit" and r["replica"] == replica
        ]
        assert steps == sorted(set(steps)), replica
    assert (run / "run" / "report.json").exists()
