"""``ftharness slurm submit | status | cancel``: a job or experiment as a SLURM batch job.

``submit CONFIG_OR_EXPERIMENT`` writes a plain, readable sbatch script into a new run directory
(``RUN/sbatch.sh``) and submits it; the script is what a user would write by hand (README,
"Running on a SLURM cluster") and can be edited and resubmitted with ``sbatch RUN/sbatch.sh``.
In it the controller runs on the allocation's first node and starts one host agent per node as
its own job step (``--launcher slurm``); ``--no-kill`` keeps the job alive when a node fails;
``--signal=B:USR1@120`` asks for SIGUSR1 two minutes before the time limit, which the script
passes on to the controller (checkpoint, stop cleanly); the report is written at the end.

A plain script rather than submitit or torchx: the controller is already a long-running command
that manages its own steps, so a library that pickles Python callables (submitit) or models
each replica as a scheduler role (torchx) would add a layer between the user and the one thing
they need to read and adapt to their site (partition, account, modules, time).

``RUN/slurm.json`` records the job id; ``status RUN`` and ``cancel RUN`` read it.

Every value written into the script is quoted for the line it lands on: ``shlex.quote`` on a
command line (a run directory named ``my runs/x$(touch y)`` stays one word and runs nothing),
sbatch's own quoting on an ``#SBATCH`` line (:func:`_sbatch_quote`). A control character is
refused outright: a newline would end a comment or ``#SBATCH`` line and start a command.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.tomlfile import read_toml

SCRIPT = "sbatch.sh"
NO_KILL = "#SBATCH --no-kill                   # a failed node ends its agent's step, not the job"
REQUEUE = "#SBATCH --requeue                   # a failed node ends the job; SLURM requeues it"
RECORD = "slurm.json"
#: A job id as ``sbatch --parsable`` prints it (an array or heterogeneous job's too). Checked
#: before it is passed to scontrol or scancel: a corrupt slurm.json must not pass an option.
JOB_ID = re.compile(r"^[0-9]+([_+][0-9]+)?$")
_SAFE = re.compile(r"^[\w@%+=:,./-]+$")  # needs no quotes, in bash or on an #SBATCH line


def is_experiment(path: str | Path) -> bool:
    """An experiment file has a schedule, faults or an inline job; a job config has none.
    ValueError if the file cannot be read as TOML (harness.tomlfile)."""
    return _is_experiment(read_toml(path, "config", ValueError))


def _is_experiment(data: dict[str, Any]) -> bool:
    return any(k in data for k in ("job", "faults", "schedule", "hypotheses", "policies"))


def control_char(**values: str | None) -> str | None:
    """A message naming the first value holding a control character (newline, CR, NUL...), or
    None: such a value cannot be written into a script line safely."""
    for key, value in values.items():
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
            return f"{key} {value!r} holds a control character; it cannot go into a script line"
    return None


def _sbatch_quote(value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line, which sbatch (not bash) parses: quotes
    group, a backslash escapes the next character, an unquoted ``#`` starts a comment."""
    if _SAFE.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_script(
    *,
    name: str,
    source: str,
    experiment: bool,
    run_dir: str,
    nodes: int,
    workdir: str,
    python: str,
    time_limit: str | None = None,
    partition: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
    signal_s: int = 120,
    requeue: bool = False,
) -> str:
    """The batch script (see the module docstring); every path in it is absolute. With
    ``requeue`` (a job config only) the job is the classic one: a failed node ends it
    (``NODE_FAIL``), SLURM requeues it, and the script's next run writes ``run-N`` (N =
    ``SLURM_RESTART_COUNT``) and resumes from the checkpoints all runs share."""
    if requeue and experiment:
        raise ValueError("requeue applies to a job config, not an experiment")
    problem = control_char(
        name=name, source=source, run_dir=run_dir, workdir=workdir, python=python,
        time_limit=time_limit, partition=partition,
        **{f"extra[{i}]": e for i, e in enumerate(extra)},
    )  # fmt: skip
    if problem is not None:
        raise ValueError(problem)
    # `out` is bash text: the quoted run directory, then what bash must expand (requeue).
    out = shlex.quote(f"{run_dir}/{'chaos' if experiment else 'run'}")
    if requeue:
        out = shlex.quote(f"{run_dir}/run-") + "${SLURM_RESTART_COUNT:-0}"
        extra = ["--open-mode=append", *extra]  # a requeued run appends to the same output
    command = "chaos" if experiment else "run"
    output = run_dir.replace("%", "%%") + "/slurm-%j.out"  # sbatch expands % patterns here
    lines = [
        "#!/bin/bash",
        f"# Written by `ftharness slurm submit` for {source}.",
        f"# Resubmit (after editing) with: sbatch {shlex.quote(f'{run_dir}/{SCRIPT}')}",
        f"#SBATCH --job-name={_sbatch_quote(f'ftharness-{name}')}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        NO_KILL if not requeue else REQUEUE,
        f"#SBATCH --signal=B:USR1@{signal_s}        # before the time limit: checkpoint, stop",
        f"#SBATCH --output={_sbatch_quote(output)}",
        f"#SBATCH --chdir={_sbatch_quote(workdir)}",
    ]
    if time_limit:
        lines.append(f"#SBATCH --time={_sbatch_quote(time_limit)}")
    if partition:
        lines.append(f"#SBATCH --partition={_sbatch_quote(partition)}")
    lines += [f"#SBATCH {_sbatch_quote(opt)}" for opt in extra]
    checkpoints = shlex.quote(f"checkpoint.dir={run_dir}/checkpoints")
    lines += [
        "",
        "set -u",
        f"PYTHON={shlex.quote(python)}",
        "",
        "# The controller runs here, on the first node; it starts one host agent per node as its",
        "# own job step (srun -w NODE --overlap), so a lost node ends one step, not the job.",
        f'"$PYTHON" -m harness {command} {shlex.quote(source)} --launcher slurm --out {out}'
        + (f" --set {checkpoints}" if requeue else "")
        + " &",
        "pid=$!",
        "# SLURM signals this shell only (B:): pass the time-limit signal on to the controller.",
        "trap 'kill -USR1 \"$pid\"' USR1",
        'wait "$pid"; rc=$?',
        "# a trapped signal interrupts wait (status > 128): wait again for the controller to end",
        'while [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
    ]
    if not experiment:  # `ftharness chaos` writes its report itself
        lines.append(f'"$PYTHON" -m harness report {out} > /dev/null || true')
    lines += [f'echo "ftharness: exit status $rc; report in" {out}/report.md', 'exit "$rc"']
    return "\n".join(lines) + "\n"


