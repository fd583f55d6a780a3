"""The ``ftharness`` command line: run | attach | stop | status | chaos | report | bench | agent |
slurm | data.

This module declares each subcommand's arguments; what implements one is an entry point of the
``ftharness.commands`` group (a bench: ``ftharness.bench``), registered in ``pyproject.toml``, so
that the harness names no module of a higher layer (``experiments``). Each implementation is
imported only when it runs, so ``ftharness --help`` stays fast (no torch import) and a broken
optional part cannot break the others. A bench another package registers is listed too.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points

#: Entry-point groups: subcommand (or bench) name -> ``module:function``; the function takes the
#: parsed Namespace and returns an exit code (None: 0).
COMMANDS_GROUP = "ftharness.commands"
BENCH_GROUP = "ftharness.bench"

#: The help of each bench of ours, in the order ``ftharness bench --help`` lists them.
_BENCH_HELP = {
    "runtime": "spawn, call latency and failure detection of the "
    "supervision tree (and Monarch's, where installed)",
    "recovery": "survivor stall and time-to-participate after a "
    "killed replica group, in-place vs full_restart",
    "transfer": "weight-transfer bandwidth: memcpy, shm, tcp, torchft http and pg",
    "overhead": "fault-free cost of resilience: plain torch.distributed vs torchft vs ftharness "
    "(telemetry off and on), interleaved in one run",
    "telemetry": "training-step overhead of the telemetry",
    "multihost": "recovery across namespace hosts (partition, eviction), cross-host heal "
    "bandwidth and the cost of authenticated frames (root)",
    "slurm_requeue": "the baseline for SLURM node loss: a node of a classic job fails, SLURM "
    "requeues the whole job (root, bin/test-cluster up)",
    "slurm_takeover": "the controller's node of a SLURM job fails: a standby on another node "
    "takes the run over; time without a commit, groups restarted (root, bin/test-cluster up)",
    "scale": "quorum latency and failover (tree quorum vs torchft's Lighthouse) and controller "
    "load, with simulated members and host agents, as the job grows",
    "silent": "silent failures: a bitflip's detection and heal, a 3x straggler under observe "
    "and eject against a control",
    "takeover": "the controller SIGKILLed mid-run again and again: time without a commit, a "
    "new controller serving, workers restarted, steps lost",
    "checkpoint": "what a checkpoint costs a sharded group's step: torch.save files vs DCP, "
    "synchronous and in the background, interleaved in one run",
}


def _registered(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name (reads installed metadata; imports nothing)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def _benches() -> dict[str, str]:
    """Bench name -> help: ours (listed even if not installed, so that running one says what is
    missing), then any other package's, by name."""
    others = {
        name: f"registered by {ep.dist.name if ep.dist else ep.value}"
        for name, ep in sorted(_registered(BENCH_GROUP).items())
        if name not in _BENCH_HELP
    }
    return {**_BENCH_HELP, **others}


