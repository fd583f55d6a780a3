"""The pure pieces behind tests/unit/test_bad_input.py (issue #31): the TOML edge, the journal
reader's record contract, config bounds and overrides, the checkpoint loader, the sbatch script's
quoting, and the mode of a program's log."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.config import ConfigError, load_config
from harness.tomlfile import MAX_DEPTH, parse_toml, read_toml
from runtime.journal import read_journal

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "experiments" / "tiny.toml")


# -- harness.tomlfile -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("v = " + "[" * 3000 + "]" * 3000, f"nested deeper than {MAX_DEPTH}"),
        ("v = " + "{a=" * 3000 + "1" + "}" * 3000, f"nested deeper than {MAX_DEPTH}"),
        ("v = " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper"),
        ("v = " + "9" * 5000, "4300 digits"),
        ("v = = 1", "is not valid TOML"),
    ],
)
def test_parse_toml_turns_every_failure_into_the_callers_error(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_toml(text, "x", ConfigError)


def test_parse_toml_keeps_the_decode_error_as_the_cause_of_invalid_toml_only() -> None:
    with pytest.raises(ConfigError) as bad:
        parse_toml("v = a b", "x", ConfigError)
    assert type(bad.value.__cause__).__name__ == "TOMLDecodeError"
    with pytest.raises(ConfigError) as deep:
        parse_toml("v = " + "[" * 3000 + "]" * 3000, "x", ConfigError)
    assert deep.value.__cause__ is None
    depth = MAX_DEPTH  # exactly the limit is accepted
    assert parse_toml("v = " + "[" * depth + "]" * depth, "x")["v"]


def test_read_toml_names_the_file_and_the_problem(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(b"a = 1\n\xff\n")
    os.mkfifo(tmp_path / "fifo.toml")  # reading it would block until a writer came
    cases = {
        tmp_path / "none.toml": "does not exist",
        tmp_path / "dir.toml": "is not a regular file",
        tmp_path / "fifo.toml": "is not a regular file",
        tmp_path / "bin.toml": r"is not UTF-8 text \(at byte 6\)",
        "a\0b.toml": "embedded null byte",
    }
    for path, says in cases.items():
        with pytest.raises(ValueError, match=says):
            read_toml(path, "config file")
        with pytest.raises(ValueError, match=re.escape(repr(str(path)))):
            read_toml(path, "config file")


# -- harness.config: overrides and size bounds --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["name.x=1"], "name is a value, not a table"),
        (["steps=" + "[" * 3000 + "]" * 3000], "override steps: nested deeper"),
        (["steps=" + "9" * 5000], "override steps: .*4300 digits"),
        (["model.dim=1048576"], r"model.dim = 1048576, .* must be <= 32 GiB"),
        (["model.layers=1000000000"], r"model.layers = 1000000000 .* must be <= 32 GiB"),
        (["model.dim=8192", "model.layers=64", "model.heads=64"], "must be <= 32 GiB"),
        (["data.batch_size=" + "9" * 400], "data.batch_size: an integer of 400 digits"),
    ],
)
def test_bad_overrides_are_config_errors(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(TINY, overrides)


def test_model_bounds_leave_room_for_real_debug_models() -> None:
    # llama3's debug size, a GPT-2 small and a 1B-class model all fit; 2B parameters is the edge
    for dim, layers, heads in ((256, 6, 8), (768, 12, 12), (2048, 16, 16), (4096, 8, 32)):
        overrides = [f"model.dim={dim}", f"model.layers={layers}", f"model.heads={heads}"]
        cfg = load_config(TINY, [*overrides, "data.vocab_size=32000"])
        assert (cfg.model.dim, cfg.model.layers) == (dim, layers)


def test_an_override_through_a_value_in_the_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text("model = 5\n")
    with pytest.raises(ConfigError, match="model = 5: must be a table"):
        load_config(str(path), ["model.dim=8"])


@pytest.mark.parametrize("source", [":make", "..x:make", "os:sep"])
def test_a_bad_module_function_is_a_config_error(source: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(source))):
        load_config(source)


def test_an_experiments_inline_job_takes_overrides_as_run_does(tmp_path: Path) -> None:
    from experiments.runner import job_config
    from experiments.spec import ExperimentError, load_experiment

    text = (
        'name = "e"\nsteps = 5\noverrides = [OVERRIDES]\n[job]\nreplicas = 2\nsteps = 5\n'
        '[schedule]\nkind = "at_steps"\nat_steps = [2]\n[faults]\nmix = { kill = 1 }\n'
    )
    path = tmp_path / "e.toml"
    path.write_text(text.replace("OVERRIDES", '"name.x=1"'))
    with pytest.raises(ExperimentError, match="job: name is a value, not a table"):
        load_experiment(path)
    path.write_text(text.replace("OVERRIDES", '"model.dim=32"'))
    spec = load_experiment(path)
    assert dict(spec.job_table or {}) == {"replicas": 2, "steps": 5}  # as written
    assert job_config(spec, "in_place").model.dim == 32  # the overrides applied by the runner


# -- runtime.journal.read_journal: the record contract -----------------------------------------


def test_the_reader_skips_records_whose_fields_no_reader_could_use(tmp_path: Path) -> None:
    good = {"t": 1.0, "event": "step.commit", "replica": 0, "rank": 0, "step": 1, "loss": 2.0}
    bad = [
        ({**good, "step": None}, "step.commit without 'step'"),
        ({**good, "step": "3"}, "'step' must be an integer (got '3')"),
        ({**good, "step": 2**70}, "'step' must be an integer"),
        ({**good, "replica": [0]}, "'replica' must be an integer (got a list of 1)"),
        ({**good, "loss": "low"}, "'loss' must be a number"),
        ({**good, "policy": 3}, "'policy' must be a string"),
        ({**good, "seqs": [[0, 2**40]]}, "'seqs' must be a list of [first, end] integer ranges"),
        ({**good, "seqs": [[0, 8]]}, "'seqs' without 'seq_due'"),
        ({"t": 1.0, "event": "fault.inject", "target": {}}, "fault.inject without 'kind'"),
        ({"t": 1.0, "event": "fault.inject", "kind": "kill", "target": 5}, "'target' must be"),
        ({"t": 1.0, "event": "fault.inject", "kind": "kill", "target": {"host": [1]}},
         "'target.host' must be a string or an integer"),
    ]  # fmt: skip
    lines = [json.dumps(good)] + [json.dumps(r) for r, _ in bad]
    lines.append("[" * 5000 + "]" * 5000)
    lines.append('{"t": 1.0, "event": "x", "big": ' + "9" * 5000 + "}")
    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems: list[str] = []
    assert read_journal(path, problems=problems) == [good]
    whys = [p.split(": ", 1)[1] for p in problems]
    for (_, says), why in zip(bad, whys, strict=False):
        assert why.startswith(says), (says, why)
    assert whys[-2:] == ["nested too deeply to read", "not valid JSON (a torn write?)"]


def test_what_the_writers_write_is_never_skipped(tmp_path: Path) -> None:
    """Null where a writer does not know a value, a host named by a number (a standalone
    trainer), participants as a list (a program's quorum), a service fault's empty target."""
    records = [
        {"t": 1.0, "event": "proc.start", "replica": 0, "rank": 0, "host": 0, "pid": 7,
         "spare": False},
        {"t": 2.0, "event": "fault.inject", "fault_id": "f000", "kind": "lighthouse_crash",
         "target": {"replica": None, "rank": None, "host": None}, "seed": 1, "step": None},
        {"t": 3.0, "event": "step.commit", "replica": 0, "rank": 0, "step": 1, "loss": float("nan"),
         "checksum": None, "participants": [0, 1], "seqs": [[0, 8]], "seq_due": 8},
        {"t": 4.0, "event": "recovery.phase", "recovery_id": "rec-1", "fault_id": None,
         "replica": None, "phase": "detected", "cause": "signal"},
    ]  # fmt: skip
    path = tmp_path / "j.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    problems: list[str] = []
    assert len(read_journal(path, problems=problems)) == len(records), problems


def test_no_mutation_of_a_field_crashes_the_report_pipeline(tmp_path: Path) -> None:
    """For every field of every event of a simulated run, a handful of wrong values: the
    records that read_journal returns never crash the summary, the hypotheses, the Markdown or
    the HTML dashboard."""
    from sim_journal import simulate

    from dashboards.html import render_dashboard
    from dashboards.metrics import summarize
    from experiments.report import evaluate_hypotheses, render_markdown
    from experiments.spec import parse_hypotheses

    recs = [r for r in simulate("in_place") if r["t"] < 1_004.0]  # a fault and its recovery
    for r in recs:  # the data-coverage fields of the built-in trainer
        if r["event"] == "step.commit":
            r.update(seqs=[[r["step"] * 8, r["step"] * 8 + 8]], seq_due=r["step"] * 8)
    every = {k: True for k in ("loss_finite", "committed_steps_rise", "journal_complete",
                               "replicas_equal_after_heal", "every_fault_recovered")}  # fmt: skip
    hypotheses = parse_hypotheses({**every, "goodput_min": 0.1, "steps_lost_max": 9})
    missing = object()
    wrong: list[Any] = [missing, "x", 1.5, -1, True, [1], {"a": 1}, 10**400, [[0, 10**12]]]
    first_of: dict[str, int] = {}
    for i, r in enumerate(recs):
        first_of.setdefault(r["event"], i)
    path = tmp_path / "j.jsonl"
    for i in first_of.values():
        for key in sorted(set(recs[i]) - {"t", "event"}):
            for value in wrong:
                mutated = copy.deepcopy(recs)
                if value is missing:
                    del mutated[i][key]
                else:
                    mutated[i][key] = value
                path.write_text("".join(json.dumps(r) + "\n" for r in mutated))
                problems: list[str] = []
                records = read_journal(path, problems=problems)
                summary = summarize(records)
                results = evaluate_hypotheses(
                    hypotheses, summary, records, journal_problems=problems, postrun={}
                )
                render_markdown(summary, results)
                render_dashboard(records, summary)


# -- harness.rank.checkpoint.load_latest ----------------------------------------------------------


def test_a_deeply_nested_manifest_is_skipped_like_a_corrupt_one(tmp_path: Path) -> None:
    from harness.rank.checkpoint import load_latest, save

    save(tmp_path, 10, {"w": 1})
    (tmp_path / "step_00000020.json").write_text("[" * 5000 + "]" * 5000)
    (tmp_path / "step_00000030.json").write_bytes(b'{"step": 30, "file": "\xff"}')
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded[0] == 10


# -- experiments.slurm_submit: the script quotes what it interpolates ----------------------------

HOSTILE = "my runs/x$(touch pwned)`touch pwned2`;touch pwned3 'q\" #c %j"


def _script(run_dir: str, python: str, **kw: Any) -> str:
    from experiments.slurm_submit import sbatch_script

    args = dict(
        name="tiny", source=f"{run_dir}/exp $(touch pwned4).toml", experiment=False,
        run_dir=run_dir, nodes=2, workdir=run_dir, python=python, partition="p q",
        extra=["--comment=a b"],
    )  # fmt: skip
    return sbatch_script(**{**args, **kw})


def _sbatch_args(line: str) -> list[str]:
    """The arguments of an ``#SBATCH`` line as sbatch reads them (src/sbatch/opt.c,
    ``_get_argument``): quotes group, a backslash escapes the next character (quoted or not),
    an unquoted ``#`` ends the line."""
    args: list[str] = []
    text = line.removeprefix("#SBATCH")
    i, cur, quote, started = 0, "", "", False
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur, started, i = cur + text[i + 1], True, i + 2
            continue
        if quote:
            if c == quote:
                quote = ""
            else:
                cur += c
        elif c in "\"'":
            quote, started = c, True
        elif c == "#":
            break
        elif c.isspace():
            if started:
                args.append(cur)
            cur, started = "", False
        else:
            cur, started = cur + c, True
        i += 1
    if started:
        args.append(cur)
    return args


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("requeue", [False, True])
def test_a_hostile_run_directory_stays_one_word_and_runs_nothing(
    tmp_path: Path, requeue: bool
) -> None:
    run_dir = tmp_path / HOSTILE
    run_dir.mkdir(parents=True)
    argv_log = tmp_path / "argv.jsonl"
    fake = tmp_path / "fake python"  # a space in the interpreter's path too
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(argv_log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    script = tmp_path / "sbatch.sh"
    script.write_text(_script(str(run_dir), str(fake), requeue=requeue))
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESTART_COUNT": "3"}
    done = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob("pwned*")) and not list(run_dir.glob("pwned*"))
    calls = [json.loads(line) for line in argv_log.read_text().splitlines()]
    source = f"{run_dir}/exp $(touch pwned4).toml"
    out = f"{run_dir}/run-3" if requeue else f"{run_dir}/run"
    first = ["-m", "harness", "run", source, "--launcher", "slurm", "--out", out]
    if requeue:
        first += ["--set", f"checkpoint.dir={run_dir}/checkpoints"]
    assert calls == [first, ["-m", "harness", "report", out]]
    assert f"report in {out}/report.md" in done.stdout
    # What sbatch reads from the #SBATCH lines: every value whole, `%` escaped in the output.
    sbatch = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH"):
            key, _, value = _sbatch_args(line)[0].partition("=")
            sbatch[key] = value
    assert sbatch["--output"] == str(run_dir).replace("%", "%%") + "/slurm-%j.out"
    assert sbatch["--chdir"] == str(run_dir)
    assert sbatch["--partition"] == "p q"
    assert sbatch["--comment"] == "a b"


