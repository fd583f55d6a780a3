"""A program's process: its environment (what a torchft launcher gives, and ftharness's own),
its command line and its log, computed from the job's config (``harness.job.program.groups`` spawns
it), and how an in-process fault reaches it."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

from harness.program_config import TORCHTITAN_FLAGS

#: The directory put first on a program's PYTHONPATH with ``program.hooks`` (its sitecustomize).
HOOKS_DIR = Path(__file__).resolve().parents[2] / "rank" / "program_hooks"
#: First on every program's PYTHONPATH: its sitecustomize makes torchft advertise the host address.
SITE_DIR = Path(__file__).resolve().parents[2] / "rank" / "program_site"
#: The signal that tells the hook a fault command is waiting (harness/rank/program_hooks).
HOOK_SIGNAL = signal.SIGUSR2


def launcher_env(
    cfg: Any,
    *,
    replica: int,
    rank: int,
    lighthouse: str,
    store_addr: str,
    hook_dir: str | None = None,
    survivable: bool = False,
    incarnation: int = 0,
    error_file: str = "",
) -> dict[str, str]:
    """The environment of ``rank`` of replica group ``replica``: what torchft's launchers give
    (``torchft.torchx``), what torchrun gives each of its workers (:func:`torchrun_env`; the
    group's ``incarnation`` is its restart count, ``error_file`` where ``@record`` writes a
    failure), torchft's timeouts from ``cfg.timeouts`` (its Manager reads them and
    they take precedence over the program's own, so the ordering ``harness.config`` checks
    holds for the program too; the quorum timeout outlasts a hung group's fencing:
    :func:`program_quorum_timeout`), then ``program.env``; first on ``PYTHONPATH``
    :data:`SITE_DIR`, then with ``program.hooks`` the fault hook (commands in ``hook_dir``).
    ``survivable``: the job's controller can be taken over (``harness.job.program.takeover``):
    a quorum request is retried while no controller serves the tap
    (:func:`program_quorum_retries`)."""
    host, port = store_addr.rsplit(":", 1)
    t = cfg.timeouts
    env = {
        "REPLICA_GROUP_ID": str(replica),
        "NUM_REPLICA_GROUPS": str(cfg.replicas),
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.ranks),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(cfg.ranks),
        **torchrun_env(cfg, rank=rank, incarnation=incarnation, error_file=error_file),
        # torchft reads whole seconds
        "TORCHFT_TIMEOUT_SEC": str(math.ceil(t.manager_timeout)),
        "TORCHFT_QUORUM_TIMEOUT_SEC": str(math.ceil(program_quorum_timeout(cfg))),
        "TORCHFT_CONNECT_TIMEOUT_SEC": str(math.ceil(t.connect_timeout)),
        "PYTHONUNBUFFERED": "1",  # a log's tail is current when the rank dies
    }
    if survivable:
        env["TORCHFT_QUORUM_RETRIES"] = str(program_quorum_retries(cfg))
    env = {**env, **cfg.program.env}
    site = [str(SITE_DIR), *([str(HOOKS_DIR)] if cfg.program.hooks else [])]
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*site, path) if p)
    env["FTHARNESS_SITE"] = os.pathsep.join(site)
    env.update({"FTHARNESS_HOOK_DIR": hook_dir or ""} if cfg.program.hooks else {})
    return env


def torchrun_env(cfg: Any, *, rank: int, incarnation: int, error_file: str) -> dict[str, str]:
    """What torch 2.13's torchrun (``LocalElasticAgent._start_workers``) gives a worker beyond
    ``RANK``/``WORLD_SIZE``/``LOCAL_*``/``MASTER_*``, for a replica group of ``cfg.ranks`` ranks
    on one host, as one torchrun per group would: one node (``GROUP_RANK`` 0 of
    ``GROUP_WORLD_SIZE`` 1), the role ``default``, and the group's store hosted by the agent
    (``TORCHELASTIC_USE_AGENT_STORE``), so that every rank's ``env://`` process group connects to
    it as a client instead of rank 0 trying to host it on ``MASTER_PORT`` (``EADDRINUSE``).
    ``TORCHELASTIC_RESTART_COUNT`` is the group's incarnation (torchrun's counts its restarts of
    the group too); ``TORCHELASTIC_MAX_RESTARTS`` the job's ``recovery.max_restarts``;
    ``TORCHELASTIC_RUN_ID`` the job's name. ``OMP_NUM_THREADS=1`` with more than one rank where
    the environment does not set it, as ``torch.distributed.run`` does. Where it differs from
    torchrun on purpose: docs/own-program.md#what-a-rank-gets."""
    env = {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(cfg.ranks),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": cfg.name,
        "TORCHELASTIC_RESTART_COUNT": str(incarnation),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.recovery.max_restarts),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if cfg.ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


