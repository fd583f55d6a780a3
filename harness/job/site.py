"""Where a job runs, resolved before it starts: the config as it will run, and its launcher.

A job's config is built once and frozen: :func:`prepare_site` derives every value that depends on
the policy or on where the job runs, and :class:`harness.job.protocol.Job` only reads the
result (the journal's ``job.start`` record carries it, so a report sees what ran). What is
derived, and why:

* ``recovery.policy = "full_restart"`` (the baseline): ``min_replica_size = replicas`` (a
  classic synchronous job trains only with every group, as torchrun's rendezvous would; a lone
  group must not run ahead after a restart) and no warm spares (it starts cold on purpose).
* ``[program]``: no warm spares (spares are forked workers for the built-in trainer; a program
  starts as a process of its own, ``program.warm`` forks it instead).
* ``launcher = "netns"``: test hosts in network namespaces get a network of their own, and the
  controller (with the stores and the quorum service it serves) binds its gateway address.
* ``data.kind = "tokens"``: the corpus, prepared on first use if it is the default one, its
  absolute path and its tokenizer's vocabulary (``harness.corpus.job.resolve_data``).
* ``launcher = "slurm"``: the hosts are the allocation's nodes less ``slurm.spare_nodes``, and the
  controller binds an address the nodes reach (``harness.job.slurm``).
* ``recovery.quorum = "tree"``: each host's agent relays its trainers' (and programs') quorum
  traffic (:func:`wants_quorum_relay`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.config import JobConfig
from harness.corpus.job import resolve_data
from runtime.launchers import ExternalLauncher, Launcher, LocalLauncher
from runtime.launchers.netns import NetnsLauncher, TestNetwork
from runtime.launchers.slurm import SlurmLauncher
from runtime.spec import ControllerSpec, HeartbeatSpec


def resolve(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the values its policy and program imply (module doc); the rest unchanged."""
    recovery = cfg.recovery
    if recovery.policy == "full_restart" or cfg.program.enabled:
        recovery = dataclasses.replace(recovery, spares_per_host=0)
    min_size = cfg.replicas if recovery.policy == "full_restart" else cfg.min_replica_size
    return dataclasses.replace(cfg, recovery=recovery, min_replica_size=min_size)


@dataclass
class NodeEvents:
    """Forwards SLURM's "node gone" news to whoever listens once the job runs (the launcher
    is made before the job's host pool exists)."""

    listener: Callable[[str, str], None] | None = field(default=None)

    def __call__(self, node: str, why: str) -> None:
        if self.listener is not None:
            self.listener(node, why)


@dataclass(frozen=True)
class Site:
    """A job's resolved config and where its hosts come from. ``network``: the test network
    (``launcher = "netns"``); ``slurm``: the allocation (``launcher = "slurm"``)."""

    cfg: JobConfig
    launcher: Launcher
    network: TestNetwork | None = None
    slurm: SlurmLauncher | None = None
    node_events: NodeEvents = field(default_factory=NodeEvents)

    def host_names(self) -> list[str]:
        """Every host the job may use: ``host0 ..``, or the SLURM nodes (active, then spares;
        a replacement node from a new job joins the list)."""
        if self.slurm is not None:
            return list(self.slurm.nodes)
        return [f"host{i}" for i in range(self.cfg.hosts)]

    def close(self) -> None:
        """Take down what preparing the site set up (the test network). Idempotent."""
        if self.network is not None:
            self.network.down()


def prepare_site(
    cfg: JobConfig, run_dir: str | Path, say: Callable[[str], None] | None = None
) -> Site:
    """Resolve ``cfg`` (:func:`resolve`) and set up where it runs; ``say`` tells the user
    (None: nothing). Raises what the launcher raises (``SlurmError`` outside an allocation)."""
    say = say or (lambda _: None)
    cfg = resolve_data(resolve(cfg), say)
    if cfg.launcher == "local":
        return Site(cfg=cfg, launcher=LocalLauncher())
    if cfg.launcher == "external":
        return Site(cfg=cfg, launcher=ExternalLauncher())
    if cfg.launcher == "slurm":
        from harness.job.slurm import make_launcher

        events = NodeEvents()
        slurm, cfg = make_launcher(cfg, run_dir, events)
        say(
            f"SLURM job {slurm.alloc.job_id}: nodes {', '.join(slurm.active)}"
            + (f", spare {', '.join(sorted(slurm.spares))}" if slurm.spares else "")
            + (f"; {slurm.reserved} runs only the controller" if slurm.reserved else "")
            + f"; controller at {cfg.bind_host}"
        )
        return Site(cfg=cfg, launcher=slurm, slurm=slurm, node_events=events)
    names = [f"host{i}" for i in range(cfg.hosts)]
    network = TestNetwork(names).up()
    say(f"test hosts in network namespaces: {network.subnet}, controller at {network.gateway}")
    cfg = dataclasses.replace(cfg, bind_host=network.gateway)
    return Site(cfg=cfg, launcher=NetnsLauncher(network), network=network)


def wants_quorum_relay(cfg: JobConfig) -> bool:
    """Whether the trainers reach the quorum service through a relay on their host
    (``runtime.relay``): with the tree quorum, on every launcher. A Manager keeps the address it
    was given for life, and a relay's never changes, while the service behind it may: a new
    controller's (after a takeover, on a fresh port, or on another node under SLURM) or a
    restarted one's. So no port the job once used has to be bound again, where anyone on the
    machine could have bound it first and answered the Managers (issue #49), and only processes
    of the job's own tree reach the service (the relay's admission). torchft's Lighthouse
    (``recovery.quorum = "torchft"``) is reached directly: it cannot resume after a takeover
    anyway."""
    return cfg.recovery.quorum == "tree"


def controller_spec(cfg: JobConfig) -> ControllerSpec:
    """The supervision tree's settings for ``cfg``: its timeouts, and what every host agent
    imports once before it forks (``runtime.spec.ControllerSpec``)."""
    from harness.rank.model import model_modules  # (model.py imports torch)
    from harness.rank.warm import warmup_calls

    t = cfg.timeouts
    return ControllerSpec(
        bind_host=cfg.bind_host,
        heartbeat=HeartbeatSpec(interval_s=t.heartbeat_interval, timeout_s=t.heartbeat_timeout),
        agent_heartbeat=HeartbeatSpec(
            interval_s=min(0.2, t.host_timeout / 5), timeout_s=t.host_timeout
        ),
        controller_silence_s=t.controller_silence,
        controller_grace_s=cfg.recovery.controller_grace_s,
        connect_timeout_s=t.connect_timeout,
        # Imported once per agent, before it forks, and the initial model built once (and, for
        # sharded groups, FSDP2 and DTensor warmed: harness.rank.warm): a replacement then does
        # not pay for torch, torchft, the model code, the first optimizer's dynamo import (~1-3 s
        # each on this machine).
        # A job that checkpoints in DCP (sharded groups by default) also imports DCP's code
        # there, not in each replacement (30-60 ms here).
        preload=("torch", "torch._dynamo", "harness.rank.actors", *model_modules(cfg))
        + (("harness.rank.dcp_checkpoint",) if _writes_dcp(cfg) else ()),
        warmup=warmup_calls(cfg),
        network_interface=cfg.network.interface,
        network_cidr=cfg.network.cidr,
        quorum_relay=wants_quorum_relay(cfg),
    )


def _writes_dcp(cfg: JobConfig) -> bool:
    """Whether ``cfg``'s trainers checkpoint in DCP (``checkpoint.format``)."""
    return not cfg.program.enabled and cfg.checkpoint.resolved_format(cfg.parallel.group) == "dcp"
