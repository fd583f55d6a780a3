"""The fault protocol, the registry of fault kinds, targets and the context faults act through.

A fault kind is a frozen, keyword-only dataclass registered by name::

    @register("kill")
    @dataclass(frozen=True, kw_only=True)
    class Kill:
        default_target: ClassVar[TargetKind] = "rank"
        hold_s: float = 0.0
        def fire(self, ctx, target, rng): ...
        def heal(self, ctx, target): ...

Its fields are the kind's options (an experiment file sets them under
``[faults.options.KIND]``); ``hold_s`` is how long the injector waits between ``fire`` and
``heal``. New kinds register themselves on import; the injector only ever looks them up here.

Contract for a fault:

* ``fire`` does the damage and returns; it must not wait for recovery. The injector has already
  written ``fault.inject`` to the journal before it is called.
* ``heal`` undoes what the supervisor will not undo by itself (SIGCONT a stopped process, reset a
  step delay). It may be a no-op (a killed group is restarted by its supervisor). It must be
  safe to call when the target is already gone.
* Neither chooses its target: target selection is :mod:`faults.targets`' job.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from runtime.journal import Journal

#: What a fault hits: one rank of a group, a whole replica group, a host, the quorum service, or
#: the job's controller.
TargetKind = Literal["rank", "replica", "host", "service", "controller"]
TARGET_KINDS: tuple[str, ...] = ("rank", "replica", "host", "service", "controller")

# The modules that hold the catalogue; imported on first registry lookup so that importing
# faults.fault alone stays cheap and free of cycles.
_CATALOGUE_MODULES = (
    "faults.process",
    "faults.gil",
    "faults.collective",
    "faults.host",
    "faults.service",
    "faults.straggler",
    "faults.bitflip",
    "faults.network",
    "faults.slurm",
    "faults.controller",
    "faults.data",
    "faults.device",
)


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where a fault lands. ``rank=None`` with a replica means every rank of that group;
    all three None means the quorum service, or, with ``controller``, the job's controller.
    ``host`` is informational for rank/replica targets (where the group ran when the plan was
    made) and the subject of host faults."""

    replica: int | None = None
    rank: int | None = None
    host: str | None = None
    controller: bool = False

    def describe(self) -> str:
        if self.controller:
            return "the controller" + (f"'s node {self.host}" if self.host else "")
        if self.replica is None and self.host is None:
            return "quorum service"
        if self.replica is None:
            return f"host {self.host}"
        where = f" on {self.host}" if self.host else ""
        if self.rank is None:
            return f"replica group {self.replica} (all ranks){where}"
        return f"replica {self.replica} rank {self.rank}{where}"

    def as_dict(self) -> dict[str, Any]:
        """The ``target`` field of a ``fault.inject`` record."""
        out: dict[str, Any] = {"replica": self.replica, "rank": self.rank, "host": self.host}
        if self.controller:
            out["controller"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target:
        return cls(
            replica=data.get("replica"),
            rank=data.get("rank"),
            host=data.get("host"),
            controller=bool(data.get("controller", False)),
        )


@runtime_checkable
class FaultContext(Protocol):
    """What a fault may touch. The harness implements it; tests use a hand-written fake.

    ``run_in_worker`` runs ``func(*args)`` inside each worker process of ``target`` on a thread
    that is not the training thread and returns once the call is delivered (it does not wait
    for the function's effect: a segfaulting function never returns). ``func`` is a module-level
    function (``faults.inworker``'s): only its name travels (``runtime.actor.wire_name``).
    """

    journal: Journal
    replicas: int
    ranks: int
    networked: bool  # hosts have links of their own (network faults need it)

    def hosts(self) -> list[str]: ...

    def replica_host(self, replica: int) -> str: ...

    def pids(self, target: Target) -> list[int]: ...

    def run_in_worker(self, target: Target, func: Callable[..., Any], *args: Any) -> None: ...

    def kill_host(self, host: str) -> None: ...

    def set_host_cooldown(self, host: str, seconds: float) -> None: ...

    def kill_quorum_service(self) -> None: ...

    def committed_step(self) -> int: ...

    def poison_data(
        self, steps_ahead: int | None, effect: str = "unreadable", *, ahead_s: float = 1.0
    ) -> dict[str, Any]:
        """Make the data the job reads ``steps_ahead`` steps after its last commit (that step's
        first sequence; None: as many steps as the job commits in ``ahead_s`` at its recent
        rate, at least 3) crash every step that reads it (``effect = "nonfinite"``: give it a
        NaN loss), from now on and in every group; return where it is (``index``, ``key``,
        ``steps_ahead`` and, for a token file, its ``chunk``, ``offset``, ``document``,
        ``in_document``). ValueError where the job cannot (a program's data)."""
        ...

    def break_device(self, replica: int) -> None:
        """Make group ``replica`` fail every step from now on, in every incarnation (the
        ``broken_device`` fault); ValueError where the job cannot (a program's devices)."""
        ...

    def partition_host(self, host: str) -> None:
        """Cut the host's link: nothing reaches it or leaves it (needs hosts with a network of
        their own, ``launcher = "netns"``; ValueError otherwise)."""
        ...

    def reconnect_host(self, host: str) -> None: ...

    def impair_link(self, host: str, delay_ms: float, loss_pct: float) -> None:
        """Delay (each way) and drop packets on the host's link (netns hosts only)."""
        ...

    def clear_link(self, host: str) -> None: ...

    def fail_node(self, host: str) -> None:
        """Kill the SLURM node's slurmd and every process of the node (launcher = "slurm" on
        nodes that are network namespaces here, bin/test-cluster; ValueError otherwise). The
        controller's own node too (this process dies with it: only in a job a standby on
        another node takes over, the journal fsync'd first; it returns only if that failed)."""
        ...

    def cancel_step(self, host: str) -> None:
        """``scancel`` the node's agent step (launcher = "slurm"; ValueError otherwise)."""
        ...

    def controller_host(self) -> str:
        """The host (SLURM node) the job's controller runs on now."""
        ...

    def heals_under_way(self) -> dict[int, int]:
        """The replica groups loading a peer's state now, each mapped to the group it heals
        from (its source)."""
        ...

    def checkpoints_under_way(self) -> dict[int, int]:
        """The replica groups writing a checkpoint now, each mapped to its step."""
        ...

    def in_phase(self, phase: str) -> bool:
        """Whether the job is in ``phase`` now (``faults.controller.PHASES``: a quorum forming,
        a group healing, a checkpoint being written)."""
        ...

    def kill_controller(self) -> None:
        """SIGKILL the job's controller (the process this runs in): only in a job a new
        controller takes over (run under a keeper, ``harness.job.takeover``); ValueError
        otherwise. Returns first (the kill comes from a thread of its own, a moment later)."""
        ...

    def wedge_controller(self) -> None:
        """Have a thread of the controller take its control plane's lock and never give it
        back (same conditions as :meth:`kill_controller`)."""
        ...


class Fault(Protocol):
    """One fault kind's behaviour (see the module docstring for the contract)."""

    name: ClassVar[str]
    default_target: ClassVar[TargetKind]
    hold_s: float

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None: ...

    def heal(self, ctx: FaultContext, target: Target) -> None: ...

    # Optional: a fault that waits for a moment has ``ready(ctx, rng) -> bool`` and ``wait_s``
    # (faults.injector), and may prepare that moment with ``arm(ctx, rng)``, called once when
    # it falls due; ``aim(ctx, target) -> list[Target]`` names its targets when it fires, best
    # first (known only then: the source of a heal under way; the injector takes the first that
    # keep-alive allows, and skips the fault if none);
    # ``inject_fields(rng) -> dict`` adds fields to its ``fault.inject``.


class UnknownFault(KeyError):
    """A fault kind nobody registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


_REGISTRY: dict[str, type] = {}
_loaded = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make ``cls`` the fault kind ``name``. A second kind with the same name is
    an error (two modules disagreeing about what a name means)."""

    def deco(cls: type[Any]) -> type[Any]:  # any class: it is given its `name` below
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"fault kind {name!r} is already registered by {_REGISTRY[name]!r}")
        if getattr(cls, "default_target", None) not in TARGET_KINDS:
            raise ValueError(f"fault kind {name!r}: default_target must be one of {TARGET_KINDS}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_catalogue() -> None:
    global _loaded
    if not _loaded:
        for module in _CATALOGUE_MODULES:
            importlib.import_module(module)
        _loaded = True


def fault_kinds() -> list[str]:
    """Every registered kind, sorted."""
    _load_catalogue()
    return sorted(_REGISTRY)


def fault_class(kind: str) -> type:
    _load_catalogue()
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise UnknownFault(
            f"unknown fault kind {kind!r}; known kinds: {', '.join(sorted(_REGISTRY))}"
        ) from None


def fault_options(kind: str) -> dict[str, Any]:
    """The options of ``kind`` and their defaults."""
    cls = fault_class(kind)
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def make_fault(kind: str, **options: Any) -> Fault:
    """An instance of ``kind`` with ``options``; an unknown option raises ValueError naming the
    allowed ones."""
    cls = fault_class(kind)
    allowed = fault_options(kind)
    hints = typing.get_type_hints(cls)
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(
                f"fault {kind!r} has no option {key!r}; allowed: {', '.join(sorted(allowed))}"
            )
        wrong = _wrong_type(hints.get(key), value)
        if wrong:
            raise ValueError(f"fault {kind!r} option {key!r} must be {wrong}, got {value!r}")
    return cls(**options)


def _wrong_type(hint: Any, value: Any) -> str | None:
    """What ``value`` should have been, if it does not fit an option's annotation (a number, a
    string or one of a Literal's values; bools are not numbers here); None if it fits or the
    annotation is one this does not check. Range checks stay with each fault's own
    ``__post_init__``."""
    args = typing.get_args(hint)
    if len(args) == 2 and type(None) in args:  # an optional option: what it holds when set
        inner = args[0] if args[1] is type(None) else args[1]
        return None if value is None else _wrong_type(inner, value)
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return None if value in choices else "one of " + ", ".join(map(repr, choices))
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "a number"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint in (str, bool):
        return None if isinstance(value, hint) else f"a {hint.__name__}"
    return None
