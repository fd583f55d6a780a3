"""Semi-synchronous programs of the user's own (issue #29 item 3): tests/programs/train_diloco.py
and train_localsgd.py, plain torchft programs that ask for a quorum once per ``sync_every`` inner
steps and never import ftharness, supervised, faulted and observed through the quorum tap.

What a user would check: every fault recovered; commits journaled in inner steps (the Manager's
step x ``program.sync_every``); each replacement healed from a peer (its first sync is not the
first of the job) and, at every sync both groups committed, its parameters (and DiLoCo's outer
optimizer state) bitwise equal to the peer's, by the checksums the programs print per sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from e2e_helpers import blocked_survivors, events, fault_recoveries, run_chaos, sync_checksums

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "tests" / "programs"


def _write_experiment(path: Path, program: str, edits: dict[str, str], steps: int) -> dict:
    """tests/programs/chaos_<program>.toml with the program's absolute path, ``steps`` (the job's
    and the program's) and whole lines replaced (``edits``: line prefix -> new line)."""
    text = (PROGRAMS / f"chaos_{program}.toml").read_text().replace("1400", str(steps))
    rel = f'"tests/programs/train_{program}.py"'
    assert rel in text
    text = text.replace(rel, json.dumps(str(PROGRAMS / f"train_{program}.py")))
    lines = text.splitlines()
    for prefix, new in edits.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert len(hits) == 1, prefix
        lines[hits[0]] = new
    path.write_text("\n".join(lines) + "\n")
    return tomllib.loads(path.read_text())


# (program, inner steps, edits): DiLoCo takes all three process faults as its experiment file
# has them (seed 13: a kill, a hang, a segfault); LocalSGD, which shares every piece of the path
# but the program, a kill and a segfault (seed 3 picks both), to fit CI's time.
CASES = [
    ("diloco", 1400, {}),
    (
        "localsgd",
        600,
        {
            "seed =": "seed = 3",
            "mix =": "mix = { kill = 1, segfault = 1 }",
            "at_steps =": "at_steps = [100, 350]",
        },
    ),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("program", "steps", "edits"), CASES, ids=[c[0] for c in CASES])
def test_semisync_program_recovers_and_heals_to_its_peers_state(tmp_path, program, steps, edits):
    data = _write_experiment(tmp_path / "exp.toml", program, edits, steps)
    job = data["job"]
    every = job["program"]["sync_every"]
    assert job["steps"] == steps and job["program"]["command"][2] == str(steps)
    report, out = run_chaos(tmp_path, ROOT)
    run = tmp_path / "run" / "in_place"
    recs = fault_recoveries(run, report["summary"]["policies"]["in_place"]["recoveries"])
    blocked = len(blocked_survivors(run))  # each one restarted: one more incarnation
    kinds = sorted(data["faults"]["mix"])
    assert sorted(r["kind"] for r in recs) == kinds, (recs, out[-4000:])
    for r in recs:
        for key in ("detection_s", "stall_s", "participate_s", "steps_lost"):
            assert r[key] is not None, (key, r)
        assert r["steps_lost"] % every == 0, r  # inner steps: whole syncs
        assert {"detected", "replacement_started", "healed", "participating"} <= set(r["phases"])

    # commits are journaled in inner steps: Manager step x sync_every, up to the last sync
    commits = events(run, "step.commit")
    assert commits and all(c["sync_every"] == every and c["step"] % every == 0 for c in commits)
    for r in range(job["replicas"]):
        assert max(c["step"] for c in commits if c["replica"] == r) == steps - every
    healed = events(run, "trainer.healed")
    assert len(healed) >= len(kinds) and all(h["step"] > every for h in healed), healed

    # every replacement healed from a peer (its first sync is past the job's first) and holds
    # the peer's parameters (and outer optimizer state) at every sync both committed
    logs = {r: sync_checksums(run / "logs" / f"replica{r}-rank0.log") for r in (0, 1)}
    assert sum(len(v) - 1 for v in logs.values()) == len(kinds) + blocked, logs
    for r, incs in logs.items():
        peer: dict[int, str] = {}
        for inc in logs[1 - r]:
            peer.update(inc)
        for i, inc in enumerate(incs):
            assert inc, (r, i, out[-3000:])
            if i > 0:
                first = min(inc)
                assert first > 1, (r, i, sorted(inc))  # healed, not trained from step 0
                assert peer.get(first) == inc[first], (r, i, first)
            common = sorted(set(inc) & set(peer))
            assert common and all(inc[s] == peer[s] for s in common), (r, i, common)


@pytest.mark.timeout(60)
def test_a_sync_every_left_unset_is_named_when_the_program_ends_early(tmp_path):
    """A LocalSGD program syncing every 10 inner steps, run with ``program.sync_every`` unset:
    its Manager's last step (4 syncs) is taken for step 4 of 40; when it exits with code 0 the
    job says it stopped short and which ``sync_every`` would fit, and still ends ok."""
    program = PROGRAMS / "train_localsgd.py"
    argv = [
        sys.executable, "-m", "harness", "run", "experiments/tiny.toml",
        "--out", str(tmp_path / "run"), "--set", "replicas=1", "--set", "steps=40",
        "--set", "recovery.quorum=tree",
        "--set", f'program.command=["python", {json.dumps(str(program))}, "40", "10"]',
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=55)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "before the job's last step 40" in out, out[-4000:]
    assert "set program.sync_every = 10" in out, out[-4000:]
