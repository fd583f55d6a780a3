"""Every message of the control channel, typed, in one place.

Three links carry them (``runtime.channel`` frames each message as one pickle, after the
authenticated handshake):

* host agent -> controller: :class:`HelloAgent` (the agent dials in: its first frame), then
  :class:`AgentReady`, :class:`Spawned`, :class:`Exited`, :class:`Hung`, :class:`AgentBeat`,
  :class:`StoreServed`, and the preflight's :class:`PreflightReply` kinds;
* controller -> host agent: :class:`AgentConfig` (the answer to HelloAgent), :class:`Spawn`,
  :class:`SpawnProgram`, :class:`StopProc`, :class:`Shutdown`, :class:`ControllerBeat`,
  :class:`DropConnections`, :class:`UnblockPeers`, :class:`QuorumUpstream`, :class:`ServeStore`,
  and the preflight's :class:`PreflightCommand` kinds (``runtime.preflight``);
* controller <-> worker: :class:`HelloWorker` (worker -> controller, first frame), then
  :class:`Welcome` (the controller's epoch), :class:`SpawnActor`, :class:`CallEndpoint` and
  :class:`SysCall` (requests, each with a ``call_id``), and back :class:`Result` and
  :class:`Event` (a journal record).

Receivers dispatch with ``match`` on the type; anything else is a malformed message (the receiver
drops that peer, see ``runtime.channel.FrameError``). Messages are frozen dataclasses: adding a
field is adding it here, with its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- controller -> host agent -------------------------------------------------------------------


#: The byte a cold worker sends on its heartbeat socket once its imports are done: until then its
#: agent allows it ``AgentConfig.start_timeout_s`` of silence instead of the heartbeat timeout.
WORKER_STARTED = b"S"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """How the agent runs: what it imports before forking, its workers' heartbeats, its own,
    and how long the controller may stay silent before the agent fences itself (stops its
    workers and exits: a partitioned host must not keep training on its own)."""

    preload: tuple[str, ...]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    agent_heartbeat_interval_s: float
    controller_silence_s: float
    connect_timeout_s: float
    # A cold worker (a fresh interpreter importing torch) may be silent this long before it says
    # it has started (WORKER_STARTED): loading a library holds the GIL, and three cold starts at
    # once on a loaded host stop its heartbeat thread for seconds; it is no hang.
    start_timeout_s: float = 60.0
    # Called once after the preload imports, before any fork: ("module:function", kwargs).
    # What they build (a model, say) every worker forked from the agent inherits, copy-on-write.
    warmup: tuple[tuple[str, dict[str, Any]], ...] = ()
    # The job's network.interface / network.cidr: the agent advertises its address there
    # (runtime.netaddr.choose); empty: the address its connection to the controller leaves from.
    network_interface: str = ""
    network_cidr: str = ""
    # The controller's epoch (runtime.control_file): an agent obeys only the highest it has
    # seen, and refuses a controller of a lower one (an old controller that came back).
    epoch: int = 1
    # The job's quorum traffic goes through a relay on each host (runtime.relay): the agent
    # starts it and exports its address (RELAY_ENV) before forking any worker, and forwards to
    # ``quorum_upstream`` (the quorum service's address; "": not serving yet, see QuorumUpstream).
    quorum_relay: bool = False
    quorum_upstream: str = ""


@dataclass(frozen=True, slots=True)
class QuorumUpstream:
    """The quorum service now serves at ``address`` (``http://host:port``): the agent's relay
    forwards there from now on (``runtime.relay``), and closes what it relayed elsewhere."""

    address: str


@dataclass(frozen=True, slots=True)
class ControllerBeat:
    t: float


@dataclass(frozen=True, slots=True)
class DropConnections:
    """Host ``address`` is lost: close this host's TCP connections to it now (``ss -K``). A cut
    link closes nothing, and a collective blocked on a peer there would otherwise wait out its
    whole timeout."""

    address: str


@dataclass(frozen=True, slots=True)
class UnblockPeers:
    """Program replica group ``replica`` died or was fenced on another host: shut down this
    host's ranks' connections of the communicator they shared with it (``runtime.sockets``)."""

    replica: int


@dataclass(frozen=True, slots=True)
class Spawn:
    """Fork a worker (``cold``: exec a fresh interpreter instead) with these coordinates."""

    proc_id: str
    coords: dict[str, int]
    log_path: str | None
    cold: bool = False


@dataclass(frozen=True, slots=True)
class SpawnProgram:
    """Start a program of the user's own (not a worker: no control connection, no heartbeat)
    as ``argv`` with ``env`` added to the agent's environment, in ``cwd``, stdout and stderr to
    ``log_path``, in a session of its own. Answered with :class:`Spawned` (running) or
    :class:`Exited` (it could not be started: status 127 << 8, the reason in its log)."""

    proc_id: str
    coords: dict[str, int]
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None
    log_path: str | None
    warm: bool = False  # fork the agent's preloaded interpreter (``python SCRIPT|-m MOD ...``)


@dataclass(frozen=True, slots=True)
class ServeStore:
    """Serve a fresh TCPStore for replica group ``replica`` on this host
    (``runtime.group_store``), ending the one served for it before; answered with
    :class:`StoreServed`."""

    replica: int


@dataclass(frozen=True, slots=True)
class StopProc:
    """SIGTERM the worker's process tree, SIGKILL after ``grace_s`` (0: at once)."""

    proc_id: str
    grace_s: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop every worker (with ``grace_s``) and exit."""

    grace_s: float


# -- host agent -> controller -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReportedWorker:
    """A live worker (or program) of an agent that re-dials a new controller: ``coords`` as
    spawned (a spare adopted since says its current ones when it re-dials itself)."""

    proc_id: str
    pid: int
    coords: dict[str, int]
    spare: bool = False
    program: bool = False


@dataclass(frozen=True, slots=True)
class AgentReport:
    """What an agent that outlived its controller tells the next one: its live workers, the
    epoch it last served, its advertised address, and the highest process number it ever
    spawned (``host/pN``: a new controller numbers past it, so no process id is reused)."""

    workers: tuple[ReportedWorker, ...]
    epoch: int
    address: str
    highest_proc: int = -1


@dataclass(frozen=True, slots=True)
class HelloAgent:
    """The agent of host ``host`` dialled in (``pid`` on its own machine); ``report`` when it
    re-dials a new controller after losing its own (``runtime.orphan``)."""

    host: str
    pid: int
    report: AgentReport | None = None


@dataclass(frozen=True, slots=True)
class AgentReady:
    """Preloaded and serving. ``address``: where other hosts reach this one (the local address
    of its connection to the controller, unless configured)."""

    host: str
    pid: int
    address: str


@dataclass(frozen=True, slots=True)
class Spawned:
    proc_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class StoreServed:
    """The answer to :class:`ServeStore`: the store's ``host:port``, or why there is none
    (``address`` empty, ``error`` says why)."""

    replica: int
    address: str
    error: str = ""


@dataclass(frozen=True, slots=True)
class Exited:
    """The agent reaped the worker; ``status`` is the raw ``waitpid`` status, ``t`` wall time."""

    proc_id: str
    pid: int
    status: int
    t: float


@dataclass(frozen=True, slots=True)
class Hung:
    """The worker sent no heartbeat for ``silent_s``; its last one was at wall time ``t_last``."""

    proc_id: str
    pid: int
    silent_s: float
    t_last: float


@dataclass(frozen=True, slots=True)
class AgentBeat:
    t: float


# -- controller <-> worker ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloWorker:
    """A worker dialled in. Re-dialling a new controller (``epoch_seen`` > 0) it also says its
    current coordinates and the calls it has not answered yet, ``(call_id, actor, method)``
    each (a SysCall's actor is "" and its method the function's wire name)."""

    proc_id: str
    pid: int
    epoch_seen: int = 0
    coords: dict[str, int] | None = None
    open_calls: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Welcome:
    """controller -> worker, the answer to HelloWorker: the controller's epoch. A worker
    closes a connection whose epoch is below the highest it has seen. ``resend_after``: the
    highest of the worker's events (``Event.seq``) the journal holds; a re-dialling worker
    sends those it kept past it again (``runtime.resend``); -1: send nothing again."""

    epoch: int
    resend_after: int = -1


@dataclass(frozen=True, slots=True)
class SpawnActor:
    """Construct ``cls(*args, **kwargs)`` as actor ``name`` on the worker's main thread."""

    call_id: int
    name: str
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallEndpoint:
    """Call endpoint ``method`` of actor ``actor``, in order, on the worker's main thread."""

    call_id: int
    actor: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SysCall:
    """Run ``"module:function"(*args)`` on a fresh thread of the worker (fault hooks, stop)."""

    call_id: int
    func: str
    args: tuple[Any, ...]


Request = SpawnActor | CallEndpoint | SysCall


@dataclass(frozen=True, slots=True)
class Result:
    """The reply to a request: ``value`` or, if not ``ok``, (exception type, message, traceback)."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Event:
    """A journal record from an actor (``runtime.journal`` names the events). ``seq``: its
    number, 1, 2, ... for the life of the worker process (0: not numbered), journaled as
    ``eseq`` so that a worker can send again what a dead controller never read
    (``runtime.resend``)."""

    event: str
    fields: dict[str, Any]
    seq: int = 0


# -- the connectivity preflight (runtime.preflight: the agent's side; runtime.preflight_matrix) --


@dataclass(frozen=True, slots=True)
class PreflightCommand:
    """controller -> host agent: one step of the preflight round ``nonce``."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class PreflightListen(PreflightCommand):
    """Listen on the advertised address (port 0) for at most ``window_s``, each peer for at most
    ``timeout_s``; answered with :class:`PreflightListening`."""

    timeout_s: float
    window_s: float


@dataclass(frozen=True, slots=True)
class PreflightTarget:
    """An address to probe: another agent's preflight listener (``token``: it must answer the
    job's token) or a service of the controller (a connection is enough). ``place``: where the
    target runs (``runtime.preflight.place_identity``), to tell a loopback address that cannot
    work from one that does."""

    name: str
    address: str
    port: int
    place: str
    token: bool
    bound: str = ""  # the IP the target listens on: its own resolution of ``address``


@dataclass(frozen=True, slots=True)
class PreflightProbe(PreflightCommand):
    """Connect to every target at once, each within ``timeout_s``; answered with
    :class:`PreflightReport`."""

    targets: tuple[PreflightTarget, ...]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PreflightClose(PreflightCommand):
    """The round is over: close the preflight listener."""


@dataclass(frozen=True, slots=True)
class PreflightReply:
    """host agent -> controller: an answer of ``host`` in preflight round ``nonce``."""

    nonce: bytes
    host: str


@dataclass(frozen=True, slots=True)
class PreflightListening(PreflightReply):
    """Listening on ``port`` (0, with ``error`` saying why, if it could not); ``place`` as in
    :class:`PreflightTarget`."""

    port: int
    place: str
    error: str
    bound: str = ""  # the IP it listens on (its advertised address, resolved where it runs)


@dataclass(frozen=True, slots=True)
class PreflightResult:
    """One probe: ``outcome`` (a ``runtime.preflight.Outcome`` value), why, and how long it took."""

    target: str
    address: str
    port: int
    outcome: str
    detail: str
    seconds: float


@dataclass(frozen=True, slots=True)
class PreflightReport(PreflightReply):
    """Every probe of a :class:`PreflightProbe`."""

    results: tuple[PreflightResult, ...]
