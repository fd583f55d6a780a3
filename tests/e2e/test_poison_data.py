"""Poison data (issue #50), through the real CLI, real processes and real text:

* a sequence made unreadable (the ``poison_data`` fault) in a 3-group ``replay`` job fails the
  first two groups that read it, and no third: it is quarantined, and every group trains on;
* a sequence made to give a NaN loss fails no group and condemns no replica: every group
  checksums that step, the checksums agree, and it is quarantined at once;
* a corrupted copy of the default corpus (a token id outside the vocabulary every 50,000 tokens,
  its manifest's checksum recomputed, as a corrupted upstream shard arrives, so the corpus
  opens) trains to its last step with no group failing: each bad chunk met is quarantined by
  the rank that read it, with its document and offset, and ``ftharness data verify`` names the
  same ids beforehand.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from e2e_helpers import chaos_argv, events

from harness.corpus.cli import corpus_for_job
from harness.corpus.tokenfile import file_checksum

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).parents[2]

EXPERIMENT = """
name = "poison-e2e"
seed = 5
duration_s = 40                 # an upper bound: settle_s ends it once the fault is over
settle_s = 5
policies = ["in_place"]

[job]
name = "poison-e2e"
replicas = 3
ranks = 1
hosts = 1
steps = 100000
model = { kind = "tiny", dim = 64, layers = 2, heads = 4 }
checkpoint = { every_steps = 0 }
data = { policy = "replay", kind = "tokens" }

[schedule]
kind = "at_times"
at_times = [6]

[faults]
mix = { poison_data = 1 }

[targets]
kind = "default"

[hypotheses]
loss_finite = true
committed_steps_rise = true
replicas_equal_after_heal = true
every_fault_recovered = true

