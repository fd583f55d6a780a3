"""A user's sharded program under ftharness: tests/programs/train_hsdp.py (FSDP2 over each
group's ranks, torchft across groups, a synchronous quorum), a plain program that never imports
ftharness, faulted one rank at a time. What a user would see: it starts (its ``env://`` process
group finds the group's agent-hosted store, as under torchrun), every fault is recovered in
place, the whole group restarts for one rank's death, and every rank of a replacement loads its
own shard from the same rank of the healthy group (their shard checksums agree afterwards)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import chaos_argv, events, fault_recoveries

from runtime.launchers import netns

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "tests" / "programs"
EXPERIMENT = PROGRAMS / "chaos_train_hsdp.toml"
#: What torchrun gives a rank that ftharness gives with another value, on purpose (documented in
#: docs/own-program.md#what-a-rank-gets): the group's store is the agent's, on a port of its
#: own; the error file sits next to the rank's log.
OWN_VALUES = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}
#: What torchrun gives that ftharness does not: which signals torchrun's own agent forwards to
#: its workers (read by that agent, not by a rank); ``_`` is the shell's.
NOT_GIVEN = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "_"}
SHARDS = re.compile(r"train_hsdp: group (\d) rank (\d) step (\d+) shards ([0-9a-f]{8})")


def _write_experiment(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = EXPERIMENT.read_text()
    text = text.replace(
        '"tests/programs/train_hsdp.py"', json.dumps(str(PROGRAMS / "train_hsdp.py"))
    )
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "exp.toml").write_text(text)
    return tmp_path / "exp.toml"


def _run(tmp_path: Path, *options: str) -> tuple[Path, str]:
    done = subprocess.run(
        chaos_argv(tmp_path, "--quiet", *options),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=330,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["passed"], (report["hypotheses"], out[-4000:])
    return tmp_path / "run" / "in_place", out


def _check_sharded_recovery(run: Path) -> None:
    steps = 300
    report = json.loads((run.parent / "report.json").read_text())
    recs = fault_recoveries(run, report["summary"]["policies"]["in_place"]["recoveries"])
    assert sorted(r["kind"] for r in recs) == ["collective_abort", "kill", "segfault"], recs
    for r in recs:
        assert r["steps_lost"] is not None and r["participate_s"] is not None, r

    # one rank died (rank 1 for the kill, rank 0 for the segfault); its whole group restarted
    died = {
        f["signal"]: (f["replica"], f["rank"]) for f in events(run, "failure") if f.get("signal")
    }
    assert died == {"SIGKILL": (1, 1), "SIGSEGV": (0, 0)}, died
    logs = {
        (g, k): (run / "logs" / f"replica{g}-rank{k}.log").read_text()
        for g in (0, 1)
        for k in (0, 1)
    }
    for (g, k), log in logs.items():
        assert f"=== ftharness: replica {g} rank {k} incarnation 1" in log, (g, k)
        last = log.rsplit("=== ftharness:", 1)[1]
        assert f"train_hsdp: group {g} rank {k} done at step {steps}" in last, last[-2000:]
        # each rank of the replacement loaded its own shards from the healthy group
        assert f"train_hsdp: group {g} rank {k} healed" in last, last[-2000:]

    # after the last heal, rank k of both groups holds the same shards at every step both
    # printed, and the two ranks' shards differ (each holds its own half)
    last_heal = max(h["step"] for h in events(run, "trainer.healed"))
    seen: dict[tuple[int, int], dict[int, str]] = {}
    for (g, k), log in logs.items():
        for m in SHARDS.finditer(log.rsplit("=== ftharness:", 1)[1]):
            if int(m[3]) > last_heal:
                seen.setdefault((g, k), {})[int(m[3])] = m[4]
    for k in (0, 1):
        common = set(seen[(0, k)]) & set(seen[(1, k)])
        assert len(common) >= 5, seen
        assert all(seen[(0, k)][s] == seen[(1, k)][s] for s in common), (k, seen)
    assert seen[(0, 0)][steps] != seen[(0, 1)][steps]


@pytest.mark.timeout(420)
def test_sharded_program_starts_with_torchruns_environment_and_recovers_shard_by_shard(tmp_path):
    dumps = tmp_path / "env"
    dumps.mkdir()
    exp = _write_experiment(
        tmp_path,
        (
            "hooks = true",
            f"hooks = true\nenv = {{ TRAIN_HSDP_ENV_DUMP = {json.dumps(str(dumps))} }}",
        ),
    )
    assert exp.exists()
    run, _ = _run(tmp_path)
    _check_sharded_recovery(run)

    # what a rank got, key by key, against torch 2.13's own torchrun for the same shape
    torchrun_dir = tmp_path / "torchrun"
    torchrun_dir.mkdir()
    parent = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "OMP_"))}
    subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--max-restarts", "20", "--rdzv-id", "chaos_train_hsdp", "--master_port", "0",
            str(PROGRAMS / "dump_env.py"), str(torchrun_dir),
        ],
        env=parent, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    for k in (0, 1):
        theirs = json.loads((torchrun_dir / f"replica0-rank{k}-restart0.json").read_text())
        ours = json.loads((dumps / f"replica0-rank{k}-restart0.json").read_text())
        added = {n: v for n, v in theirs.items() if parent.get(n) != v}
        assert "TORCHELASTIC_USE_AGENT_STORE" in added and "GROUP_RANK" in added, added
        missing = sorted(set(added) - set(ours) - NOT_GIVEN)
        assert not missing, f"torchrun gives {missing}, ftharness does not"
        same = set(added) - OWN_VALUES - NOT_GIVEN
        differ = {n: (added[n], ours[n]) for n in same if ours[n] != added[n]}
        assert not differ, f"(torchrun's, ftharness's): {differ}"
        # the restarted incarnation counts its restart, as torchrun's TORCHELASTIC_RESTART_COUNT
        again = json.loads((dumps / f"replica0-rank{k}-restart1.json").read_text())
        assert again["RANK"] == str(k) and again["TORCHELASTIC_USE_AGENT_STORE"] == "True"


ok, why = netns.available()


@pytest.mark.timeout(420)
@pytest.mark.skipif(not ok, reason=why)
def test_sharded_program_recovers_on_namespace_hosts(tmp_path):
    _write_experiment(
        tmp_path,
        ("hosts = 1", 'hosts = 2\nlauncher = "netns"'),
    )
    run, _ = _run(tmp_path)
    _check_sharded_recovery(run)
    assert {s["host"] for s in events(run, "proc.start")} == {"host0", "host1"}
