"""A program of the user's own: its config section, the environment and argv each rank gets,
and the pure rules that read its progress from its quorum requests."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from harness.config import ConfigError, load_config
from harness.job.program.env import launcher_env, log_name, program_argv
from harness.job.program.progress import hung_for, read_tail, step_events
from harness.program_config import LAUNCHER_ENV, TORCHFT_ENV, cold_reason

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ["python", "tests/programs/train_ddp.py", "20"]


def cfg(*overrides: str):
    return load_config(
        "experiments/tiny.toml", [f"program.command={json.dumps(PROGRAM)}", *overrides]
    )


def test_launcher_env_is_what_a_torchft_launcher_gives():
    c = cfg("replicas=3", "ranks=2", 'program.env={LOGLEVEL="INFO"}')
    env = launcher_env(
        c, replica=2, rank=1, lighthouse="http://127.0.0.1:7", store_addr="10.0.0.5:99"
    )
    assert {k: env[k] for k in TORCHFT_ENV} == {
        "REPLICA_GROUP_ID": "2",
        "NUM_REPLICA_GROUPS": "3",
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:7",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "99",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert env["LOGLEVEL"] == "INFO"
    # torchrun's conventions (tests/e2e/test_program_hsdp.py compares them with torchrun's own)
    assert {k: env[k] for k in LAUNCHER_ENV if k.startswith(("GROUP_", "ROLE_"))} == {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": "1",
        "ROLE_WORLD_SIZE": "2",
    }
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # env:// connects to the agent's store
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == str(c.recovery.max_restarts)
    # torchft's Manager reads its timeouts from the environment first: ftharness's checked ones
    assert env["TORCHFT_TIMEOUT_SEC"] == "10"
    # the quorum timeout (10) is raised past the default progress timeout (30) + the
    # Lighthouse's heartbeat timeout (1) + slack (5): survivors outwait a hung group's fencing
    assert env["TORCHFT_QUORUM_TIMEOUT_SEC"] == "36"


def test_every_program_gets_the_start_up_patch_first_on_its_path_and_the_hooks_when_asked():
    """The directories put on a program's PYTHONPATH hold the sitecustomize they name (a move
    of harness/job/program/env.py once pointed them at a folder that does not exist, and
    torchft's peers were named by the host's name again: tests/e2e/test_addresses.py)."""
    from harness.job.program.env import HOOKS_DIR, SITE_DIR

    assert (SITE_DIR / "sitecustomize.py").is_file() and (HOOKS_DIR / "sitecustomize.py").is_file()
    env = launcher_env(cfg(), replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2")
    assert env["PYTHONPATH"].split(":")[0] == str(SITE_DIR)
    hooked = launcher_env(
        cfg("program.hooks=true"), replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2"
    )
    assert str(HOOKS_DIR) in hooked["PYTHONPATH"].split(":")


def test_program_quorum_timeout_is_kept_where_it_already_outlasts_fencing():
    c = cfg("program.progress_timeout_s=10", "timeouts.quorum_timeout=40")
    env = launcher_env(c, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2")
    assert env["TORCHFT_QUORUM_TIMEOUT_SEC"] == "40"
    c = cfg("program.progress_timeout_s=10", "timeouts.quorum_timeout=12")
    env = launcher_env(c, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2")
    assert env["TORCHFT_QUORUM_TIMEOUT_SEC"] == "16"


def test_program_env_may_override_torchft_timeouts_but_not_the_launcher_environment():
    c = cfg('program.env={TORCHFT_TIMEOUT_SEC="30"}')
    env = launcher_env(c, replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2")
    assert env["TORCHFT_TIMEOUT_SEC"] == "30"
    with pytest.raises(ConfigError, match=r"program.env.RANK: set by ftharness"):
        cfg('program.env={RANK="1"}')


@pytest.mark.parametrize("name", ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"])
def test_program_env_may_not_place_the_groups_store(name):
    with pytest.raises(ConfigError, match=rf"program.env.{name}: the group's store is ftharness's"):
        cfg(f'program.env={{{name}="False"}}')


def test_the_restart_count_is_the_incarnation():
    env = launcher_env(
        cfg("ranks=2"), replica=0, rank=0, lighthouse="http://h:1", store_addr="h:2", incarnation=3
    )
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"


@pytest.mark.parametrize(
    ("command", "ranks", "refused"),
    [
        (
            ["torchrun", "--nproc_per_node", "2", "train.py"],
            2,
            "--nproc_per_node 2 under ranks = 2",
        ),
        (["torchrun", "--nproc-per-node=4", "train.py"], 2, "--nproc_per_node 4 under ranks = 2"),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "t.py"], 2, "nproc"),
        (["torchrun", "--nnodes", "1", "--nproc_per_node", "1", "train.py"], 2, None),
        (["torchrun", "--nproc_per_node", "2", "train.py"], 1, None),  # one rank: torchrun's own
        (["torchrun", "train.py", "--nproc_per_node", "2"], 2, None),  # the script's own flag
    ],
)
def test_torchrun_starting_ranks_of_its_own_is_refused(tmp_path, command, ranks, refused):
    torchrun = tmp_path / "torchrun"  # on PATH for the check, as a user's would be
    torchrun.write_text("#!/bin/sh\n")
    torchrun.chmod(0o755)
    command = [str(torchrun) if a == "torchrun" else a for a in command]
    overrides = [f"program.command={json.dumps(command)}", f"ranks={ranks}"]
    if refused is None:
        load_config("experiments/tiny.toml", overrides)
        return
    with pytest.raises(ConfigError, match=refused) as e:
        load_config("experiments/tiny.toml", overrides)
    assert "ftharness starts the" in str(e.value)


def test_torchtitan_gets_its_fault_tolerance_flags():
    c = cfg("replicas=4", "program.kind=torchtitan")
    assert program_argv(c, replica=3) == (
        *PROGRAM,
        "--fault_tolerance.enable",
        "--fault_tolerance.replica_id=3",
        "--fault_tolerance.group_size=4",
    )
    assert program_argv(cfg(), replica=3) == tuple(PROGRAM)  # torchft: the command as is
    with pytest.raises(ConfigError, match="added by ftharness"):
        load_config(
            "experiments/tiny.toml",
            [
                'program.command=["python", "-m", "torchtitan.train", '
                '"--fault_tolerance.replica_id=0"]',
                "program.kind=torchtitan",
            ],
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('program.command=["python", ""]', r"program.command\[1\] = '': must be a non-empty"),
        ("program.command=[1]", r"program.command\[0\] = 1: must be a string"),
        ('program.command="python x.py"', "must be a list of str"),
        ('program.command=["no-such-program-here"]', "no such program on PATH"),
        ("program.kind=jax", "must be one of 'torchft', 'torchtitan'"),
        ('program.env={"A-B"="1"}', "not a valid environment variable name"),
        ("program.env={A=1}", r"program.env.A = 1: must be a string"),
        ("program.progress_timeout_s=3", "must be > timeouts.process_group_timeout"),
        ("program.start_timeout_s=0", "program.start_timeout_s = 0.0: must be > 0"),
        ('program.cwd="/no/such/dir"', "not a directory"),
        ("program.hooks=1", "must be true or false"),
        ("program.comand=[]", "did you mean 'command'"),
    ],
)
def test_program_config_errors_name_the_key(override, message):
    own_command = override.startswith("program.command")
    overrides = [override] if own_command else [f"program.command={json.dumps(PROGRAM)}", override]
    with pytest.raises(ConfigError, match=message):
        load_config("experiments/tiny.toml", overrides)


def test_no_command_means_the_built_in_trainer():
    c = load_config("experiments/tiny.toml")
    assert not c.program.enabled
    assert cfg().program.enabled


def test_experiment_takes_an_inline_job_program(tmp_path):
    from experiments.spec import load_experiment

    p = tmp_path / "exp.toml"
    p.write_text(
        'name = "e"\nsteps = 10\npolicies = ["in_place"]\n[job]\nreplicas = 2\n'
        '[job.program]\ncommand = ["python", "t.py", "10"]\nenv = { A = "1" }\n'
        '[schedule]\nkind = "at_steps"\nat_steps = [3]\n[faults]\nmix = { kill = 1 }\n'
    )
    from experiments.runner import job_config

    job = job_config(load_experiment(p), "in_place")
    assert job.program.command == ("python", "t.py", "10") and job.program.env == {"A": "1"}


def test_step_events_read_progress_from_quorum_requests():
    assert step_events(None, 0) == []  # the first request: where the group starts
    assert step_events(None, 40) == []  # resumed from its own checkpoint: not a commit
    assert step_events(4, 5) == ["commit"]
    assert step_events(0, 91) == ["healed", "commit"]  # loaded a peer's step 90, committed 91
    assert step_events(5, 5) == ["abort"]  # asked again without committing
    assert step_events(5, 3) == []  # an older request arriving late says nothing new


def test_hung_for_counts_only_silence_with_no_request_in_flight():
    kw = {"start_s": 60.0, "progress_s": 6.0}
    assert hung_for(now=100.0, started=0.0, last=None, waiting=0, **kw) == 100.0
    assert hung_for(now=50.0, started=0.0, last=None, waiting=0, **kw) is None  # starting
    assert hung_for(now=100.0, started=0.0, last=95.0, waiting=0, **kw) is None
    assert hung_for(now=100.0, started=0.0, last=90.0, waiting=0, **kw) == 10.0
    assert hung_for(now=100.0, started=0.0, last=10.0, waiting=1, **kw) is None  # waits on quorum


def test_read_tail(tmp_path):
    log = tmp_path / log_name(1, 0)
    assert log.name == "replica1-rank0.log"
    assert read_tail(log) == []
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert read_tail(log, 3) == ["line 97", "line 98", "line 99"]


def test_the_test_program_knows_nothing_of_ftharness():
    tree = ast.parse((ROOT / "tests" / "programs" / "train_ddp.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "os", "sys", "time", "datetime", "torch", "torchft"}


def test_warm_start_needs_a_python_script_or_module():
    ok = ["python", "-m", "torchtitan.train"]
    assert load_config(
        "experiments/tiny.toml", [f"program.command={json.dumps(ok)}", "program.warm=true"]
    ).program.warm
    for bad in (["sh", "run.sh"], ["python", "-u", "t.py"], ["python", "-m"], ["python"]):
        with pytest.raises(ConfigError, match=r"program\.warm = true needs"):
            load_config(
                "experiments/tiny.toml", [f"program.command={json.dumps(bad)}", "program.warm=true"]
            )


@pytest.mark.parametrize(
    ("command", "env", "why"),
    [
        (["python", "train.py", "10"], {}, None),
        (["python3", "-m", "torchtitan.train", "--x"], {}, None),
        ([sys.executable, "train.py"], {"PYTHONPATH": "/x", "LOGLEVEL": "INFO"}, None),
        (["sh", "run.sh"], {}, "program.command[0] = 'sh' is not python"),
        (["env", "A=1", "python", "t.py"], {}, "'env' is not python"),
        (["bash", "-c", "python t.py"], {}, "'bash' is not python"),
        (["python", "-u", "t.py"], {}, "interpreter option '-u'"),
        (["python", "-c", "print(1)"], {}, "interpreter option '-c'"),
        (["python", "-m"], {}, "no module after python -m"),
        (["python"], {}, "no script or module"),
        (["python", "t.py"], {"OMP_NUM_THREADS": "2"}, "program.env.OMP_NUM_THREADS is read"),
        (["python", "t.py"], {"PYTHONHASHSEED": "0"}, "program.env.PYTHONHASHSEED is read"),
        (["python", "t.py"], {"LD_PRELOAD": "x.so"}, "program.env.LD_PRELOAD is read"),
    ],
)
def test_warm_by_default_where_safe_else_cold_with_the_reason(command, env, why):
    c = load_config(
        "experiments/tiny.toml",
        [f"program.command={json.dumps(command)}", f"program.env={toml_table(env)}"],
    ).program
    assert c.warm is None  # the default: unset
    reason = cold_reason(c)
    assert (reason is None) if why is None else (why in (reason or "")), reason
    assert c.starts_warm is (why is None)
    # false forces a cold start; true insists on a warm one
    off = load_config(
        "experiments/tiny.toml",
        [
            f"program.command={json.dumps(command)}",
            f"program.env={toml_table(env)}",
            "program.warm=false",
        ],
    ).program
    assert not off.starts_warm
    overrides = [
        f"program.command={json.dumps(command)}",
        f"program.env={toml_table(env)}",
        "program.warm=true",
    ]
    if why is None:
        assert load_config("experiments/tiny.toml", overrides).program.starts_warm
    else:
        with pytest.raises(ConfigError, match=r"program\.warm = true needs"):
            load_config("experiments/tiny.toml", overrides)


def toml_table(env: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}"


def test_the_built_in_trainer_never_starts_as_a_program():
    assert not load_config("experiments/tiny.toml", []).program.starts_warm


def test_a_sparse_quorum_is_refused_for_a_program():
    # a program's own loop calls start_quorum; only the built-in trainer can skip it
    with pytest.raises(ConfigError, match="applies only to the built-in trainer"):
        cfg("recovery.quorum_every_steps=4")
    assert cfg().quorum_every() == 1  # the default: every step
