"""Job configuration: frozen, keyword-only specs, validated before anything launches.

A job config comes from a TOML file or a ``module:function`` returning a :class:`JobConfig`, plus
``a.b=value`` overrides (values parsed as TOML, bare words taken as strings). Every problem is a
:class:`ConfigError` whose message names the key and says what is allowed: unknown keys (with the
closest valid name), wrong types, impossible sizes and timeouts in the wrong order.

The timeout ordering, and why each rule exists (all values in seconds):

* ``heartbeat_interval < heartbeat_timeout``: a live worker must get several beats in before its
  supervisor declares it hung.
* ``heartbeat_timeout < process_group_timeout``: a hung rank is killed by its supervisor before the
  survivors' collectives time out, so survivors see a clean peer death, not a stalled allreduce.
* ``lighthouse_heartbeat_timeout < quorum_timeout`` and ``lighthouse_join_timeout <
  quorum_timeout``: the Lighthouse drops a dead group (or stops waiting for joiners) before a
  survivor's quorum request gives up.
* ``lighthouse_join_timeout`` should also exceed one step's time: a live group that is mid-step
  when a quorum forms is waited for instead of left out. (Left out at the same step, it would
  commit that step in a quorum of its own and the groups' weights would fork.) This is not
  checked here because step time is only known at run time.
* ``process_group_timeout <= quorum_timeout``: a collective on a broken quorum fails (and the step
  aborts) before the next quorum request would time out.
* ``no_progress > 2 x quorum_timeout`` and ``> 2 x manager_timeout``: a job that aborts steps
  for ``no_progress`` without a commit is ended as stalled, and a healthy one may abort for a
  quorum request that times out and then a step whose collective or heal times out.
* ``host_timeout < controller_silence``: the controller declares a silent host lost (and
  re-places its groups) before that host's agent fences itself; the other order would make a
  short controller stall kill every worker of the job. Between the two, a cut-off host's stale
  incarnation may still run, but cannot commit: the tree quorum admits only the newest one.

Numbers are also checked against what could ever run (one walk over every field, see
:func:`_check_values`): every float is finite (a NaN timeout never fires, an infinite duration
never ends), no string holds a NUL, every duration is at most :data:`MAX_SECONDS`, and sizes are
bounded by what one job could launch and hold in memory (:data:`MAX_WORKERS`, :data:`MAX_HOSTS`,
:data:`MAX_LOGITS_BYTES`, :data:`MAX_MODEL_BYTES`, :data:`MAX_EVAL_BATCHES`,
:data:`MAX_STRAGGLER_WINDOW`). ``name`` names the run directory, so it must
be a plain file name (:data:`NAME_PATTERN`). Files and override values are read through
``harness.tomlfile``: whatever a file or an override holds, the answer is a ConfigError.

Why this module is longer than 500 lines: every key of a job config is declared, documented, bounded
and checked here, so its type, default and limits are read in one place (the configuration reference
is generated from it); reading files and ``--set`` values is ``harness.tomlfile``, the ``[program]``
section ``harness.program_config``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import ipaddress
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.program_config import ProgramConfig, program_problem
from harness.tomlfile import parse_toml, read_toml


class ConfigError(ValueError):
    """A job config is invalid; the message names the key and what is allowed."""


#: A name becomes a directory (``runs/NAME``) and a label in every record: letters, digits,
#: ``_``, ``-`` and ``.``, starting with a letter or digit (so never ``..``), at most 64.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Longest duration accepted anywhere (timeouts, restart windows and delays): a week. Longer is
#: a typo or a "never" in disguise, and past ~292 years Python's waits raise OverflowError.
MAX_SECONDS = 7 * 24 * 3600.0
#: Worker processes of one job (replicas x ranks, plus warm spares). Every worker is a local
#: process holding the model, its optimizer state and a torch import (~100 MB and more each):
#: past about a thousand, one machine runs out of memory or pids before training starts.
MAX_WORKERS = 1024
#: Host agents: each is a local process that imports torch once (~300 MB) before forking.
MAX_HOSTS = 64
#: Every rank's forward pass holds batch_size x seq_len x vocab_size float32 logits (and their
#: gradient as large): past 16 GiB for those alone, a step cannot fit a sane machine.
MAX_LOGITS_BYTES = 16 << 30
#: Every worker holds the model, its gradients and AdamW's two moments in float32 (16 bytes per
#: parameter): past 32 GiB for those (2 billion parameters), one worker cannot fit a sane machine.
#: The built-in models are ~12 x dim^2 parameters per layer plus the embeddings and the head.
MAX_MODEL_BYTES = 32 << 30
#: Held-out batches per evaluation: each is a forward pass on every rank at every evaluation, and
#: the held-out split is read whole into memory; 4096 batches already make an evaluation of
#: thousands of steps' compute.
MAX_EVAL_BATCHES = 4096
#: Committed steps per group in a straggler estimate: the controller keeps that many step times
#: per group, and a slow group is flagged only once the window is full.
MAX_STRAGGLER_WINDOW = 100_000
#: torch.Generator.manual_seed takes at most a 64-bit value; the data stream derives from it.
MAX_SEED = 2**63 - 1
#: The default sparse quorum period (``recovery.quorum_every_steps = 0``). A replacement does
#: not wait for it (the running groups are asked at once); it is the safety net should that ask
#: be lost (sent to a worker as it restarts): the groups still meet within this many steps.
SPARSE_QUORUM_EVERY = 10
#: The llama3 debug model's width (torchtitan's ``debugmodel``): its smallest parameter dimension.
LLAMA3_DEBUG_DIM = 256


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to train. ``tiny`` is a plain-torch causal LM; ``llama3_debug`` is torchtitan's
    llama3 debug model (dim 256, 6 layers) on CPU. ``dim``/``layers``/``heads`` size ``tiny``."""

    kind: Literal["tiny", "llama3_debug"] = "tiny"
    dim: int = 64
    layers: int = 2
    heads: int = 4


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model trains on: ``kind = "synthetic"`` (the default) a generated token stream
    whose ``vocab_size`` must match the model's (2048 for llama3_debug); ``kind = "tokens"`` a
    token file prepared from real text (``ftharness data prepare``; ``harness.rank.tokenfile``),
    whose tokenizer then gives ``vocab_size`` to the model, whatever this key says.

    ``policy``: what happens to the sequences of a replica group that is down (see
    ``harness.rank.data``). ``skip`` (each group reads its fixed shard; a down group's shard is not
    trained, a healed group jumps to its peers' position): those sequences are lost. ``replay``
    (the groups of each committed step take the next unread batches of one shared stream, in
    quorum order): every sequence is trained exactly once, whoever is up."""

    seed: int = 0
    seq_len: int = 32
    batch_size: int = 8
    vocab_size: int = 256
    policy: Literal["skip", "replay"] = "skip"
    # "synthetic": the generated stream; "tokens": a token file of real text (vocab_size is then
    # its tokenizer's).
    kind: Literal["synthetic", "tokens"] = "synthetic"
    # kind = "tokens": a directory `ftharness data prepare` wrote; None: the default corpus (this
    # interpreter's standard library), prepared on first use into ~/.cache/ftharness/corpus.
    corpus: str | None = None
    # Held-out loss (kind = "tokens"): every eval_every committed steps, and at step 0, one
    # group evaluates eval_batches fixed batches of the held-out split, the same in every run
    # (journaled as `eval`; the report compares each policy with the control on it). 0: never.
    eval_every: int = 0
    eval_batches: int = 8  # batches of batch_size x seq_len held-out tokens per evaluation


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW hyperparameters."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class TimeoutConfig:
    """Every timeout of the job, in seconds; their ordering is checked (see the module doc)."""

    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 2.0
    lighthouse_heartbeat_timeout: float = 1.0
    lighthouse_join_timeout: float = 5.0
    quorum_timeout: float = 10.0
    process_group_timeout: float = 5.0
    manager_timeout: float = 10.0
    connect_timeout: float = 10.0
    host_timeout: float = 3.0  # a host agent silent this long is lost (its groups re-placed)
    controller_silence: float = 10.0  # an agent that hears nothing this long fences itself
    host_join: float = 300.0  # launcher = "external": how long to wait for every agent to dial in
    # The preflight (`preflight = true`): how long each probe of the connectivity matrix may take
    # to connect and get the other agent's answer before that path counts as timed out. The
    # probes run in parallel, so the whole matrix takes about this long at most.
    preflight: float = 1.5
    # A job whose groups keep aborting steps and commit none for this long ends, failed, with a
    # diagnosis naming the endpoint its errors name (harness/job/stall.py). Longer than any
    # legitimate run of aborts: a quorum request timing out, then a step whose collective or heal
    # times out (more than twice quorum_timeout and manager_timeout, checked); a first quorum
    # waits at most half the quorum timeout, checkpoints are written off the training thread.
    no_progress: float = 120.0


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Durable checkpoints every ``every_steps`` committed steps (0 = never) into ``dir`` (None =
    the run directory), keeping the newest ``keep``. ``format``: ``"torch"``, one ``torch.save``
    file per rank (``harness/rank/checkpoint.py``); ``"dcp"``, ``torch.distributed.checkpoint``
    folders in torchtitan's layout, every rank writing its own shards in the background and
    loadable onto another shard count (``harness/rank/dcp_checkpoint.py``); ``"auto"`` (the
    default): ``"dcp"`` for sharded groups (``parallel.group = "fsdp"``), else ``"torch"``."""

    every_steps: int = 50
    dir: str | None = None
    keep: int = 2
    format: Literal["auto", "torch", "dcp"] = "auto"

    def resolved_format(self, group: str) -> Literal["torch", "dcp"]:
        """The format a job whose groups are ``group`` (``parallel.group``) writes."""
        if self.format != "auto":
            return self.format
        return "dcp" if group == "fsdp" else "torch"


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Stragglers (``harness.job.stragglers``): a group whose time to reach the cross-group
    collective (lower quartile over its last ``window`` committed steps) is more than ``factor``
    times the median of the other groups' is flagged; it is back in bounds once that ratio
    falls below ``factor * hysteresis``. ``observe`` journals and reports only; ``eject`` fails
    the flagged group, which leaves the quorum, restarts in place (a warm spare when there is
    one) and is re-admitted with its next quorum, judged again on its own step times."""

    policy: Literal["observe", "eject"] = "observe"  # what a flagged group gets
    factor: float = 3.0  # flagged above this ratio to the other groups' median (> 1)
    window: int = 20  # committed steps per group in its estimate (>= 3)
    hysteresis: float = 0.75  # back in bounds below factor * hysteresis (in (0, 1])


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """How failures are recovered: ``in_place`` restarts only the failed replica group, which heals
    from a peer; ``full_restart`` restarts the whole job from the last checkpoint."""

    policy: Literal["in_place", "full_restart"] = "in_place"
    max_restarts: int = 10
    within_s: float = 600.0
    restart_delay_s: float = 0.0
    # A failure that comes back the same way (its exception and last frame, or its signal) this
    # many times in a row, no injected fault explaining it, each within a minute of the last, is
    # deterministic, not a fault to ride through: the job ends, naming it (harness/job/
    # crash_loop.py, for the built-in trainer and programs alike).
    deterministic_max: int = 3
    # A lost host whose agent cannot be restarted (it fails to start or never dials in) is tried
    # at most host_max_restarts times within host_within_s (restart intensity, as max_restarts /
    # within_s for a group; a restart that succeeds starts the count again); then the host is
    # given up, its groups go to the other hosts, and with no host left the job fails
    # (harness/job/hosts.py).
    host_max_restarts: int = 3
    host_within_s: float = 600.0
    # The controller can die (its process, its host): agents and workers keep training for
    # controller_grace_s without it while a keeper starts a new one that takes over (docs/
    # controller.md); past it they stop, as a cut-off host does. 60 s: a local keeper replaces a
    # controller in about a second and a standby on another node in tens of seconds, while a
    # dead run's orphans should not hold the machines much longer (Monarch's host agents use a
    # 60 s keepalive for the same reason). 0: agents and workers die with their controller.
    controller_grace_s: float = 60.0
    # The keeper replaces a dead controller at most controller_max_restarts times within
    # controller_within_s, then ends the run (restart intensity, as for groups and hosts).
    controller_max_restarts: int = 10
    controller_within_s: float = 600.0
    # The defaults are the fastest correct configuration measured (`ftharness bench recovery`):
    # the supervision tree's own quorum, which fences a dead group at once instead of waiting
    # out a heartbeat timeout, and one warm spare process per host, which a replacement adopts
    # instead of forking (README, "The defaults"). torchft's Lighthouse stays selectable
    # (quorum = "torchft"); spares_per_host = 0 forks each replacement when it is needed.
    quorum: Literal["torchft", "tree"] = "tree"
    spares_per_host: int = 1
    # The built-in trainer asks for a quorum every step (1: torchft's way), or only every N steps
    # and whenever membership may change: after a step that did not commit, and at once when
    # the tree quorum sees a new member waiting (harness/rank/trainer.py, "Sparse quorum"). 0 (the
    # default): SPARSE_QUORUM_EVERY with the tree quorum and the built-in trainer, else 1.
    quorum_every_steps: int = 0
    # Weight checksums compared across groups as commit records arrive (harness.job.divergence):
    # "heal" fails a group whose checksum (or non-finite loss) is in the minority, so it heals
    # from a majority member; "observe" only journals it.
    divergence: Literal["heal", "observe"] = "heal"
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """``launcher = "slurm"`` (runtime/launchers/slurm.py): the last ``spare_nodes`` nodes of the
    allocation hold a ready agent and no group; ``replace`` says where a lost node's groups go:
    ``"spare"`` a spare node if one is ready, else the other nodes; ``"none"`` the other nodes
    (no spares); ``"new_job"`` as ``"spare"``, and for every node SLURM takes away (down,
    drained, dropped from the job) a new single-node job is submitted whose node joins as a
    spare (runtime/launchers/slurm.py, ``SlurmLauncher.request_node``)."""

    spare_nodes: int = 0
    replace: Literal["spare", "new_job", "none"] = "spare"
    poll_s: float = 2.0  # how often SLURM's view of the nodes (sinfo, squeue) is read
    # Where the controller runs in a batch job (the allocation's first node): "trains" its node
    # also runs an agent and a group; "reserved" it runs only the controller, so losing that
    # node costs no group, and a standby on another node takes the run over without a restart
    # (docs/controller.md, "SLURM").
    controller_node: Literal["trains", "reserved"] = "trains"


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Which address each host advertises to the others (runtime/netaddr.py): the address its
    connection to the controller leaves from by default, never the machine's hostname. Set one
    of the two, as NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME users expect; on a host where it
    matches nothing the job stops with an error naming the host and its addresses. Workers and
    programs get GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to the interface holding it."""

    # An interface name, e.g. "ib0" or "eth1": each host advertises its address on it.
    interface: str = ""
    # A network, e.g. "10.0.0.0/8": each host advertises its address in it.
    cidr: str = ""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How each replica group holds the model across its ``ranks``. ``group = "replicate"`` (the
    default): every rank holds all of it and the ranks average their gradients (data parallel
    within the group). ``"fsdp"``: FSDP2 shards every parameter and the optimizer state over
    the group's ranks, each transformer block wrapped on its own, and torchft averages each
    gradient shard with the same shard of the other groups (HSDP; harness/rank/group_layout.py).
    A replacement group's rank r heals from rank r of a healthy group. Built-in trainer only."""

    group: Literal["replicate", "fsdp"] = "replicate"


@dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    """Live exports besides the JSONL journal (None = off)."""

    prometheus_port: int | None = None
    otlp_endpoint: str | None = None


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole training job: ``replicas`` replica groups of ``ranks`` processes each, spread over
    ``hosts`` local host agents, training for ``steps`` committed steps."""

    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    replicas: int = 3
    ranks: int = 1
    hosts: int = 1
    steps: int = 100
    min_replica_size: int = 1
    bind_host: str = "127.0.0.1"
    # Where hosts come from: "local" child processes of the controller; "netns" test hosts, each
    # in its own network namespace with its own address (root only; runtime/launchers/netns.py); or
    # "external": agents started on other machines with `ftharness agent`, which dial in.
    launcher: Literal["local", "netns", "external", "slurm"] = "local"
    # Before any group trains, every host agent checks that it reaches every other agent's
    # advertised address, and the controller's (harness/job/preflight.py); a path that is
    # refused, times out (timeouts.preflight), has no route or is another machine's loopback
    # stops the job with a table of which host cannot reach which address, and why. Skipped
    # with launcher = "local" (every host is this machine); false: never.
    preflight: bool = True
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    transport: Literal["torchft_http", "torchft_pg", "dataplane"] = "torchft_http"
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    # A program of the user's own instead of the built-in trainer (harness/program_config.py).
    program: ProgramConfig = field(default_factory=ProgramConfig)

    def __post_init__(self) -> None:
        validate(self)

    def quorum_every(self) -> int:
        """The built-in trainer's quorum period in steps (``recovery.quorum_every_steps``, with
        0 resolved: sparse only where something tells the groups that a replacement waits)."""
        every = self.recovery.quorum_every_steps
        if every:
            return every
        tree_trainer = self.recovery.quorum == "tree" and not self.program.enabled
        return SPARSE_QUORUM_EVERY if tree_trainer else 1


# ---------------------------------------------------------------------------------------------
# Validation: pure checks, each error names the key and what is allowed.


def _positive(key: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key} = {value!r}: must be >= {minimum}")


def _smaller(
    small_key: str, small: float, big_key: str, big: float, why: str, *, equal_ok: bool = False
) -> None:
    ok = small <= big if equal_ok else small < big
    if not ok:
        op = "<=" if equal_ok else "<"
        raise ConfigError(
            f"timeouts.{small_key} ({small}) must be {op} timeouts.{big_key} ({big}): {why}"
        )


def _is_seconds(key: str) -> bool:
    return key.startswith("timeouts.") or key.endswith("_s")


def _check_values(spec: Any, prefix: str = "") -> None:
    """One walk over every field of ``spec`` (recursively): floats (and floats in tuples) must be
    finite, durations (``timeouts.*``, ``*_s``) at most :data:`MAX_SECONDS`, and no string (in a
    field, a tuple or a table, keys too) may hold a NUL: the OS cuts a path, an argument or an
    interface name there (or refuses it), so a worker would run with something other than what
    the config says, or fail where nobody reads it."""
    for f in dataclasses.fields(spec):
        key, value = prefix + f.name, getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            _check_values(value, key + ".")
            continue
        items: list[tuple[str, Any]]
        if isinstance(value, dict):
            items = [(f".{k}", v) for k, v in value.items()]
            items += [(f" (a key {k!r})", k) for k in value]
        elif isinstance(value, tuple):
            items = [(f"[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [("", value)]
        for at, v in items:
            where = key + at
            if isinstance(v, str) and "\0" in v:
                raise ConfigError(f"{where} = {v!r}: holds a NUL character")
            if not isinstance(v, float):
                continue
            if not math.isfinite(v):
                raise ConfigError(f"{where} = {v!r}: must be a finite number")
            if _is_seconds(key) and v > MAX_SECONDS:
                raise ConfigError(
                    f"{where} = {v!r}: must be <= {MAX_SECONDS:g} seconds (a week); a longer "
                    "duration is a typo or a 'never'"
                )


def _check_sizes(cfg: JobConfig) -> None:
    """Upper bounds: what one job could launch and hold in memory (see the constants)."""
    if not NAME_PATTERN.match(cfg.name):
        raise ConfigError(
            f"name = {cfg.name!r}: must be 1-64 letters, digits, '_', '-' or '.', starting with "
            "a letter or digit (it names the run directory, runs/NAME)"
        )
    workers = cfg.replicas * cfg.ranks + cfg.hosts * cfg.recovery.spares_per_host
    if workers > MAX_WORKERS:
        raise ConfigError(
            f"replicas x ranks + hosts x recovery.spares_per_host = {cfg.replicas} x {cfg.ranks} "
            f"+ {cfg.hosts} x {cfg.recovery.spares_per_host} = {workers} worker processes: must "
            f"be <= {MAX_WORKERS} (each is a local process holding the model and a torch import)"
        )
    if cfg.hosts > MAX_HOSTS:
        raise ConfigError(
            f"hosts = {cfg.hosts}: must be <= {MAX_HOSTS} (each host agent is a local process "
            "that imports torch)"
        )
    d = cfg.data
    logits = d.batch_size * d.seq_len * d.vocab_size * 4
    if logits > MAX_LOGITS_BYTES:
        raise ConfigError(
            f"data.batch_size x data.seq_len x data.vocab_size = {d.batch_size} x {d.seq_len} x "
            f"{d.vocab_size} float32 logits = {logits / 2**30:.3g} GiB per rank and step: must "
            f"be <= {MAX_LOGITS_BYTES >> 30} GiB"
        )
    if not 0 <= d.seed <= MAX_SEED:
        raise ConfigError(f"data.seed = {d.seed}: must be 0..{MAX_SEED} (a 64-bit seed)")
    m = cfg.model  # TINY_MAX_SEQ (1024) position embeddings, the token embeddings and the head
    params = 12 * m.dim**2 * m.layers + (1024 + 2 * d.vocab_size) * m.dim
    if params * 16 > MAX_MODEL_BYTES:
        raise ConfigError(
            f"model.dim = {m.dim}, model.layers = {m.layers} (data.vocab_size = {d.vocab_size}): "
            f"about {params:.3g} parameters, {params * 16 / 2**30:.3g} GiB with gradients and "
            f"AdamW state per worker: must be <= {MAX_MODEL_BYTES >> 30} GiB"
        )


def _smallest_dim0(cfg: JobConfig) -> int:
    """The smallest first dimension of any parameter of the job's model: FSDP2 splits every
    parameter along it, so more shards than this leave a rank holding nothing of one."""
    width = cfg.model.dim if cfg.model.kind == "tiny" else LLAMA3_DEBUG_DIM
    return min(width, cfg.data.vocab_size)


def _check_parallel(cfg: JobConfig) -> None:
    if cfg.parallel.group != "fsdp":
        return
    if cfg.program.enabled:
        raise ConfigError(
            'parallel.group = "fsdp" with a [program]: it shards the built-in trainer\'s model; '
            "a program shards its own (fully_shard over its group's ranks) and ftharness gives "
            "every rank torchrun's environment for it; remove [parallel]"
        )
    if cfg.ranks < 2:
        raise ConfigError(
            f'parallel.group = "fsdp" with ranks = {cfg.ranks}: sharding needs at least 2 ranks '
            'per replica group to shard over; set ranks >= 2 or parallel.group = "replicate"'
        )
    most = _smallest_dim0(cfg)
    if cfg.ranks > most:
        raise ConfigError(
            f'parallel.group = "fsdp" with ranks = {cfg.ranks}: model.kind = '
            f"{cfg.model.kind!r} has a parameter of first dimension {most} (FSDP2 shards along "
            f"it), so some rank would hold none of it; use ranks <= {most}"
        )


def _check_optim(o: OptimConfig) -> None:
    """AdamW's own rules (torch raises in every worker otherwise, a crash loop)."""
    for key in ("lr", "eps", "weight_decay"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optim.{key} = {getattr(o, key)!r}: must be >= 0")
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas[{i}] = {beta!r}: must be in [0, 1)")


def _check_network(n: NetworkConfig) -> None:
    if n.interface and n.cidr:
        raise ConfigError(
            f"network.interface = {n.interface!r} and network.cidr = {n.cidr!r}: set one of them"
        )
    bad_name = any(c.isspace() or c in "/:" for c in n.interface) or len(n.interface) > 15
    if n.interface and bad_name:
        raise ConfigError(
            f"network.interface = {n.interface!r}: not an interface name (at most 15 characters, "
            'no spaces, "/" or ":"; a network goes in network.cidr)'
        )
    if n.cidr:
        try:
            ipaddress.ip_network(n.cidr, strict=False)
        except ValueError as e:
            raise ConfigError(
                f"network.cidr = {n.cidr!r}: not a network ({e}); e.g. 10.0.0.0/8"
            ) from None


def _check_controller(cfg: JobConfig) -> None:
    """The controller's grace window and its keeper's restart intensity."""
    r, silence = cfg.recovery, cfg.timeouts.controller_silence
    _positive("recovery.controller_max_restarts", r.controller_max_restarts, 0)
    if not 0 <= r.controller_grace_s <= MAX_SECONDS:
        raise ConfigError(
            f"recovery.controller_grace_s = {r.controller_grace_s}: must be between 0 (agents "
            f"die with their controller) and {MAX_SECONDS:g} s"
        )
    if 0 < r.controller_grace_s <= silence:
        raise ConfigError(
            f"recovery.controller_grace_s = {r.controller_grace_s:g} must be greater than "
            f"timeouts.controller_silence = {silence:g}: an agent notices a silent controller "
            "only after that long, and then waits out the grace for a new one"
        )
    if not 0 < r.controller_within_s <= MAX_SECONDS:
        raise ConfigError(
            f"recovery.controller_within_s = {r.controller_within_s}: must be > 0 and <= "
            f"{MAX_SECONDS:g} s"
        )


def _check_slurm(cfg: JobConfig) -> None:
    s = cfg.slurm
    _positive("slurm.spare_nodes", s.spare_nodes, 0)
    if s.poll_s <= 0:
        raise ConfigError(f"slurm.poll_s = {s.poll_s}: must be > 0 seconds")
    if s.replace == "none" and s.spare_nodes:
        raise ConfigError(
            f'slurm.spare_nodes = {s.spare_nodes} with slurm.replace = "none": spare nodes would '
            'never be used; set replace = "spare" or spare_nodes = 0'
        )
    if cfg.launcher != "slurm" and s != SlurmConfig():
        raise ConfigError(
            f"a [slurm] section with launcher = {cfg.launcher!r}: it applies only to "
            'launcher = "slurm"'
        )


def _check_stragglers(s: StragglerConfig) -> None:
    if not s.factor > 1.0:
        raise ConfigError(
            f"recovery.stragglers.factor = {s.factor} must be > 1: a factor of 1 "
            "or less flags a group as slow for being as fast as the others"
        )
    _positive("recovery.stragglers.window", s.window, 3)
    if s.window > MAX_STRAGGLER_WINDOW:
        raise ConfigError(
            f"recovery.stragglers.window = {s.window}: must be <= {MAX_STRAGGLER_WINDOW} "
            "committed steps (a slow group is flagged only once its window is full)"
        )
    if not 0.0 < s.hysteresis <= 1.0:
        raise ConfigError(
            f"recovery.stragglers.hysteresis = {s.hysteresis} must be in (0, 1]: "
            "a group is back in bounds below factor * hysteresis"
        )


def validate(cfg: JobConfig) -> None:
    """Raise :class:`ConfigError` for the first rule ``cfg`` breaks (numbers, sizes, then
    timeouts)."""
    _check_values(cfg)
    _positive("replicas", cfg.replicas)
    _positive("ranks", cfg.ranks)
    _positive("hosts", cfg.hosts)
    _positive("steps", cfg.steps, 0)
    _positive("min_replica_size", cfg.min_replica_size)
    if cfg.min_replica_size > cfg.replicas:
        raise ConfigError(
            f"min_replica_size = {cfg.min_replica_size} must be <= replicas = {cfg.replicas}: "
            "a quorum can never have more replica groups than the job runs"
        )
    for key in ("seq_len", "batch_size", "vocab_size", "eval_batches"):
        _positive(f"data.{key}", getattr(cfg.data, key))
    if cfg.data.eval_batches > MAX_EVAL_BATCHES:
        raise ConfigError(
            f"data.eval_batches = {cfg.data.eval_batches}: must be <= {MAX_EVAL_BATCHES} (each "
            "is a forward pass on every rank at every evaluation)"
        )
    if cfg.data.corpus is not None and not cfg.data.corpus.strip():
        raise ConfigError(
            f"data.corpus = {cfg.data.corpus!r}: must be the folder `ftharness data prepare` "
            "wrote; leave the key out for the default corpus"
        )
    if not cfg.bind_host.strip():
        raise ConfigError(
            f"bind_host = {cfg.bind_host!r}: must be an address or host name to listen on (an "
            "empty one listens on every interface); the default is 127.0.0.1"
        )
    _positive("data.eval_every", cfg.data.eval_every, 0)
    if cfg.data.kind != "tokens" and (cfg.data.eval_every or cfg.data.corpus is not None):
        raise ConfigError('data.eval_every and data.corpus need data.kind = "tokens" (real text)')
    m = cfg.model
    for key in ("dim", "layers", "heads"):
        _positive(f"model.{key}", getattr(m, key))
    if m.dim % m.heads:
        raise ConfigError(f"model.dim = {m.dim} must be divisible by model.heads = {m.heads}")
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps, 0)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("recovery.max_restarts", cfg.recovery.max_restarts, 0)
    _positive("recovery.host_max_restarts", cfg.recovery.host_max_restarts, 0)
    _positive("recovery.deterministic_max", cfg.recovery.deterministic_max, 2)
    _positive("recovery.spares_per_host", cfg.recovery.spares_per_host, 0)
    _check_stragglers(cfg.recovery.stragglers)
    _positive("recovery.quorum_every_steps", cfg.recovery.quorum_every_steps, 0)
    if cfg.recovery.quorum_every_steps > 1 and cfg.recovery.quorum != "tree":
        raise ConfigError(
            f"recovery.quorum_every_steps = {cfg.recovery.quorum_every_steps} needs "
            f'recovery.quorum = "tree" (got {cfg.recovery.quorum!r}): only the tree quorum tells '
            "the survivors that a replacement waits; torchft's Lighthouse would keep it out for "
            "up to that many steps, or the join timeout"
        )
    if cfg.recovery.quorum_every_steps > 1 and cfg.program.enabled:
        raise ConfigError(
            f"recovery.quorum_every_steps = {cfg.recovery.quorum_every_steps} with a [program]: "
            "a program's own loop decides when it calls start_quorum; it applies only to the "
            "built-in trainer"
        )
    if cfg.recovery.host_within_s <= 0:
        raise ConfigError(f"recovery.host_within_s = {cfg.recovery.host_within_s}: must be > 0")
    _check_controller(cfg)
    if cfg.recovery.within_s <= 0 or cfg.recovery.restart_delay_s < 0:
        raise ConfigError(
            f"recovery.within_s = {cfg.recovery.within_s} must be > 0 and "
            f"recovery.restart_delay_s = {cfg.recovery.restart_delay_s} must be >= 0 (seconds)"
        )
    _check_slurm(cfg)
    _check_network(cfg.network)
    port = cfg.telemetry.prometheus_port
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"telemetry.prometheus_port = {port}: must be 0..65535 (0 = any free)")
    _check_sizes(cfg)
    _check_parallel(cfg)
    _check_optim(cfg.optim)
    problem = program_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)

    t = cfg.timeouts
    for f in dataclasses.fields(t):
        if getattr(t, f.name) <= 0:
            raise ConfigError(f"timeouts.{f.name} = {getattr(t, f.name)}: must be > 0 seconds")
    _smaller(
        "heartbeat_interval",
        t.heartbeat_interval,
        "heartbeat_timeout",
        t.heartbeat_timeout,
        "a live worker must send several heartbeats before it is declared hung",
    )
    _smaller(
        "host_timeout",
        t.host_timeout,
        "controller_silence",
        t.controller_silence,
        "a silent host must be declared lost before its agent fences itself, or a short "
        "controller stall would stop every worker of the job",
    )
    _smaller(
        "heartbeat_timeout",
        t.heartbeat_timeout,
        "process_group_timeout",
        t.process_group_timeout,
        "a hung rank must be killed by its supervisor before the survivors' collectives time out",
    )
    _smaller(
        "lighthouse_heartbeat_timeout",
        t.lighthouse_heartbeat_timeout,
        "quorum_timeout",
        t.quorum_timeout,
        "the Lighthouse must drop a dead replica group before a survivor's quorum request gives up",
    )
    _smaller(
        "lighthouse_join_timeout",
        t.lighthouse_join_timeout,
        "quorum_timeout",
        t.quorum_timeout,
        "the Lighthouse must stop waiting for joiners before a quorum request gives up",
    )
    _smaller(
        "process_group_timeout",
        t.process_group_timeout,
        "quorum_timeout",
        t.quorum_timeout,
        "a collective on a broken quorum must fail (aborting the step) before the next quorum "
        "request would time out",
        equal_ok=True,
    )
    for key in ("quorum_timeout", "manager_timeout"):
        if t.no_progress <= 2 * getattr(t, key):
            raise ConfigError(
                f"timeouts.no_progress ({t.no_progress}) must be > 2 x timeouts.{key} "
                f"({getattr(t, key)}): a healthy job may abort steps for that long (a quorum "
                "request that times out, then a step whose collective or heal times out), and "
                "would be ended as stalled"
            )


