"""Every input a user or a file can supply ends in a one-line message and an exit status, never
a traceback, a hang or an endless retry (issue #31).

Each case of :data:`CASES` builds its input under a temporary directory and runs the real command
line as a user would (``python -m harness ...`` in a subprocess, with a timeout). ``run`` and
``chaos`` get ``--launcher slurm`` outside any SLURM allocation, so that should a check ever let
the input through, the command still stops before it launches anything (and the test fails: the
message would not name the problem). ``PATH`` holds only an empty folder of the case's own: no
SLURM command of the machine is ever run.

Journals are the one kind of input that is not refused: ``ftharness report`` skips the records
no reader can use (``runtime.journal.read_journal``), reports on the rest and says what it
skipped in one line (exit status 0 when no hypothesis fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "experiments" / "tiny.toml"
DEEP = 3000  # tomllib and json raise RecursionError well before this depth


@dataclass(frozen=True)
class Case:
    """``argv(tmp)`` builds the input under ``tmp`` and returns the command's arguments; the one
    line on stderr must match ``says``; ``rc``: the exit status (None: any but 0)."""

    argv: Callable[[Path], list[str]]
    says: str
    rc: int | None = None


def _file(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _experiment(job: str) -> str:
    """A valid experiment but for what ``job`` (a TOML line or table) holds."""
    return (
        'name = "bad"\nsteps = 5\npolicies = ["in_place"]\n' + job + "\n"
        '[schedule]\nkind = "at_steps"\nat_steps = [2]\n'
        "[faults]\nmix = { kill = 1 }\n"
    )


def _run(*args: str) -> list[str]:
    return ["run", *args, "--launcher", "slurm"]


def _chaos(path: Path) -> list[str]:
    return ["chaos", str(path), "--launcher", "slurm"]


def _journal(tmp: Path, bad: dict | str) -> list[str]:
    """A small, sound run journal with one bad line appended; ``report`` on its folder."""
    stamp = {"job": "j", "policy": "in_place"}
    commit = {"event": "step.commit", "replica": 0, "rank": 0, "loss": 2.0, "samples": 8}
    fault = {"fault_id": "f0", "kind": "kill", **stamp}
    lines = [
        {"t": 1.0, "event": "job.start", "config": {}, **stamp},
        *({"t": 1.0 + s, "step": s, **commit, **stamp} for s in range(1, 4)),
        {"t": 2.2, "event": "fault.inject", "target": {"replica": 0}, **fault},
        {"t": 2.3, "event": "fault.heal", **fault},
        {"t": 5.0, "event": "job.end", "status": "ok", **stamp},
    ]
    lines.sort(key=lambda r: r["t"])
    text = "".join(json.dumps(r) + "\n" for r in lines)
    _file(tmp, "run/journal.jsonl", text + (bad if isinstance(bad, str) else json.dumps(bad)))
    return ["report", str(tmp / "run")]


def _record(tmp: Path, content: str, command: str = "status") -> list[str]:
    _file(tmp, "sub/slurm.json", content)
    return ["slurm", command, str(tmp / "sub")]


def _agent(tmp: Path, *extra: str, controller: str = "127.0.0.1:1") -> list[str]:
    secret = _file(tmp, "secret", "ab" * 16)
    secret.chmod(0o600)
    return ["agent", "--controller", controller, "--secret-file", str(secret), "--name", "h1",
            *extra]  # fmt: skip


def _dir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def _inline_job(tmp: Path, override: str, job: str = "replicas = 2") -> list[str]:
    job = f'overrides = ["{override}"]\n[job]\n{job}\nsteps = 5'
    return _chaos(_file(tmp, "e.toml", _experiment(job)))


def _fault(target: object) -> dict:
    return {"t": 2.5, "event": "fault.inject", "fault_id": "f1", "kind": "kill", "target": target}


def _fault_option(tmp: Path, kind: str, line: str) -> list[str]:
    """An experiment whose ``[faults.options.KIND]`` table holds ``line``."""
    text = _experiment("[job]\nreplicas = 2\nsteps = 5") + f"[faults.options.{kind}]\n{line}\n"
    return _chaos(_file(tmp, "e.toml", text))


def _prepare(tmp: Path, name: str, content: str) -> list[str]:
    """``data prepare`` of a source folder holding one file ``name``."""
    _file(tmp, f"src/{name}", content)
    return ["data", "prepare", str(tmp / "src"), "--out", str(tmp / "out"), "--quiet"]


def _copy(tmp: Path, content: str | bytes) -> list[str]:
    """A run whose saved experiment copy (RUN/experiment.toml) holds ``content``."""
    _file(tmp, "run/experiment.toml", content)
    return _journal(tmp, "")


CASES: dict[str, Case] = {
    # -- a job config file (harness.tomlfile, at the edge of harness.config.load_config) -------
    "run: a deeply nested TOML": Case(
        lambda t: _run(str(_file(t, "deep.toml", "steps = " + "[" * DEEP + "]" * DEEP))),
        r"^ftharness run: config file .*deep\.toml'?: nested deeper than 32",
    ),
    "run: a config that is not UTF-8": Case(
        lambda t: _run(str(_file(t, "latin1.toml", b'name = "caf\xe9"\n'))),
        r"^ftharness run: config file .*latin1\.toml' is not UTF-8 text \(at byte 11\)",
    ),
    "run: a directory named x.toml": Case(
        lambda t: _run(str(_dir(t, "x.toml"))),
        r"^ftharness run: config file .*x\.toml' is not a regular file",
    ),
    "run: an empty module name for module:function": Case(
        lambda t: _run(":make"), r"^ftharness run: config function ':make' cannot be loaded"
    ),
    # -- --set overrides -------------------------------------------------------------------------
    "run: --set a deeply nested value": Case(
        lambda t: _run(str(TINY), "--set", "steps=" + "[" * DEEP + "]" * DEEP),
        r"^ftharness run: override steps: nested deeper than 32",
    ),
    "run: model.dim = 1048576": Case(
        lambda t: _run(str(TINY), "--set", "model.dim=1048576"),
        r"^ftharness run: model\.dim = 1048576, model\.layers = 2 .* must be <= 32 GiB",
    ),
    # -- an experiment file (experiments.spec.load_experiment) -----------------------------------
    "chaos: a deeply nested experiment": Case(
        lambda t: _chaos(_file(t, "e.toml", "seed = " + "[" * DEEP + "]" * DEEP)),
        r"^ftharness chaos: experiment file .*e\.toml'?: nested deeper than 32",
    ),
    "chaos: an experiment that is not UTF-8": Case(
        lambda t: _chaos(_file(t, "e.toml", b"name = 'x'\n# \xff\xfe\n")),
        r"^ftharness chaos: experiment file .*e\.toml' is not UTF-8 text",
    ),
    "chaos: a directory named x.toml": Case(
        lambda t: _chaos(_dir(t, "x.toml")),
        r"^ftharness chaos: experiment file .*x\.toml' is not a regular file",
    ),
    "chaos: nested past the limit, though tomllib could parse it": Case(
        lambda t: _chaos(_file(t, "e.toml", _experiment("[job]\nsteps = " + "[" * 40 + "]" * 40))),
        r"^ftharness chaos: experiment file .*e\.toml'?: nested deeper than 32",
    ),
    "chaos: inline job with overrides = ['name.x=1']": Case(
        lambda t: _inline_job(t, "name.x=1"),
        r"^ftharness chaos: .*e\.toml: job: name is a value, not a table",
    ),
    "chaos: inline job with overrides = ['model.layers=1000000000']": Case(
        lambda t: _inline_job(t, "model.layers=1000000000"),
        r"^ftharness chaos: .*: job: model\.dim = 64, model\.layers = 1000000000 .* <= 32 GiB",
    ),
    "chaos: inline job with an override of 5000 digits": Case(
        lambda t: _inline_job(t, "steps=" + "9" * 5000),
        r"^ftharness chaos: .*e\.toml: job: override steps: .*4300 digits",
    ),
    "chaos: inline job with an override into a value": Case(
        lambda t: _inline_job(t, "model.dim=8", job="model = 5"),
        r"^ftharness chaos: .*e\.toml: job: model = 5: must be a table",
    ),
    # -- ftharness slurm --------------------------------------------------------------------------
    "slurm submit: invalid TOML": Case(
        lambda t: ["slurm", "submit", str(_file(t, "bad.toml", "steps = = 3\n"))],
        r"^ftharness slurm submit: config .*bad\.toml' is not valid TOML",
    ),
    "slurm submit: a config that is not UTF-8": Case(
        lambda t: ["slurm", "submit", str(_file(t, "bad.toml", b"# \xff\n"))],
        r"^ftharness slurm submit: config .*bad\.toml' is not UTF-8 text",
    ),
    "slurm submit: --out with a newline": Case(
        lambda t: ["slurm", "submit", str(TINY), "--out", str(t / "a\ntouch pwned")],
        r"^ftharness slurm submit: out '.*' holds a control character",
    ),
    "slurm submit: no sbatch on this machine": Case(
        lambda t: ["slurm", "submit", str(TINY), "--out", str(t / "out")],
        r"^ftharness slurm submit: sbatch: .*No such file",
        rc=1,
    ),
    "slurm status: a slurm.json that is not JSON": Case(
        lambda t: _record(t, '{"job_id": "12'),
        r"^ftharness slurm: .*slurm\.json cannot be read: JSONDecodeError",
    ),
    "slurm status: a deeply nested slurm.json": Case(
        lambda t: _record(t, "[" * DEEP + "]" * DEEP),
        r"^ftharness slurm: .*slurm\.json cannot be read: RecursionError",
    ),
    "slurm status: a job id that is an option": Case(
        lambda t: _record(t, '{"job_id": "--help"}'),
        r"^ftharness slurm: .*slurm\.json holds no valid job_id",
    ),
    "slurm status: no scontrol on this machine": Case(
        lambda t: _record(t, '{"job_id": "42"}'),
        r"^ftharness slurm status: scontrol: .*No such file",
        rc=1,
    ),
    "slurm cancel: no scancel on this machine": Case(
        lambda t: _record(t, '{"job_id": "42"}', "cancel"),
        r"^ftharness slurm cancel: scancel: .*No such file",
        rc=1,
    ),
    # -- ftharness report on a journal (runtime.journal.read_journal) ---------------------------
    "report: a step.commit without a step": Case(
        lambda t: _journal(t, {"t": 4.5, "event": "step.commit", "replica": 1, "loss": 1.0}),
        r"^ftharness report: skipped journal line .*journal\.jsonl:8: step\.commit without 'step'",
        rc=0,
    ),
    "report: a step.commit with a non-numeric step": Case(
        lambda t: _journal(t, {"t": 4.5, "event": "step.commit", "replica": 1, "step": "x"}),
        r"^ftharness report: skipped .*:8: 'step' must be an integer \(got 'x'\)",
        rc=0,
    ),
    "report: a fault.inject whose target is a number": Case(
        lambda t: _journal(t, _fault(5)),
        r"^ftharness report: skipped .*:8: 'target' must be a table of replica, rank, host",
        rc=0,
    ),
    "report: a fault.inject whose target's replica is a list": Case(
        lambda t: _journal(t, _fault({"replica": [1]})),
        r"^ftharness report: skipped .*:8: 'target\.replica' must be an integer",
        rc=0,
    ),
    "report: a deeply nested journal line": Case(
        lambda t: _journal(t, "[" * DEEP + "]" * DEEP + "\n"),
        r"^ftharness report: skipped .*:8: nested too deeply to read",
        rc=0,
    ),
    "report: an experiment copy that is not UTF-8": Case(
        lambda t: _copy(t, b"# \xff\n"),
        r"^ftharness report: experiment copy .*experiment\.toml' is not UTF-8 text",
        rc=2,
    ),
    "report: an experiment copy whose hypotheses are not a table": Case(
        lambda t: _copy(t, "hypotheses = 3\n"),
        r"^ftharness report: .*experiment\.toml: hypotheses: must be a table",
        rc=2,
    ),
    # -- ftharness agent ---------------------------------------------------------------------
    "agent: --dial-timeout -1": Case(
        lambda t: _agent(t, "--dial-timeout", "-1"),
        r"^ftharness agent: --dial-timeout -1\.0: must be a number of seconds > 0",
    ),
    "agent: --dial-timeout nan (retried forever)": Case(
        lambda t: _agent(t, "--dial-timeout", "nan"),
        r"^ftharness agent: --dial-timeout nan: must be a number of seconds > 0",
    ),
    "agent: --dial-timeout inf": Case(
        lambda t: _agent(t, "--dial-timeout", "inf"),
        r"^ftharness agent: --dial-timeout inf: must be a number of seconds > 0",
    ),
    "agent: a port past 65535": Case(
        lambda t: _agent(t, controller="127.0.0.1:99999"),
        r"^ftharness agent: --controller '127\.0\.0\.1:99999': expected HOST:PORT \(PORT 1",
    ),
    # -- round three (issue #49): options and keys once accepted, failing later or never -------
    "chaos: bitflip where = 'x'": Case(
        lambda t: _fault_option(t, "bitflip", 'where = "x"'),
        r"^ftharness chaos: .*faults\.options\.bitflip: .*'where' must be one of 'weights', "
        r"'optimizer', 'any', got 'x'",
        rc=2,
    ),
    "chaos: bitflip bit = 64": Case(
        lambda t: _fault_option(t, "bitflip", "bit = 64"),
        r"^ftharness chaos: .*faults\.options\.bitflip: bitflip: bit must be -1 .* or 0-63",
        rc=2,
    ),
    "chaos: bitflip bit = 10**20": Case(
        lambda t: _fault_option(t, "bitflip", f"bit = {10**20}"),
        r"^ftharness chaos: .*faults\.options\.bitflip: .*(bit must be -1|integer)",
        rc=2,
    ),
    "chaos: bitflip bit = 'x'": Case(
        lambda t: _fault_option(t, "bitflip", 'bit = "x"'),
        r"^ftharness chaos: .*faults\.options\.bitflip: .*'bit' must be an integer, got 'x'",
        rc=2,
    ),
    "chaos: bitflip bit = true": Case(
        lambda t: _fault_option(t, "bitflip", "bit = true"),
        r"^ftharness chaos: .*faults\.options\.bitflip: .*'bit' must be an integer, got True",
        rc=2,
    ),
    "chaos: controller_crash wait_s = 'x'": Case(
        lambda t: _fault_option(t, "controller_crash", 'wait_s = "x"'),
        r"^ftharness chaos: .*controller_crash: .*'wait_s' must be a number, got 'x'",
        rc=2,
    ),
    "run: a NUL in network.interface": Case(
        lambda t: _run(str(TINY), "--set", 'network.interface="lo\\u0000x"'),
        r"^ftharness run: network\.interface = 'lo\\x00x': holds a NUL character",
        rc=2,
    ),
    "run: a NUL in program.command": Case(
        lambda t: _run(str(TINY), "--set", 'program.command=["python", "a\\u0000.py"]'),
        r"^ftharness run: program\.command\[1\] = 'a\\x00\.py': holds a NUL character",
        rc=2,
    ),
    "run: bind_host = ''": Case(
        lambda t: _run(str(TINY), "--set", 'bind_host=""'),
        r"^ftharness run: bind_host = '': must be an address or host name",
        rc=2,
    ),
    "run: recovery.stragglers.window = 10**12": Case(
        lambda t: _run(str(TINY), "--set", f"recovery.stragglers.window={10**12}"),
        r"^ftharness run: recovery\.stragglers\.window = 1000000000000: must be <= 100000",
        rc=2,
    ),
    "run: data.eval_batches = 10**12": Case(
        lambda t: _run(str(TINY), "--set", f"data.eval_batches={10**12}"),
        r"^ftharness run: data\.eval_batches = 1000000000000: must be <= 4096",
        rc=2,
    ),
    "run: data.corpus = ''": Case(
        lambda t: _run(str(TINY), "--set", 'data.kind="tokens"', "--set", 'data.corpus=""'),
        r"^ftharness run: data\.corpus = '': must be the folder",
        rc=2,
    ),
    "data prepare: a .jsonl line nested deeply": Case(
        lambda t: _prepare(t, "a.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
        r"^ftharness data prepare: .*a\.jsonl:1: nested too deeply to read",
        rc=2,
    ),
}


def run_cli(argv: list[str], tmp: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m harness ARGV`` from ``tmp``, with only ``tmp/bin`` on PATH and no SLURM
    allocation in the environment."""
    (tmp / "bin").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = str(tmp / "bin")
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv],
        cwd=tmp,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_ends_in_one_line_and_an_exit_status(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    argv = case.argv(tmp_path)
    try:
        done = run_cli(argv, tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: no answer within 60 s (a hang or an endless retry)")
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    if case.rc is None:
        assert done.returncode != 0, output[-3000:]
    else:
        assert done.returncode == case.rc, output[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert re.search(case.says, lines[0]), lines[0]
    assert len(lines[0]) < 400, lines[0]  # a message, not a dump of the input
    assert not (tmp_path / "pwned").exists()