# The poison is aimed a second of steps ahead (the default, ~30 steps here): the mark reaches
# every trainer by a system call before any reads the data (3 steps, ~0.1 s here, lost that
# race in CI).
[faults.options.poison_data]
"""


def test_a_poisoned_sequence_fails_two_groups_then_is_quarantined_and_training_goes_on(tmp_path):
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=280
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    run = tmp_path / "run" / "in_place"
    (poison,) = events(run, "fault.poison_data")
    (quarantine,) = events(run, "data.quarantine")
    assert quarantine["key"] == poison["key"]
    assert {k: quarantine[k] for k in ("chunk", "offset", "document", "in_document")} == {
        k: poison[k] for k in ("chunk", "offset", "document", "in_document")
    }
    assert len(quarantine["groups"]) == 2  # two different groups failed on it, then no more
    failures = [r for r in events(run, "failure") if r["t"] >= poison["t"]]
    assert len(failures) == 2, [f["detail"] for f in failures]
    assert {f["replica"] for f in failures} == set(quarantine["groups"])
    suspects = events(run, "data.suspect")
    assert {s["replica"] for s in suspects} == set(quarantine["groups"])
    assert all("UnreadableData" in s["what"] for s in suspects)
    later = [r for r in events(run, "step.commit") if r["t"] > quarantine["t"] + 1.0]
    assert {r["replica"] for r in later} == {0, 1, 2}, "not every group trains on"
    # what the user reads: the console and the report
    assert f"quarantined chunk {poison['key']} of the corpus" in out
    report = (tmp_path / "run" / "report.md").read_text()
    assert "sequences quarantined: 1; failures blamed on data: 2;" in report


def test_a_sequence_with_a_nan_loss_is_quarantined_and_no_replica_is_condemned(tmp_path):
    nonfinite = EXPERIMENT + 'effect = "nonfinite"\n'
    (tmp_path / "exp.toml").write_text(nonfinite)
    done = subprocess.run(
        chaos_argv(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=280
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]  # loss_finite passes: the data was to blame
    run = tmp_path / "run" / "in_place"
    (poison,) = events(run, "fault.poison_data")
    assert poison["effect"] == "nonfinite"
    (suspect,) = events(run, "data.suspect")
    assert suspect["found"] == "nonfinite"
    assert [s["key"] for s in suspect["sequences"]] == [poison["key"]]
    (verdict,) = events(run, "silent.divergence")
    assert (verdict["action"], verdict["suspects"]) == ("data", [suspect["replica"]])
    nan = [r for r in events(run, "step.commit") if r["loss"] != r["loss"]]
    assert [(r["replica"], r["step"]) for r in nan] == [(suspect["replica"], verdict["step"])]
    at_step = [r for r in events(run, "step.commit") if r["step"] == verdict["step"]]
    assert len(at_step) == 3 and len({r["checksum"] for r in at_step}) == 1  # every group's
    (quarantine,) = events(run, "data.quarantine")
    assert (quarantine["key"], quarantine["found"]) == (poison["key"], "nonfinite")
    assert [r for r in events(run, "failure") if r["t"] >= poison["t"]] == []
    later = [r for r in events(run, "step.commit") if r["t"] > quarantine["t"] + 1.0]
    assert {r["replica"] for r in later} == {0, 1, 2}, "not every group trains on"
    assert "the data is to blame, not the replica" in out
    report = (tmp_path / "run" / "report.md").read_text()
    assert "sequences quarantined: 1; failures blamed on data: 0; non-finite losses" in report


def _corrupted_copy(dst: Path, every: int) -> tuple[list[int], int]:
    """The default corpus copied to ``dst`` with id ``vocab`` every ``every`` tokens of its
    training split; its manifest's checksum recomputed, its ``max_token_id`` left as it was.
    Returns the bad offsets and the sequence length a chunk spans."""
    src = corpus_for_job(None).path
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    tokens = np.fromfile(dst / "tokens.bin", dtype=m["dtype"])
    offsets = list(range(every, m["splits"]["train"]["end"], every))
    tokens[offsets] = m["vocab_size"]
    tokens.tofile(dst / "tokens.bin")
    m["files"]["tokens.bin"]["xxh3_128"] = file_checksum(dst / "tokens.bin")
    (dst / "manifest.json").write_text(json.dumps(m))
    return offsets, m["vocab_size"]


def test_a_corrupted_corpus_trains_to_its_last_step_with_each_bad_chunk_quarantined(tmp_path):
    corpus = tmp_path / "corpus"
    offsets, vocab = _corrupted_copy(corpus, 50_000)

    verify = subprocess.run(
        [sys.executable, "-m", "harness", "data", "verify", str(corpus), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 1, verify.stdout[-2000:]
    assert f"id {vocab} at offset {offsets[0]} is outside the vocabulary" in verify.stdout
    assert f"{len(offsets)} id(s) outside the vocabulary" in verify.stdout

    steps, seq_len = 250, 32
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        textwrap.dedent(
            f"""
            name = "corrupted"
            replicas = 3
            ranks = 1
            steps = {steps}
            model = {{ kind = "tiny", dim = 64, layers = 2, heads = 4 }}
            checkpoint = {{ every_steps = 0 }}

            [data]
            policy = "replay"
            kind = "tokens"
            corpus = "{corpus}"
            seq_len = {seq_len}
            batch_size = 8
            """
        )
    )
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness", "run", str(cfg), "--out", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    (end,) = events(run, "job.end")
    assert end["status"] == "ok" and end["steps"] == steps, end
    assert events(run, "failure") == []  # no group failed: none was condemned or restarted
    found = events(run, "data.quarantine")
    assert found, "250 steps of 3 x 8 sequences read no bad chunk: pick a denser corruption"
    bad = np.asarray(offsets)
    for q in found:
        assert q["found"] == "vocabulary" and len(q["groups"]) == 1
        span = bad[(bad >= q["offset"]) & (bad <= q["offset"] + seq_len)]
        assert len(span), (q, "no planted id in the quarantined chunk")
        assert f"quarantined chunk {q['key']} of the corpus (offset {q['offset']}, document " in out