# ---------------------------------------------------------------------------------------------
# Building from dicts (TOML) with typed, named errors.


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (ints to floats, lists
    to tuples) or raise ConfigError naming ``key`` and the allowed type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{key} = {value!r}: must be one of {', '.join(repr(a) for a in allowed)}"
            )
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {value!r}: must be {_type_name(tp)}")
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):  # tuple[X, ...]: any length
        item = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} = {value!r}: must be a list of {_type_name(item)}")
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: must be a table")
        return {
            _coerce(f"{key} (a key)", key_tp, k): _coerce(f"{key}.{k}", value_tp, v)
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: must be true or false")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key} = {value!r}: must be a list of {len(args)} numbers")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_coerce(f"{key}[{i}]", a, v) for i, (a, v) in pairs)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass, not an instance
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r}: must be a table of {tp.__name__} fields")
        return _from_dict(tp, value, prefix=f"{key}.")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r}: must be a number")
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise ConfigError(f"{key} = {value!r}: must be a finite number") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r}: must be an integer")
        if not -(2**63) <= value < 2**63:  # else every size check's float arithmetic overflows
            raise ConfigError(f"{key}: an integer of {len(str(abs(value)))} digits: must be 64-bit")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: must be a string")
        return value
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # a bug in the spec, not the user's


