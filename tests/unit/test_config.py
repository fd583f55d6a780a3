"""Bad job configs fail before launch, with a message naming the key, the rule and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.config import (
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