#: Slack between fencing a hung program group and the survivors' quorum deadline: the progress
#: check's poll, the kill, and the quorum service noticing (torchft's Lighthouse: its heartbeat
#: timeout, added separately).
FENCE_SLACK_S = 5.0


def program_quorum_timeout(cfg: Any) -> float:
    """The quorum timeout a program's ranks get: ``timeouts.quorum_timeout``, raised where
    needed to outlast the fencing of a hung group. A group hung with its GIL held still
    heartbeats (torchft's Manager beats from a Rust thread), so the survivors' quorum waits for
    it until ftharness fences it, ``program.progress_timeout_s`` after its last request; an
    unmodified program exits when its quorum request times out first (seen in CI with both at
    10 s). ``program.env`` may still set ``TORCHFT_QUORUM_TIMEOUT_SEC`` itself."""
    t = cfg.timeouts
    fenced = cfg.program.progress_timeout_s + t.lighthouse_heartbeat_timeout + FENCE_SLACK_S
    return max(t.quorum_timeout, fenced)


#: How often a program's Manager asks again for a quorum the quorum tap could not answer (no
#: controller serves it: one died, the next is taking over), as the built-in trainer does
#: (``harness.rank.trainer.QUORUM_RETRY_S``, measured by ``bench takeover``).
QUORUM_RETRY_S = 0.25


def program_quorum_retries(cfg: Any) -> int:
    """``TORCHFT_QUORUM_RETRIES`` for a program whose controller can be taken over. torchft's
    ManagerServer (``_quorum_with_retries``) retries a quorum request that *failed* (the tap's
    connection refused or reset, its call refused while the new controller adopts the group)
    after ``quorum_timeout / (retries + 1)`` (at least 0.1 s), each attempt with the whole
    quorum timeout, and gives up after ``retries`` of them: so a request is asked again every
    ~:data:`QUORUM_RETRY_S` for about the quorum timeout, which a takeover (about a second)
    fits in. A request that only waits (a quorum forming) is not repeated."""
    return max(1, math.ceil(program_quorum_timeout(cfg) / QUORUM_RETRY_S) - 1)


def program_argv(cfg: Any, *, replica: int) -> tuple[str, ...]:
    """``program.command``, plus torchtitan's flags for ``program.kind = "torchtitan"``."""
    argv = tuple(cfg.program.command)
    if cfg.program.kind == "torchtitan":
        enable, replica_id, group_size = TORCHTITAN_FLAGS
        argv += (enable, f"{replica_id}={replica}", f"{group_size}={cfg.replicas}")
    return argv


def log_name(replica: int, rank: int) -> str:
    return f"replica{replica}-rank{rank}.log"


#: What each incarnation's first line in a rank's log starts with (:func:`start_log`).
LOG_HEADER = "=== ftharness:"


def start_log(logs: Path, replica: int, rank: int, incarnation: int) -> Path:
    """A rank's log, with a line that says which incarnation starts (0600 like every worker
    log: it holds the program's output and tracebacks); a past incarnation's error file gone."""
    log = logs / log_name(replica, rank)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(fd, "a", encoding="utf-8") as f:
        f.write(f"{LOG_HEADER} replica {replica} rank {rank} incarnation {incarnation}\n")
    error_file(logs, replica, rank).unlink(missing_ok=True)
    return log


def error_file(logs: Path, replica: int, rank: int) -> Path:
    """``TORCHELASTIC_ERROR_FILE`` of a rank: where torch's ``@record`` (torchrun's convention)
    writes the exception that ended it, next to its log."""
    return logs / f"replica{replica}-rank{rank}.error.json"


def run_in_program(pid: int, hooks: Path | None, func: str, *args: Any) -> None:
    """An in-process fault (``func``'s wire name) for the program rank ``pid``. With
    ``program.hooks`` (``hooks``: the run's hook directory) it runs inside the rank
    (harness/rank/program_hooks: a command file, then :data:`HOOK_SIGNAL`); without, a segfault
    is a SIGSEGV sent from outside (the supervisor sees the same death) and the others are
    refused."""
    if hooks is not None:
        tmp = hooks / f".{pid}.json"
        tmp.write_text(json.dumps({"func": func, "args": list(args)}))
        tmp.replace(hooks / f"{pid}.json")
        os.kill(pid, HOOK_SIGNAL)
        return
    if func == "faults.inworker:segfault":
        os.kill(pid, signal.SIGSEGV)
        return
    raise ValueError(
        f"{func} runs inside the training process: a program of your own takes it only with "
        "program.hooks = true (kill, segfault, hang, host and network faults need nothing)"
    )
