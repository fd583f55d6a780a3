"""The ``[program]`` section of a job config: a training program of the user's own, run
unmodified in place of the built-in trainer (``harness.job.program.groups`` runs it).

    [program]
    kind = "torchft"                       # or "torchtitan"
    command = ["python", "train_ddp.py", "200"]
    env = { LOGLEVEL = "INFO" }

An empty ``command`` (the default) means the built-in trainer. Kept apart from
``harness.config`` so that module only names the section; the checks here return a message
(``harness.config.validate`` raises it as a ConfigError).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.program_proc import PYTHON_NAMES  # run as the agent's own interpreter

#: What every rank of a program gets from ftharness, as a torchft launcher (torchx's
#: ``torchft.torchx`` component, SLURM scripts) would give it.
TORCHFT_ENV = (
    "REPLICA_GROUP_ID",
    "NUM_REPLICA_GROUPS",
    "TORCHFT_LIGHTHOUSE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
#: ... and as torchrun gives it (``harness.job.program.env.torchrun_env``): the group's store is
#: its host agent's, as torchrun's is its agent's.
TORCHRUN_ENV = (
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
)
#: ``program.env`` may not set these.
LAUNCHER_ENV = TORCHFT_ENV + TORCHRUN_ENV
#: Where the group's store is (``harness.job.program.env.torchrun_env``): ftharness's alone.
STORE_ENV = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
#: The flags ftharness adds to a torchtitan command (torchtitan does not read REPLICA_GROUP_ID).
TORCHTITAN_FLAGS = (
    "--fault_tolerance.enable",
    "--fault_tolerance.replica_id",
    "--fault_tolerance.group_size",
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: What a warm start (the default where safe: :func:`cold_reason`) needs.
WARM_NEEDS = (
    "Warm starts (a fork of ftharness's interpreter, torch imported) need command = ['python', "
    "SCRIPT, ...] or ['python', '-m', MODULE, ...]; program.warm = false says cold on purpose"
)
#: ``program.env`` names read when an interpreter, the C runtime or torch's thread pools start:
#: a warm rank (a fork of the agent's interpreter, torch imported) would run with the agent's.
START_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
#: ... except these, which a warm rank applies by hand (``runtime.program_proc``).
WARM_ENV_APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED")


@dataclass(frozen=True, kw_only=True)
class ProgramConfig:
    """A program of the user's own: ``command`` (argv; empty: the built-in trainer), run for
    each rank of each replica group with the launcher environment (:data:`LAUNCHER_ENV`) plus
    ``env``, in ``cwd`` (default: where ftharness was started).

    Liveness: a program has no ftharness heartbeat; its progress is. A group that has made no
    quorum request for ``start_timeout_s`` after it started, or none for
    ``progress_timeout_s`` since its last one (while none is waiting), is hung. Both must
    exceed the program's longest stretch between two quorum requests (a step, with a collective
    waiting out its timeout on a stopped peer, or a checkpoint save).

    ``hooks``: put ftharness's ``sitecustomize`` hook on the program's import path, for the
    in-process faults (``faults.inworker``); off by default (the program then runs exactly as
    it would without ftharness).

    ``warm``: start each rank as a fork of its host agent's interpreter, with torch (and the
    agent's other preloads) already imported, as the built-in trainer's workers start, instead
    of a fresh interpreter: a replacement skips the imports. Unset (the default): warm where it
    is safe (:func:`cold_reason` says when it is not, and the job says so at start); ``true``:
    warm, or the config is refused; ``false``: always a fresh interpreter. What a warm rank sees
    differently: ``runtime.program_proc.fork_program``.

    ``sync_every``: the program's inner steps per quorum request: 1 for a program that asks every
    step (torchft's DDP), torchft's ``sync_every`` for ``LocalSGD`` and ``DiLoCo`` (with N
    Streaming DiLoCo fragments, ``sync_every / N``). The tap sees only the Manager's step, which
    counts syncs; ftharness journals it as inner steps (Manager step x ``sync_every``), so the
    job's ``steps``, ``schedule.at_steps`` and every report's steps (steps lost among them) count
    inner steps, and ``steps`` must be a multiple of it. The tap cannot tell inner steps from
    syncs: a wrong value shows as a group done before the job's last step or asking past it, and
    the job says so. ``progress_timeout_s`` must cover ``sync_every`` inner steps plus a sync.

    ``survivor_grace_s``: after another group dies, a group that asks for no quorum within this
    long (or three of its own usual gaps between requests, if longer) is blocked where nothing
    from outside reaches it, and is restarted (``harness.job.program.progress.blocked_survivor``:
    gloo loses the error of a send under way to the dead group, and the rank would wait out its
    process-group timeout, torchft's default 60 s). 2 s is 30 times what a healthy survivor
    takes here (0.05 s at p95, ``bench recovery``); 0 turns it off (a program whose own
    process-group timeout is shorter than a restart and a heal)."""

    command: tuple[str, ...] = ()
    kind: Literal["torchft", "torchtitan"] = "torchft"
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    start_timeout_s: float = 120.0
    progress_timeout_s: float = 30.0
    hooks: bool = False
    warm: bool | None = None  # unset: warm where safe (python SCRIPT, python -m MODULE), else cold
    sync_every: int = 1  # inner steps per quorum: 1 (DDP), or LocalSGD's/DiLoCo's sync_every
    survivor_grace_s: float = 2.0  # 0: a survivor that never asks again waits out its timeout

    @property
    def enabled(self) -> bool:
        return bool(self.command)

    @property
    def steps_per_quorum(self) -> int:
        """Inner steps per quorum request: ``sync_every`` for a program, 1 for the built-in
        trainer (whose journal counts its own steps)."""
        return self.sync_every if self.enabled else 1

    @property
    def starts_warm(self) -> bool:
        """Whether each rank starts as a fork of its agent (``warm``, else :func:`cold_reason`)."""
        if self.warm is not None:
            return self.warm
        return self.enabled and cold_reason(self) is None


def torchrun_nproc(command: tuple[str, ...]) -> str | None:
    """The ``--nproc_per_node`` (or ``--nproc-per-node``) value of a ``torchrun`` or ``python
    -m torch.distributed.run`` command, ``"1"`` when it gives none (torchrun's default), None
    when ``command`` is not torchrun."""
    if not command:
        return None
    if os.path.basename(command[0]) == "torchrun":
        args = command[1:]
    elif is_python(command[0]) and command[1:3] == ("-m", "torch.distributed.run"):
        args = command[3:]
    else:
        return None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            return value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if arg.endswith(".py"):
            break  # the script: what follows is its own
    return "1"


def is_python(exe: str) -> bool:
    """``exe`` means the interpreter ftharness runs in (``python`` is replaced by it)."""
    return exe in PYTHON_NAMES or exe == sys.executable


def cold_reason(p: ProgramConfig) -> str | None:
    """Why ``p``'s ranks cannot start as a fork of the agent's interpreter, or None. The rules:
    the command must be ``python SCRIPT ...`` or ``python -m MODULE ...`` (``python``,
    ``python3`` or ftharness's own interpreter; not a shell script, a binary, ``env`` or another
    wrapper, another interpreter, or an interpreter option such as ``-u``, ``-X`` or ``-c``,
    which only a fresh interpreter applies), and ``program.env`` must not set a variable read
    when an interpreter or torch starts (:data:`START_ENV_PREFIXES`; ``PYTHONPATH`` and
    ``PYTHONUNBUFFERED`` are applied by hand)."""
    cmd = p.command
    if not cmd:
        return "no program.command"
    if not is_python(cmd[0]):
        return f"program.command[0] = {cmd[0]!r} is not python"
    if len(cmd) < 2:
        return "no script or module after python"
    if cmd[1] == "-m":
        return None if len(cmd) >= 3 else "no module after python -m"
    if cmd[1].startswith("-"):
        return f"interpreter option {cmd[1]!r}: only a fresh interpreter applies it"
    for name in p.env:
        if name.startswith(START_ENV_PREFIXES) and name not in WARM_ENV_APPLIED:
            return (
                f"program.env.{name} is read when the interpreter or torch starts; a warm rank "
                "would run with the agent's"
            )
    return None


def program_problem(cfg: Any) -> str | None:
    """Why ``cfg.program`` cannot run (a message naming the key), or None. ``cfg``: the
    JobConfig being validated."""
    p: ProgramConfig = cfg.program
    if not p.enabled:
        return None
    for i, arg in enumerate(p.command):
        if not arg or "\0" in arg:
            return f"program.command[{i}] = {arg!r}: must be a non-empty string"
    for name, value in p.env.items():
        if not _ENV_NAME.match(name):
            return f"program.env.{name}: not a valid environment variable name"
        if "\0" in value:  # the spawn of every rank would fail (execve takes C strings)
            return f"program.env.{name}: holds a NUL character, which no environment value can"
        if name in STORE_ENV:
            return (
                f"program.env.{name}: the group's store is ftharness's to place: its host agent "
                "serves it on a fresh port each incarnation and every rank's env:// process "
                "group connects to it as a client (MASTER_ADDR, MASTER_PORT, "
                "TORCHELASTIC_USE_AGENT_STORE=True, as torchrun gives them); a value of the "
                "program's would make rank 0 host a second store or miss the group's; remove it"
            )
        if name in LAUNCHER_ENV:
            return (
                f"program.env.{name}: set by ftharness for every rank (the launcher environment: "
                f"{', '.join(LAUNCHER_ENV)}); remove it"
            )
    nproc = torchrun_nproc(p.command)
    if cfg.ranks > 1 and nproc is not None and nproc != "1":
        return (
            f"program.command runs torchrun with --nproc_per_node {nproc} under ranks = "
            f"{cfg.ranks}: ftharness starts the {cfg.ranks} ranks of each group itself, with "
            "torchrun's environment (docs/own-program.md); run the script directly: command = "
            "['python', SCRIPT, ...]"
        )
    if p.kind == "torchtitan":
        for arg in p.command:
            for flag in TORCHTITAN_FLAGS:
                if arg == flag or arg.startswith(flag + "="):
                    return (
                        f"program.command: {arg!r} is added by ftharness for "
                        f"program.kind = 'torchtitan' (with this group's replica id); remove it"
                    )
    for key in ("start_timeout_s", "progress_timeout_s"):
        if getattr(p, key) <= 0:
            return f"program.{key} = {getattr(p, key)}: must be > 0 seconds"
    if p.survivor_grace_s < 0:
        return f"program.survivor_grace_s = {p.survivor_grace_s}: must be >= 0 seconds (0: off)"
    if isinstance(p.sync_every, bool) or not isinstance(p.sync_every, int) or p.sync_every < 1:
        return (
            f"program.sync_every = {p.sync_every!r}: must be a whole number >= 1 (the program's "
            "inner steps per quorum request: 1 for DDP, torchft's sync_every for LocalSGD/DiLoCo)"
        )
    if cfg.steps % p.sync_every:
        return (
            f"steps = {cfg.steps} is not a multiple of program.sync_every = {p.sync_every}: with a "
            "semi-synchronous program, steps counts inner steps and the job ends at a sync (e.g. "
            f"steps = {max(1, cfg.steps // p.sync_every) * p.sync_every})"
        )
    pg = cfg.timeouts.process_group_timeout
    if p.progress_timeout_s <= pg:
        return (
            f"program.progress_timeout_s ({p.progress_timeout_s}) must be > "
            f"timeouts.process_group_timeout ({pg}): a survivor whose collective waits out its "
            "timeout on a stopped peer makes no quorum request meanwhile, and would be taken "
            "for hung"
        )
    if p.cwd is not None and not os.path.isdir(p.cwd):
        return f"program.cwd = {p.cwd!r}: not a directory"
    why_cold = cold_reason(p)
    if p.warm and why_cold is not None:
        return (
            f"program.warm = true needs command = ['python', SCRIPT, ...] or "
            f"['python', '-m', MODULE, ...] (it runs them in a fork of ftharness's interpreter), "
            f"not {list(p.command)}: {why_cold}; leave program.warm unset to start cold then"
        )
    exe = p.command[0]
    if cfg.launcher != "external" and exe not in PYTHON_NAMES and shutil.which(exe) is None:
        return f"program.command[0] = {exe!r}: no such program on PATH"
    return None
