"""SLURM without a cluster: the allocation's environment, node lists and states, the placement
rule with spare and gone nodes, the planner's launcher check, the config's [slurm] section and
the sbatch script `ftharness slurm submit` writes (checked by bash itself)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from faults.schedule import ScheduleSpec, plan
from faults.targets import TargetError, TargetSpec, Topology
from harness.cli import build_parser, main
from harness.config import ConfigError, load_config
from harness.job.placement import HostState, place
from harness.job.slurm import check_allocation
from runtime.launchers.slurm import (
    Allocation,
    SlurmError,
    SlurmLauncher,
    agent_command,
    allocation_from_env,
    expand_nodelist,
    parse_node_states,
    unusable,
)

ROOT = Path(__file__).resolve().parents[2]


# -- the allocation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nodes"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,5],gpu07", ["n1", "n2", "n5", "gpu07"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("a[1-2]b,c", ["a1b", "a2b", "c"]),
    ],
)
def test_node_lists_expand_as_scontrol_does(text, nodes):
    assert expand_nodelist(text) == nodes


def test_a_bad_range_is_an_error():
    with pytest.raises(SlurmError, match="bad range"):
        expand_nodelist("n[3-1]")


def test_the_allocation_comes_from_slurms_environment():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3"}
    alloc = allocation_from_env(env, hostnames=expand_nodelist)
    assert alloc == Allocation(job_id="42", nodes=("n1", "n2", "n3"), this_node=None)
    env["SLURMD_NODENAME"] = "n1"  # in a batch script: the controller runs on the first node
    assert allocation_from_env(env, hostnames=expand_nodelist).this_node == "n1"


def test_outside_an_allocation_the_error_names_slurm_job_id():
    with pytest.raises(SlurmError, match=r"SLURM_JOB_ID is not set.*salloc"):
        allocation_from_env({}, hostnames=expand_nodelist)


def test_a_node_count_that_disagrees_with_the_node_list_is_an_error():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "3"}
    with pytest.raises(SlurmError, match="SLURM_NNODES=3"):
        allocation_from_env(env, hostnames=expand_nodelist)


def test_launcher_slurm_is_refused_before_launch_outside_an_allocation(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("experiments/tiny.toml", ["launcher=slurm"])
    assert "SLURM_JOB_ID" in (check_allocation(cfg) or "")
    assert check_allocation(load_config("experiments/tiny.toml")) is None
    code = main(["run", "experiments/tiny.toml", "--launcher", "slurm", "--out", "/nonexistent"])
    assert code == 2


def test_more_spare_nodes_than_the_allocation_leaves_none_to_train():
    alloc = Allocation(job_id="1", nodes=("n1", "n2"), this_node=None)
    with pytest.raises(SlurmError, match="at least one must train"):
        SlurmLauncher(alloc, "/tmp", spare_nodes=2)


def test_each_agent_is_its_own_one_node_step_and_the_secret_stays_in_a_file():
    cmd = agent_command("n2", "10.0.0.1:4000", "/run/agent.secret", 60)
    assert cmd[:8] == [
        "srun", "--nodes=1", "--ntasks=1", "-w", "n2", "--kill-on-bad-exit=0", "--overlap",
        "--job-name=ftharness-agent-n2",
    ]  # fmt: skip
    tail = cmd[cmd.index("agent") :]
    assert agent_command("n9", "h:1", "/s", 60, job_id="77")[:2] == ["srun", "--jobid=77"]
    assert tail[:7] == [
        "agent", "--controller", "10.0.0.1:4000", "--secret-file", "/run/agent.secret",
        "--name", "n2",
    ]  # fmt: skip


# -- SLURM's view of the nodes ------------------------------------------------------------------
def test_node_states_and_which_are_unusable():
    sinfo = "n1 idle\nn2 mixed*\nn3 down*\nn4 drained\nn5 draining\nn6 allocated\n"
    states = parse_node_states(sinfo)
    assert states == {
        "n1": "idle", "n2": "mixed*", "n3": "down*", "n4": "drained", "n5": "draining",
        "n6": "allocated",
    }  # fmt: skip
    assert {n for n, s in states.items() if unusable(s)} == {"n2", "n3", "n4", "n5"}
    assert not unusable("idle~")  # powered down to save energy: SLURM powers it up


def test_a_spare_is_no_groups_home_but_takes_a_lost_nodes_groups():
    up = [HostState(name="n1", up=True), HostState(name="n2", up=True)]
    spare = HostState(name="n3", up=True, spare=True)
    assert [place(r, [*up, spare], 0.0).host for r in range(4)] == ["n1", "n2", "n1", "n2"]
    lost = [HostState(name="n1", up=False, respawning=True), up[1], spare]
    decision = place(0, lost, 0.0)
    assert decision.host == "n3" and "spare" in decision.reason  # not n2, which is busy


def test_a_gone_node_is_never_chosen_nor_respawned():
    hosts = [
        HostState(name="n1", up=False, gone=True),
        HostState(name="n2", up=True),
        HostState(name="n3", up=True, spare=True, gone=True),  # drained while its agent runs
    ]
    decision = place(0, hosts, 0.0)
    assert decision.host == "n2" and decision.respawn == ()


# -- the planner and the config -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["node_failure", "scancel_step"])
def test_slurm_faults_are_planned_only_with_launcher_slurm(kind):
    spec = ScheduleSpec(kind="at_times", at_times=(5.0,))
    local = Topology.from_counts(2, 1, 2)
    with pytest.raises(TargetError, match="launcher = 'slurm'"):
        plan(spec, {kind: 1}, TargetSpec(), local, seed=1)
    on_slurm = Topology(
        replicas=2, ranks=1, hosts=("n1", "n2", "n3"), replica_hosts=("n1", "n2"), launcher="slurm"
    )
    (fault,) = plan(spec, {kind: 1}, TargetSpec(), on_slurm, seed=1)
    assert fault.target.host in ("n1", "n2", "n3") and fault.target.replica is None


def test_the_slurm_section_is_validated():
    ok = load_config("experiments/tiny.toml", ["launcher=slurm", "slurm.spare_nodes=1"])
    assert ok.slurm.spare_nodes == 1 and ok.slurm.replace == "spare"
    new = load_config("experiments/tiny.toml", ["launcher=slurm", "slurm.replace=new_job"])
    assert new.slurm.replace == "new_job"
    bad = {
        "slurm.spare_nodes=-1": "slurm.spare_nodes",
        "slurm.replace=bogus": "slurm.replace",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config("experiments/tiny.toml", ["launcher=slurm", override])
    with pytest.raises(ConfigError, match="never be used"):
        load_config(
            "experiments/tiny.toml",
            ["launcher=slurm", "slurm.spare_nodes=1", "slurm.replace=none"],
        )
    with pytest.raises(ConfigError, match='only to launcher = "slurm"'):
        load_config("experiments/tiny.toml", ["slurm.spare_nodes=1"])


# -- ftharness slurm submit -----------------------------------------------------------------------
def _script(**kw):
    from experiments.slurm_submit import sbatch_script

    args = dict(
        name="tiny", source="/w/exp.toml", experiment=False, run_dir="/w/runs/tiny", nodes=3,
        workdir="/w", python="/w/.venv/bin/python",
    )  # fmt: skip
    return sbatch_script(**{**args, **kw})


def test_the_sbatch_script_asks_for_what_node_loss_and_time_limits_need():
    text = _script(time_limit="2:00:00", partition="gpu", extra=["--account=lab"])
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in (
        "#SBATCH --nodes=3",
        "#SBATCH --time=2:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --output=/w/runs/tiny/slurm-%j.out",
    ):
        assert want in lines
    assert any(ln.startswith("#SBATCH --no-kill") for ln in lines)
    assert any(ln.startswith("#SBATCH --signal=B:USR1@120") for ln in lines)
    assert "-m harness run /w/exp.toml --launcher slurm --out /w/runs/tiny/run &" in text
    assert "trap 'kill -USR1 \"$pid\"' USR1" in text  # B: signals the batch shell only
    assert "-m harness report /w/runs/tiny/run" in text
    chaos = _script(experiment=True)
    assert "-m harness chaos /w/exp.toml --launcher slurm --out /w/runs/tiny/chaos &" in chaos
    assert "harness report" not in chaos  # chaos writes its own report


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_sbatch_script_is_valid_bash(tmp_path):
    path = tmp_path / "sbatch.sh"
    path.write_text(_script(extra=["--gres=gpu:8"]))
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_options_after_a_double_dash_go_to_sbatch(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        "experiments.slurm_submit.main", lambda args: seen.setdefault("args", args) and 0
    )
    main(["slurm", "submit", "x.toml", "--nodes", "3", "--", "--time=5", "--mem=0"])
    args = seen["args"]
    assert (args.config, args.nodes, args.sbatch_args) == ("x.toml", 3, ["--time=5", "--mem=0"])
    assert build_parser().parse_args(["slurm", "status", "runs/x"]).run == "runs/x"


def test_an_experiment_is_told_from_a_job_config(tmp_path):
    from experiments.slurm_submit import is_experiment

    assert is_experiment("experiments/slurm_node_loss.toml")
    assert not is_experiment("experiments/tiny.toml")


def test_launcher_on_the_command_line_is_validated_with_the_whole_experiment(tmp_path):
    from experiments.runner import with_launcher
    from experiments.spec import ExperimentError

    text = (ROOT / "experiments" / "slurm_node_loss.toml").read_text()
    path = tmp_path / "exp.toml"
    path.write_text(text.replace('launcher = "slurm"\n', ""))  # only [slurm] and SLURM faults
    spec = with_launcher(path, "slurm")
    assert spec.topology.launcher == "slurm" and "launcher=slurm" in spec.job_overrides("in_place")
    with pytest.raises(ExperimentError, match="launcher"):
        with_launcher(path, "local")
