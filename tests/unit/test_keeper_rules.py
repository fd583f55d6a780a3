"""The keeper's rules, without processes: its restart intensity, how it reads the journal's end
and a keeper's liveness, the run files it shares (job.json, keeper.json), and the run lookup of
``ftharness attach | stop | status`` (harness.keeper.keeper, .runctl, .rundir)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from harness.config import load_config
from harness.keeper.keeper import RestartIntensity, describe_exit
from harness.runctl import _where, keeper_alive
from harness.rundir import (
    RunDirError,
    find_job_end,
    find_run,
    read_job_file,
    read_json,
    write_job_file,
    write_json_atomic,
)

TINY = Path(__file__).resolve().parents[2] / "experiments" / "tiny.toml"


def test_restart_intensity_allows_max_restarts_within_the_window_and_then_none() -> None:
    r = RestartIntensity(max_restarts=2, within_s=10.0)
    assert r.allow(0.0) and r.allow(1.0)
    assert not r.allow(5.0)  # a third within 10 s
    assert r.recent == 2  # a refused restart does not count
    assert r.allow(10.5)  # the first has left the window
    assert not r.allow(10.6)


def test_no_restart_at_all_with_max_restarts_0() -> None:
    assert not RestartIntensity(max_restarts=0, within_s=600.0).allow(0.0)


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_find_job_end_reads_the_end_record_and_nothing_else(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    assert find_job_end(journal) is None  # no journal yet
    start = json.dumps({"t": 1.0, "event": "job.start", "reason": "not job.end"})
    _write(journal, [start, '{"t": 2.0, "event": "step.commit", "step": 1}'])
    assert find_job_end(journal) is None
    # a record that merely mentions "job.end", and a torn last line, are not an end
    _write(journal, [start, '{"t": 3.0, "event": "x", "note": "job.end"}', '{"t": 4, "event": "jo'])
    assert find_job_end(journal) is None
    end = {"t": 5.0, "event": "job.end", "status": "ok", "reason": "r", "steps": 3}
    with journal.open("a") as fh:
        fh.write("\n" + json.dumps(end) + "\n")
    assert find_job_end(journal) == end


def test_describe_exit_names_the_signal_or_the_status() -> None:
    assert describe_exit(signal.SIGKILL) == "was killed by SIGKILL"  # wait status of a kill
    assert describe_exit(3 << 8) == "exited with status 3"


def test_a_keeper_is_alive_only_as_the_process_it_recorded(tmp_path: Path) -> None:
    me = psutil.Process()
    assert keeper_alive({"pid": os.getpid(), "create_time": me.create_time()})
    # the same pid with another start time: a recycled pid, not the keeper
    assert not keeper_alive({"pid": os.getpid(), "create_time": me.create_time() - 100})
    assert not keeper_alive({"pid": 2**22 + 1, "create_time": 0})
    assert not keeper_alive(None) and not keeper_alive({"pid": "1"})


def test_json_files_are_replaced_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "keeper.json"
    write_json_atomic(path, {"pid": 1})
    write_json_atomic(path, {"pid": 2})
    assert read_json(path) == {"pid": 2}
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["keeper.json"]  # no temporary left
    assert read_json(tmp_path / "none.json") is None
    path.write_text("[1]")
    with pytest.raises(ValueError, match="not hold a JSON object"):
        read_json(path)


def test_job_file_gives_back_the_config_it_was_given(tmp_path: Path) -> None:
    cfg = load_config(str(TINY), ["steps=7", "recovery.controller_max_restarts=4"])
    write_job_file(tmp_path, cfg, quiet=True, source="experiments/tiny.toml")
    again, job = read_job_file(tmp_path)
    assert again == cfg and job["quiet"] is True
    (tmp_path / "job.json").write_text(json.dumps({"version": 99, "config": {}}))
    with pytest.raises(ValueError, match="version 99"):
        read_job_file(tmp_path)


def test_find_run_takes_a_path_or_a_name_under_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    assert find_run("tiny") == Path("runs/tiny")
    assert find_run(str(tmp_path / "runs" / "tiny")) == tmp_path / "runs" / "tiny"
    with pytest.raises(RunDirError, match="no run 'nope': not a directory nor a run under runs"):
        find_run("nope")
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(RunDirError, match=r"belongs to .*not to you"):
        find_run("tiny")


def test_status_says_what_runs_where_from_the_journal() -> None:
    def start(pid: int, host: str, **where: object) -> dict[str, object]:
        return {"t": 0.0, "event": "proc.start", "pid": pid, "host": host, **where}

    records = [
        start(10, "h0", replica=0, rank=0),
        start(11, "h1", replica=1, rank=0),
        start(12, "h0", spare=True, idle=True),
        {"t": 1.0, "event": "failure", "pid": 11, "replica": 1, "rank": 0},
        start(12, "h0", replica=1, rank=0, spare=True),  # the spare adopted for group 1
        start(13, "h0", spare=True, idle=True),  # and the pool refilled
    ]
    assert _where(records) == [
        "  hosts       h0",
        "  group 0     on h0: rank 0 pid 10",
        "  group 1     on h0: rank 0 pid 12",
        "  spare       on h0: pid 13",
    ]


def test_status_of_a_running_run_names_its_keeper_controller_and_groups(
    tmp_path: Path, capsys
) -> None:
    import argparse

    from harness.runctl import status
    from runtime.control_file import write_control

    me = psutil.Process()
    write_json_atomic(  # this test's own process stands in for the keeper: alive, ours
        tmp_path / "keeper.json",
        {"pid": me.pid, "started": 0.0, "create_time": me.create_time(), "detached": False},
    )
    write_control(tmp_path / "controller.json", ("127.0.0.1", 4000), epoch=2, pid=4242)
    records = [
        {"t": 1.0, "event": "proc.start", "pid": 10, "host": "h0", "replica": 0, "rank": 0},
        {"t": 2.0, "event": "step.commit", "step": 7, "replica": 0, "rank": 0},
        {"t": 3.0, "event": "controller.takeover", "epoch": 2},
    ]
    _write(tmp_path / "journal.jsonl", [json.dumps(r) for r in records])
    assert status(argparse.Namespace(run=str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert f"run {tmp_path}: running" in out
    assert f"keeper      pid {me.pid}" in out
    assert "controller  pid 4242, epoch 2, at 127.0.0.1:4000" in out
    assert "group 0     on h0: rank 0 pid 10" in out
    assert "committed   step 7" in out and "takeovers   1" in out
