"""Bad job configs fail before launch, with a message naming the key, the rule and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import (
    SPARSE_QUORUM_EVERY,
    ConfigError,
    JobConfig,
    TimeoutConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)


def _toml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return str(p)


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = JobConfig()
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_toml_and_overrides(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'name = "x"\nreplicas = 2\n[timeouts]\nquorum_timeout = 20\n')
    cfg = load_config(path, ["steps=7", "recovery.policy=full_restart", "optim.betas=[0.8, 0.9]"])
    assert (cfg.name, cfg.replicas, cfg.steps) == ("x", 2, 7)
    assert cfg.timeouts.quorum_timeout == 20.0
    assert cfg.recovery.policy == "full_restart"
    assert cfg.optim.betas == (0.8, 0.9)


def test_python_function_source() -> None:
    cfg = load_config("harness.config:JobConfig", ["replicas=2"])
    assert cfg.replicas == 2


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'replica'.*did you mean 'replicas'"):
        load_config(_toml(tmp_path, "replica = 3\n"), [])
    with pytest.raises(ConfigError, match=r"'timeouts.quorum_timout'.*'quorum_timeout'"):
        load_config(_toml(tmp_path, ""), ["timeouts.quorum_timout=3"])


def test_zero_replicas(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"replicas = 0: must be >= 1"):
        load_config(_toml(tmp_path, "replicas = 0\n"), [])


def test_min_replica_size_above_replicas() -> None:
    with pytest.raises(ConfigError, match=r"min_replica_size = 3 must be <= replicas = 2"):
        config_from_dict({"replicas": 2, "min_replica_size": 3})


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"steps = 'ten': must be an integer"):
        config_from_dict({"steps": "ten"})
    with pytest.raises(ConfigError, match=r"transport = 'rdma': must be one of"):
        config_from_dict({"transport": "rdma"})
    with pytest.raises(ConfigError, match=r"model.kind"):
        config_from_dict({"model": {"kind": "gpt5"}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"heartbeat_interval": 3.0},
            r"heartbeat_interval \(3.0\) must be < timeouts"
            r".heartbeat_timeout \(2.0\): a live worker",
        ),
        (
            {"heartbeat_timeout": 6.0},
            r"heartbeat_timeout \(6.0\) must be < "
            r"timeouts.process_group_timeout \(5.0\): a hung rank must be killed by its supervisor "
            r"before the survivors' collectives time out",
        ),
        (
            {"lighthouse_heartbeat_timeout": 10.0},
            r"lighthouse_heartbeat_timeout \(10.0\) must be "
            r"< timeouts.quorum_timeout \(10.0\): the Lighthouse must drop a dead replica group",
        ),
        (
            {"lighthouse_join_timeout": 11.0},
            r"lighthouse_join_timeout \(11.0\) must be < "
            r"timeouts.quorum_timeout",
        ),
        (
            {"process_group_timeout": 12.0, "heartbeat_timeout": 2.0},
            r"process_group_timeout \(12.0\) must be <= timeouts.quorum_timeout \(10.0\): "
            r"a collective on a broken quorum",
        ),
    ],
)
def test_timeouts_out_of_order(change: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"timeouts": change})


def test_timeouts_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError, match="process_group_timeout"):
        JobConfig(timeouts=TimeoutConfig(process_group_timeout=30.0))


def test_shipped_tiny_experiment_loads() -> None:
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(str(repo / "experiments" / "tiny.toml"), [])
    assert cfg.model.kind == "tiny"


# --- numbers that could never run, and names that escape runs/ ---------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("timeouts.quorum_timeout=nan", "timeouts.quorum_timeout = nan: must be a finite number"),
        ("timeouts.heartbeat_timeout=inf", "timeouts.heartbeat_timeout = inf: must be a finite"),
        ("optim.lr=nan", "optim.lr = nan: must be a finite number"),
        ("optim.lr=inf", "optim.lr = inf: must be a finite number"),
        ("optim.betas=[nan, 0.9]", r"optim.betas\[0\] = nan: must be a finite number"),
        ("optim.betas=[0.9, inf]", r"optim.betas\[1\] = inf: must be a finite number"),
        ("optim.betas=[1.0, 0.9]", r"optim.betas\[0\] = 1.0: must be in \[0, 1\)"),
        ("optim.lr=-0.1", "optim.lr = -0.1: must be >= 0"),
        ("recovery.restart_delay_s=inf", "recovery.restart_delay_s = inf: must be a finite"),
        ("recovery.restart_delay_s=nan", "recovery.restart_delay_s = nan: must be a finite"),
        ("recovery.within_s=nan", "recovery.within_s = nan: must be a finite number"),
        ("recovery.within_s=1e300", r"recovery.within_s = 1e\+300: must be <= 604800 seconds"),
        ("timeouts.connect_timeout=" + "9" * 400, "timeouts.connect_timeout = 9999"),
        (
            "replicas=100000",
            "replicas x ranks \\+ hosts x recovery.spares_per_host = 100000 x 1 \\+ 1 x 1 = "
            "100001 worker processes: must be <= 1024",
        ),
        ("ranks=2000", "= 3 x 2000 \\+ 1 x 1 = 6001 worker processes"),
        ("recovery.spares_per_host=5000", "= 5003 worker processes: must be <= 1024"),
        ("hosts=1000", "hosts = 1000: must be <= 64"),
        (
            "data.batch_size=1000000000",
            "data.batch_size x data.seq_len x data.vocab_size = 1000000000 x 32 x 256 float32 "
            "logits = 3.05e\\+04 GiB per rank and step: must be <= 16 GiB",
        ),
        ("data.seed=-1", r"data.seed = -1: must be 0..9223372036854775807"),
        ('name="../outside"', "name = '../outside': must be 1-64 letters"),
        ('name="a/b"', "name = 'a/b': must be"),
        ('name=".."', "name = '..': must be"),
        ('name="x y"', "name = 'x y': must be"),
        ("recovery.quorum_every_steps=-1", "recovery.quorum_every_steps = -1: must be >= 0"),
    ],
)
def test_numbers_and_names_that_could_never_run(
    tmp_path: Path, override: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_toml(tmp_path, ""), [override])


def test_a_sparse_quorum_needs_the_tree_quorum(tmp_path: Path) -> None:
    # torchft's Lighthouse cannot tell the survivors that a replacement waits
    with pytest.raises(ConfigError, match=r'= 10 needs recovery\.quorum = "tree"'):
        load_config(
            _toml(tmp_path, ""), ["recovery.quorum_every_steps=10", 'recovery.quorum="torchft"']
        )
    cfg = load_config(_toml(tmp_path, ""), ["recovery.quorum_every_steps=10"])
    assert cfg.recovery.quorum_every_steps == 10 and cfg.recovery.quorum == "tree"
    # the default (0) is sparse only where the tree quorum can ask the groups for a quorum
    assert load_config(_toml(tmp_path, ""), []).quorum_every() == SPARSE_QUORUM_EVERY
    lighthouse = load_config(_toml(tmp_path, ""), ['recovery.quorum="torchft"'])
    assert lighthouse.quorum_every() == 1


def test_direct_construction_checks_numbers_too() -> None:
    with pytest.raises(ConfigError, match=r"timeouts\.quorum_timeout = nan"):
        JobConfig(timeouts=TimeoutConfig(quorum_timeout=float("nan")))


def test_cli_rejects_nan_before_launch(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            str(repo / "experiments" / "tiny.toml"),
            "--set",
            "optim.lr=nan",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == "ftharness run: optim.lr = nan: must be a finite number\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.group=fsdp"], r'parallel.group = "fsdp" with ranks = 1: sharding needs'),
        (["ranks=2", "parallel.group=tp"], r"parallel.group = 'tp': must be one of"),
        (["ranks=2", "parallel.grup=fsdp"], r"unknown key 'parallel.grup' \(did you mean"),
        (
            ["ranks=65", "parallel.group=fsdp"],
            r"model.kind = 'tiny' has a parameter of first dimension 64 .* use ranks <= 64",
        ),
        (
            ["ranks=3", "parallel.group=fsdp", "data.vocab_size=2"],
            r"first dimension 2 \(FSDP2 shards along it\)",
        ),
        (
            ["ranks=2", "parallel.group=fsdp", 'program.command=["python", "x.py"]'],
            r'parallel.group = "fsdp" with a \[program\]: it shards the built-in trainer',
        ),
    ],
)
def test_a_sharded_group_it_cannot_shard_is_refused(overrides: list[str], message: str) -> None:
    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=message):
        load_config(str(repo / "experiments" / "tiny.toml"), overrides)


def test_a_sharded_group_loads() -> None:
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(str(repo / "experiments" / "tiny.toml"), ["ranks=2", "parallel.group=fsdp"])
    assert cfg.parallel.group == "fsdp"
    assert load_config(str(repo / "experiments" / "tiny.toml"), []).parallel.group == "replicate"