def _handler(group: str, name: str) -> Callable[[argparse.Namespace], int | None]:
    """Import and return the implementation of ``name`` in ``group``; SystemExit (status 2)
    saying how to fix it when none is installed (an install older than pyproject.toml)."""
    ep = _registered(group).get(name)
    if ep is None:
        print(
            f"ftharness: no implementation of {name!r} is installed (entry point group "
            f"{group!r}); reinstall: bin/setup, or pip install --no-deps -e .",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return ep.load()


def _add_live_options(parser: argparse.ArgumentParser) -> None:
    """What a running job shows while it runs (``run`` and ``chaos``)."""
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help="serve live Prometheus metrics on the config's bind_host (127.0.0.1 unless "
        "the config says otherwise) at PORT (0 picks a free port; the address is printed)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument(
        "--launcher",
        choices=("local", "netns", "external", "slurm"),
        default=None,
        help="where the host agents run (overrides the config's launcher): slurm = one agent "
        "per node of the SLURM allocation this command runs in (salloc, sbatch)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftharness",
        description="Fault-tolerant pretraining harness with chaos testing. Train through "
        "failures, inject them on purpose, and measure every recovery.",
        epilog="Examples:\n"
        "  ftharness run experiments/tiny.toml --set steps=200\n"
        "  ftharness run experiments/tiny.toml --detach   (then: ftharness attach runs/tiny)\n"
        "  ftharness chaos experiments/quickstart.toml\n"
        "  ftharness report runs/quickstart --html\n"
        "  ftharness bench runtime --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="launch a resilient pretraining job from a config",
        description="Launch a pretraining job that keeps training while failed "
        "replica groups are restarted in place.",
    )
    run.add_argument("config", help="a TOML job config, or module:function returning a JobConfig")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set steps=100 --set "
        "recovery.policy=full_restart (repeatable)",
    )
    run.add_argument(
        "--out",
        default=None,
        help="run directory (journal, checkpoints, logs); must be new or empty. Default "
        "runs/NAME, or runs/NAME-2, -3... if an earlier run holds it",
    )
    _add_live_options(run)
    run.add_argument(
        "--detach",
        action="store_true",
        help="run in the background: print the run directory and return; the output goes to "
        "RUN/console.log (follow it: ftharness attach RUN; stop it: ftharness stop RUN)",
    )
    _add_run_control(sub)

    chaos = sub.add_parser(
        "chaos",
        help="run a chaos experiment and write its report",
        description="Run an experiment file: hypothesis -> schedule -> faults "
        "-> verify. Exits non-zero if a hypothesis fails.",
    )
    chaos.add_argument("experiment", help="an experiment TOML file")
    chaos.add_argument(
        "--out",
        default=None,
        help="experiment directory; must be new or empty. Default runs/NAME, or "
        "runs/NAME-2, -3... if an earlier experiment holds it",
    )
    chaos.add_argument(
        "--resume",
        action="store_true",
        help="finish the experiment in --out whose `ftharness chaos` process died (its node "
        "lost): runs that ended are kept, the rest are run, then the report is written",
    )
    _add_live_options(chaos)

    report = sub.add_parser(
        "report",
        help="recompute a report from a run's journal",
        description="Compute the recovery report (Markdown, JSON, HTML) from "
        "a run or experiment directory's journal.",
    )
    report.add_argument("run_dir", help="a run or experiment directory, or a journal file")
    report.add_argument("--html", action="store_true", help="also write dashboard.html")
    report.add_argument("--json", action="store_true", help="print the report as JSON")

    agent = sub.add_parser(
        "agent",
        help="run a host agent on this machine for a job whose controller runs elsewhere",
        description="Start this host's agent: it dials in to the job's controller, proves the "
        "job secret, and runs the job's workers here until the controller goes away. The secret "
        "is read from a file that only you may read (mode 0600), or from stdin with "
        "--secret-file -; never from the command line, which other users can see.",
    )
    agent.add_argument("--controller", required=True, metavar="HOST:PORT", help="the controller")
    agent.add_argument(
        "--secret-file",
        required=True,
        metavar="PATH",
        help="the job secret (hex), mode 0600; - for stdin",
    )
    agent.add_argument("--name", required=True, help="this host's name in the job (e.g. host1)")
    agent.add_argument(
        "--advertise",
        default=None,
        metavar="ADDR",
        help="the address other hosts reach this one at (default: the local address of the "
        "connection to the controller)",
    )
    agent.add_argument(
        "--dial-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying to reach the controller",
    )
    agent.add_argument(
        "--control-file",
        default=None,
        metavar="PATH",
        help="the run's controller.json: when the controller dies, keep the workers running "
        "and re-dial the one this file names next (needs --grace)",
    )
    agent.add_argument(
        "--grace",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds to keep the workers running without a controller (default 0: stop them)",
    )

    _add_slurm(sub)
    _add_data(sub)

    bench = sub.add_parser("bench", help="benchmarks; the last line printed is a JSON object")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, text in _benches().items():
        b = bench_sub.add_parser(name, help=text, description=text)
        b.add_argument("--json", action="store_true", help="print only the JSON result line")
        b.add_argument("--reps", type=int, default=None, help="repetitions (default per bench)")
        b.add_argument("--quick", action="store_true", help="a smaller, faster variant")
        if name == "recovery":
            b.add_argument(
                "--only",
                metavar="TEXT",
                help="run only the rows whose name contains TEXT, or one of several TEXTs "
                "separated by commas (e.g. program_hsdp, or sharded,2ranks,in_place/tree)",
            )
        if name == "overhead":
            b.add_argument(
                "--only",
                metavar="NAMES",
                help="run only these configurations, separated by commas (e.g. ftharness_fsdp); "
                "the floors their ratios are taken against (plain, and plain_hsdp for "
                "ftharness_fsdp) always run too",
            )
    return parser


def _add_run_control(sub: argparse._SubParsersAction) -> None:
    """``attach | stop | status RUN``: a run that ``ftharness run`` started (docs/controller.md)."""
    what = "RUN: a run directory, or a run's name under runs/"
    attach = sub.add_parser(
        "attach",
        help="follow a running run until it ends",
        description="Print a running run's output as it comes (its console.log when it runs "
        "detached, else its progress from the journal) until it ends. Exits 0 if it ended ok, 1 "
        "if not; Ctrl-C stops following, not the run.",
    )
    attach.add_argument("run", help=what)
    stop = sub.add_parser(
        "stop",
        help="stop a running run cleanly",
        description="Ask a running run's keeper to stop it (SIGTERM): its controller stops the "
        "job cleanly and the journal ends with job.end. Waits for that; exits 0 once the run "
        "has ended, 1 if it has not within --timeout.",
    )
    stop.add_argument("run", help=what)
    stop.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the end (default 120)"
    )
    status = sub.add_parser(
        "status",
        help="what a running run runs where",
        description="A running run's keeper, its controller (pid, epoch, address), its hosts "
        "and groups and their processes, and its last committed step.",
    )
    status.add_argument("run", help=what)