def test_a_control_character_is_refused_not_written_into_the_script() -> None:
    from experiments.slurm_submit import sbatch_script

    args = dict(name="t", source="/w/e.toml", experiment=False, run_dir="/w/run", nodes=2,
                workdir="/w", python="/usr/bin/python3")  # fmt: skip
    for key in ("run_dir", "source", "workdir", "python", "partition", "time_limit"):
        for bad in ("/x\ntouch pwned", "/x\ry", "/x\0y"):
            with pytest.raises(ValueError, match=f"{key} .* holds a control character"):
                sbatch_script(**{**args, key: bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"extra\[0\] .* holds a control character"):
        sbatch_script(**args, extra=["--comment=a\ntouch pwned"])  # type: ignore[arg-type]


# -- harness.job.program.groups: a program's log is private -----------------------------------


def test_a_programs_log_is_created_0600(tmp_path: Path) -> None:
    """``ProgramGroups.start_groups`` writes each rank's log header before the agent appends the
    program's output; the file it creates is 0600 whatever the umask lets through."""
    from harness.job.program.env import log_name
    from harness.job.program.groups import ProgramGroups
    from runtime.mesh import ProcRef

    cfg = load_config(TINY, ['program.command=["python", "train.py"]', "replicas=1"])

    class FakeController:
        spec = SimpleNamespace(spawn_timeout_s=1.0)

        def spawn_program(self, host: Any, spawn: Any) -> Any:
            done: Future[None] = Future()
            done.set_result(None)
            ref = ProcRef(proc_id="p0", host=str(host), coords=dict(spawn.coords))
            return SimpleNamespace(ref=ref, ready=done, finished=Future())

    (tmp_path / "logs").mkdir(mode=0o700)
    job = SimpleNamespace(
        survivable=False,
        plan=None,
        cfg=cfg,
        run_dir=tmp_path,
        journal=None,
        controller=FakeController(),
    )
    groups = ProgramGroups(job)  # type: ignore[arg-type]
    groups.tap = SimpleNamespace(address="127.0.0.1:1")  # type: ignore[assignment]
    old = os.umask(0o022)  # the usual umask: open(..., "a") would create 0644
    try:
        groups.start_groups([0], {0: "h0"}, {0: 0}, {0: "127.0.0.1:2"})
    finally:
        os.umask(old)
    log = tmp_path / "logs" / log_name(0, 0)
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert log.read_text().startswith("=== ftharness: replica 0 rank 0 incarnation 0")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_slurm_submit_writes_a_hostile_out_directory_quoted(tmp_path: Path) -> None:
    """The whole command: ``ftharness slurm submit --out 'my runs/x$(touch pwned)'`` with a fake
    sbatch: the script it wrote parses, names the directory whole, and running it runs nothing."""
    from test_bad_input import run_cli

    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 4242\n")
    sbatch.chmod(0o755)
    out = tmp_path / "my runs" / "x$(touch pwned)"
    done = run_cli(["slurm", "submit", TINY, "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "slurm.json").read_text())["job_id"] == "4242"
    script = (out / "sbatch.sh").read_text()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert f"--out {shlex.quote(str(out / 'run'))} &" in script
    assert not (tmp_path / "pwned").exists()
