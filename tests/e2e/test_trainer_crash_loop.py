"""A failure of the built-in trainer that comes back the same way ends the job, naming it
(issue #50; ``harness.job.trainer_deaths``). The real case: the corpus a job trains on is moved
away while it runs. The running groups train on (their token file is open), but a group killed
then cannot start again: each restart fails the same way in its trainers' construction. The job
used to restart it until the restart intensity gave up (10 tries) and end on "restart intensity
exceeded"; now it ends after ``recovery.deterministic_max`` (3) tries, within seconds, with the
exception, where it is raised and where it happened, on the console and in ``job.end``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from e2e_helpers import events, wait_until

from harness.corpus.cli import corpus_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).parents[2]


def test_a_group_that_cannot_start_again_ends_the_job_in_three_tries_naming_the_cause(tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_for_job(None).path, corpus)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        textwrap.dedent(
            f"""
            name = "moved-corpus"
            replicas = 3
            ranks = 1
            steps = 1000000
            model = {{ kind = "tiny", dim = 64, layers = 2, heads = 4 }}
            checkpoint = {{ every_steps = 0 }}
            recovery = {{ spares_per_host = 0 }}

            [data]
            kind = "tokens"
            corpus = "{corpus}"
            """
        )
    )
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", str(cfg), "--out", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        journal = run / "journal.jsonl"
        assert wait_until(
            lambda: journal.exists() and journal.read_text().count('"step.commit"') >= 30,
            time.monotonic() + 120,
        ), "the job never trained"
        corpus.rename(tmp_path / "moved")
        (victim,) = [r["pid"] for r in events(run, "proc.start") if r.get("replica") == 1]
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out[-4000:]
    assert seconds <= 15, (seconds, out[-4000:])
    (end,) = events(run, "job.end")
    assert end["status"] == "failed"
    reason = end["reason"]
    assert "the trainer fails the same way every time" in reason, reason
    assert "3 deaths in a row with" in reason and "CorpusError" in reason, reason
    assert "no manifest.json" in reason and "while starting" in reason, reason
    assert "restart intensity" not in reason
    tries = [
        r for r in events(run, "supervisor")
        if r.get("supervisor") == "job/replica1" and r.get("cause") == "exception"
    ]  # fmt: skip
    assert len(tries) == 3, tries
    assert "the trainer fails the same way every time" in out