def _add_slurm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slurm",
        help="submit a job or experiment to SLURM; its status; cancel it",
        description="Run a job config or chaos experiment as a SLURM batch job: a readable "
        "sbatch script is written into the run directory (RUN/sbatch.sh) and submitted.",
    )
    s = p.add_subparsers(dest="slurm_command", metavar="SUBCOMMAND", required=True)
    submit = s.add_parser("submit", help="write RUN/sbatch.sh and submit it with sbatch")
    submit.add_argument("config", help="a job config or experiment TOML file")
    submit.add_argument("--nodes", type=int, default=2, help="nodes to allocate (default 2)")
    submit.add_argument("--partition", default=None, help="the SLURM partition")
    submit.add_argument("--time", default=None, help="time limit, e.g. 1:00:00")
    submit.add_argument(
        "--out", default=None, help="run directory (new or empty); default runs/NAME"
    )
    submit.add_argument(
        "--requeue",
        action="store_true",
        help="the classic job, for comparison: no spare nodes, no --no-kill; a failed node ends "
        "the job and SLURM requeues it, resuming from the last checkpoint",
    )
    submit.epilog = "Options after -- are passed to sbatch, e.g. -- --account=A --gres=gpu:8"
    for name, text in (("status", "the job's state and its report"), ("cancel", "scancel it")):
        c = s.add_parser(name, help=text)
        c.add_argument("run", help="the run directory `slurm submit` wrote")


def _add_data(sub: argparse._SubParsersAction) -> None:
    """``ftharness data prepare|verify``: implemented by harness.corpus.cli (defaults:
    PrepareOptions) and harness.corpus.verify."""
    p = sub.add_parser(
        "data", help="prepare a corpus (tokenizer, token file, held-out split), or verify one"
    )
    s = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    prep = s.add_parser(
        "prepare",
        help="tokenize text into a memory-mapped token file with a held-out split",
        description="Train a byte-level BPE tokenizer (or use --tokenizer) and tokenize SOURCE "
        "into DIR: tokens.bin, index.npy (document boundaries), tokenizer.json, manifest.json "
        "(checksums, splits). Rerunning on an unchanged source reuses DIR.",
    )
    prep.add_argument(
        "source",
        nargs="?",
        default=None,
        help="a directory or glob of .txt, .jsonl or .parquet files, or one such file (default: "
        "this interpreter's standard library .py files)",
    )
    prep.add_argument("--out", required=True, help="corpus directory (new, empty or this corpus)")
    prep.add_argument("--vocab-size", type=int, help="of the trained tokenizer (default 2048)")
    prep.add_argument("--heldout", type=float, help="fraction of documents held out (0.01)")
    prep.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    prep.add_argument("--text-key", help="the text field of .jsonl / .parquet (default text)")
    prep.add_argument("--sample-bytes", type=int, help="text the tokenizer trains on (2 MiB)")
    prep.add_argument("--quiet", action="store_true", help="no progress on stderr")
    ver = s.add_parser(
        "verify",
        help="read a prepared corpus whole: checksums, every id within the vocabulary, the "
        "document index (rc 0 clean, 1 problems, 2 not a corpus)",
        description="Read every file of corpus DIR: each checksum against manifest.json, every "
        "token id against the vocabulary (each bad one named with its offset, split and "
        "document), the document index and the tokenizer. Opening a corpus for a run trusts "
        "the manifest's max_token_id; this does not.",
    )
    ver.add_argument("dir", help="a directory `ftharness data prepare` wrote")
    ver.add_argument(
        "--limit", type=int, default=1000, help="bad ids named one by one; the rest are counted"
    )
    ver.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:2] == ["slurm", "submit"] and "--" in argv:  # the rest is sbatch's
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    if args.command == "slurm":
        args.sbatch_args = passthrough
    if args.command == "bench":
        handler = _handler(BENCH_GROUP, args.bench)
        # A bench stopped with SIGTERM (a CI timeout, `kill`) cleans up as after Ctrl-C: its
        # test networks, processes and files are removed by the code that made them.
        signal.signal(signal.SIGTERM, _interrupt)
    else:
        handler = _handler(COMMANDS_GROUP, args.command)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`ftharness report --json | head`)
        # Point stdout at /dev/null so the interpreter's flush at exit does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(main())