def _unknown(key: str, name: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown key {key!r}{hint}; valid keys here: {', '.join(sorted(valid))}")


def _from_dict(cls: type, data: dict[str, Any], *, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in names:
            raise _unknown(prefix + name, name, names)
        kwargs[name] = _coerce(prefix + name, hints[name], value)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build and validate a JobConfig from plain data (as TOML or :func:`config_to_dict` give)."""
    return _from_dict(JobConfig, data)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Plain, JSON-ready data for the journal; ``config_from_dict`` inverts it."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


# ---------------------------------------------------------------------------------------------
# Loading: TOML or a Python function, then overrides.


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. steps=100")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = parse_toml(f"v = {raw}", f"override {key}", ConfigError)["v"]
    except ConfigError as e:
        if not isinstance(e.__cause__, tomllib.TOMLDecodeError):
            raise  # too deep or too long: not a bare word either
        value = raw  # a bare word, e.g. recovery.policy=full_restart
    return key.split("."), value


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    cls: Any = JobConfig
    for i, part in enumerate(path):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise _unknown(".".join(path[: i + 1]), part, names)
        if i == len(path) - 1:
            node[part] = value
            return
        cls = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{'.'.join(path[: i + 1])} is a value, not a table")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):  # e.g. `model = 5` in the file, then model.dim=...
            raise ConfigError(f"{'.'.join(path[: i + 1])} = {node!r}: must be a table")


def load_config(source: str, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load a job config from a TOML path or ``module:function``, apply ``a.b=value`` overrides,
    validate. Raises ConfigError (never launches anything)."""
    if source.endswith(".toml") or Path(source).is_file():
        data = read_toml(source, "config file", ConfigError)
    elif ":" in source:
        module, func = source.split(":", 1)
        try:  # ValueError, TypeError: an empty or relative module name (":f", "..m:f")
            factory = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError, ValueError, TypeError) as e:
            raise ConfigError(f"config function {source!r} cannot be loaded: {e}") from e
        made = factory() if callable(factory) else factory  # its own errors: the user's code
        if not isinstance(made, JobConfig):
            raise ConfigError(
                f"config function {source!r} returned {type(made).__name__}, not a JobConfig"
            )
        data = config_to_dict(made)
    else:
        raise ConfigError(f"config {source!r}: expected a .toml file or module:function")
    return config_from_table(data, overrides)


def config_from_table(
    table: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> JobConfig:
    """A job config from an already-parsed table (an experiment's inline ``[job]``), with the
    same ``a.b=value`` overrides and validation as :func:`load_config`."""
    data = copy.deepcopy(dict(table))
    for text in overrides:
        path, value = _parse_override(text)
        _apply_override(data, path, value)
    return config_from_dict(data)