def _name_of(data: dict[str, Any], source: Path, experiment: bool) -> str:
    name = data.get("name")
    if experiment and not name and isinstance(data.get("job"), dict):
        name = data["job"].get("name")
    return str(name or source.stem)


def submit(args: argparse.Namespace) -> int:
    from harness.rundir import run_dir_for

    source = Path(args.config)
    if not source.exists():
        print(f"ftharness slurm submit: {source} does not exist", file=sys.stderr)
        return 2
    try:
        data = read_toml(source, "config", ValueError)
    except ValueError as exc:
        print(f"ftharness slurm submit: {exc}", file=sys.stderr)
        return 2
    experiment = _is_experiment(data)
    problem = control_char(
        config=str(source.resolve()), out=args.out, partition=args.partition, time=args.time,
        cwd=str(Path.cwd()), python=sys.executable,
        **{f"sbatch option {a!r}": a for a in getattr(args, "sbatch_args", [])},
    )  # fmt: skip
    if problem is not None:
        print(f"ftharness slurm submit: {problem}", file=sys.stderr)
        return 2
    if experiment and getattr(args, "requeue", False):
        print("ftharness slurm submit: --requeue applies to a job config", file=sys.stderr)
        return 2
    problem = _check(source, experiment)
    if problem is not None:
        print(f"ftharness slurm submit: {problem}", file=sys.stderr)
        return 2
    name = _name_of(data, source, experiment)
    run_dir = run_dir_for("slurm submit", args.out, name)
    if run_dir is None:
        return 2
    run_dir = run_dir.resolve()
    script = sbatch_script(
        name=name,
        source=str(source.resolve()),
        experiment=experiment,
        run_dir=str(run_dir),
        nodes=args.nodes,
        workdir=str(Path.cwd()),
        python=sys.executable,
        time_limit=args.time,
        partition=args.partition,
        extra=list(getattr(args, "sbatch_args", [])),
        requeue=getattr(args, "requeue", False),
    )
    path = run_dir / SCRIPT
    path.write_text(script)
    path.chmod(0o755)
    done = _slurm("submit", ["sbatch", "--parsable", str(path)], 60)
    if done is None:
        return 1
    if done.returncode != 0:
        print(f"ftharness slurm submit: sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]
    (run_dir / RECORD).write_text(
        json.dumps({"job_id": job_id, "script": str(path), "submitted": time.time()}) + "\n"
    )
    print(f"submitted job {job_id}; script {path}; status: ftharness slurm status {run_dir}")
    return 0


def _check(source: Path, experiment: bool) -> str | None:
    """Validate the file before anything is submitted (a job that fails at once on a node after
    waiting in the queue is the worst way to learn of a typo)."""
    try:
        if experiment:
            from experiments.runner import with_launcher

            with_launcher(source, "slurm")
        else:
            from harness.config import load_config

            load_config(str(source), ["launcher=slurm"])
    except Exception as exc:
        return str(exc)
    return None


def _slurm(command: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """Run a SLURM command; None (said on stderr) if it is missing or does not answer."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:  # not a SLURM node; a hung controller
        print(f"ftharness slurm {command}: {argv[0]}: {exc}", file=sys.stderr)
        return None


def _record(run: str) -> dict[str, Any] | None:
    """RUN/slurm.json as ``submit`` wrote it, or None (said on stderr)."""
    path = Path(run) / RECORD
    if not path.is_file():
        print(f"ftharness slurm: {path} does not exist (not a submitted run)", file=sys.stderr)
        return None
    try:
        rec = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not JSON, nested deep
        print(f"ftharness slurm: {path} cannot be read: {type(exc).__name__}", file=sys.stderr)
        return None
    job_id = rec.get("job_id") if isinstance(rec, dict) else None
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        print(f"ftharness slurm: {path} holds no valid job_id (corrupt?)", file=sys.stderr)
        return None
    return rec


def job_state(job_id: str) -> str:
    """The job's state from ``scontrol show job`` (kept for ``MinJobAge`` after it ends), or
    UNKNOWN once SLURM has forgotten it."""
    done = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    for word in done.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def status(args: argparse.Namespace) -> int:
    rec = _record(args.run)
    if rec is None:
        return 2
    try:
        state = job_state(rec["job_id"])
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"ftharness slurm status: scontrol: {exc}", file=sys.stderr)
        return 1
    reports = sorted(Path(args.run).glob("*/report.json"))
    print(f"job {rec['job_id']}: {state}")
    for r in reports:
        print(f"report: {r}")
    return 0


def cancel(args: argparse.Namespace) -> int:
    rec = _record(args.run)
    if rec is None:
        return 2
    done = _slurm("cancel", ["scancel", rec["job_id"]], 30)
    if done is None:
        return 1
    if done.returncode != 0:
        print(f"ftharness slurm cancel: {done.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"cancelled job {rec['job_id']}")
    return 0


def main(args: argparse.Namespace) -> int:
    return {"submit": submit, "status": status, "cancel": cancel}[args.slurm_command](args)
