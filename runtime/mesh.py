"""Meshes: processes and actors arranged on named dimensions, sliced like arrays.

    procs = host.spawn_procs({"replicas": 3, "ranks": 2})
    trainers = procs.spawn("trainer", Trainer, cfg)
    trainers.slice(replicas=1)                # drops the "replicas" dim
    trainers.slice(ranks=slice(0, 1))         # keeps it, one long
    trainers.step.call(5).get()               # broadcast; a ValueMesh keyed by coordinates
    trainers.slice(replicas=0, ranks=0).step.call_one(5).get()
    trainers.step.choose(5).get()             # any one actor

Coordinates in a ValueMesh are relative to the mesh that was called (tuples in dimension
order); every process also keeps the absolute coordinates it was spawned with (``coords``).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import random
from collections.abc import Callable, ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from runtime.actor import endpoints_of
from runtime.messages import CallEndpoint, SpawnActor
from runtime.plane import ControlPlane

T = TypeVar("T")
Coord = tuple[int, ...]


class MeshError(ValueError):
    """A slice or shape that does not fit the mesh."""


@dataclass(frozen=True)
class ProcRef:
    proc_id: str
    host: str
    coords: Mapping[str, int]


@dataclass(frozen=True)
class ActorRef:
    proc: ProcRef
    name: str


class Mesh(Generic[T]):
    """Items on a grid of named dimensions."""

    def __init__(self, dims: Mapping[str, int], items: Mapping[Coord, T]) -> None:
        self.dims: dict[str, int] = dict(dims)
        expected = list(itertools.product(*(range(n) for n in self.dims.values())))
        if sorted(items) != expected:
            raise MeshError(f"items do not fill the mesh {self.dims}")
        self._items: dict[Coord, T] = dict(items)

    # -- shape --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[dict[str, int], T]]:
        for coord, item in self._items.items():
            yield dict(zip(self.dims, coord, strict=True)), item

    def items(self) -> list[T]:
        return list(self._items.values())

    def at(self, **point: int) -> T:
        return self._items[self._coord(point)]

    def _coord(self, point: Mapping[str, int]) -> Coord:
        if set(point) != set(self.dims):
            raise MeshError(f"a point needs exactly the dims {list(self.dims)}, got {list(point)}")
        return tuple(point[d] for d in self.dims)

    def _select(self, **sel: int | slice) -> tuple[dict[str, int], dict[Coord, T]]:
        unknown = set(sel) - set(self.dims)
        if unknown:
            raise MeshError(f"no dimension {sorted(unknown)} in mesh {self.dims}")
        keep: dict[str, list[int]] = {}
        fixed: dict[str, int] = {}
        for d, n in self.dims.items():
            s = sel.get(d, slice(None))
            if isinstance(s, int):
                if not -n <= s < n:
                    raise MeshError(f"index {s} out of range for dimension {d!r} of size {n}")
                fixed[d] = s % n
            elif isinstance(s, slice):
                idx = list(range(n))[s]
                if not idx:
                    raise MeshError(f"slice {s} of dimension {d!r} (size {n}) is empty")
                keep[d] = idx
            else:
                raise MeshError(f"dimension {d!r}: expected an int or a slice, got {s!r}")
        dims = {d: len(v) for d, v in keep.items()}
        out: dict[Coord, T] = {}
        for new in itertools.product(*(range(len(v)) for v in keep.values())):
            full = dict(fixed)
            full.update({d: keep[d][i] for d, i in zip(keep, new, strict=True)})
            out[new] = self._items[tuple(full[d] for d in self.dims)]
        return dims, out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dims})"


class ValueMesh(Mesh[Any], Mapping[Coord, Any]):
    """Results of a broadcast call, keyed by coordinate tuples of the called mesh."""

    def __getitem__(self, coord: Coord) -> Any:
        return self._items[coord]

    # A ValueMesh is a Mapping of coordinates: iteration and items() are Mapping's (keys, and
    # (coord, value) pairs), not Mesh's (points with items, and a list of items), a deliberate
    # difference from the base class that mypy rightly reports as an incompatible override.
    def __iter__(self) -> Iterator[Coord]:  # type: ignore[override]
        return iter(self._items)

    def values(self) -> ValuesView[Any]:
        return self._items.values()

    def items(self) -> ItemsView[Coord, Any]:  # type: ignore[override]
        return self._items.items()

    def by_point(self) -> list[tuple[dict[str, int], Any]]:
        """(coordinates by name, value) pairs."""
        return [(dict(zip(self.dims, c, strict=True)), v) for c, v in self._items.items()]


class ProcMesh(Mesh[ProcRef]):
    """Worker processes on named dimensions. ``spawn`` puts an actor on each of them."""

    def __init__(
        self, plane: ControlPlane, dims: Mapping[str, int], items: Mapping[Coord, ProcRef]
    ) -> None:
        super().__init__(dims, items)
        self.plane = plane

    def slice(self, **sel: int | slice) -> ProcMesh:
        dims, items = self._select(**sel)
        return ProcMesh(self.plane, dims, items)

    @property
    def proc_ids(self) -> list[str]:
        return [p.proc_id for p in self.items()]

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """Construct ``cls(*args, **kwargs)`` as actor ``name`` in every process; wait for it."""
        futures = {
            c: self.plane.request(
                p.proc_id, SpawnActor, name=name, cls=cls, args=args, kwargs=kwargs
            )
            for c, p in self._items.items()
        }
        MeshFuture(self.dims, futures, self._items).get(self.plane.spec.spawn_timeout_s)
        refs = {c: ActorRef(p, name) for c, p in self._items.items()}
        return ActorMesh(self.plane, cls, self.dims, refs)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop these processes (SIGTERM, grace, SIGKILL); their exits are not failures."""
        for pid in self.proc_ids:
            self.plane.stop_proc(pid, grace_s)

    @staticmethod
    def stack(meshes: list[ProcMesh], dim: str) -> ProcMesh:
        """Stack equal-shaped meshes (e.g. one per host) along a new leading dimension."""
        if not meshes:
            raise MeshError("nothing to stack")
        dims0 = meshes[0].dims
        if any(m.dims != dims0 for m in meshes):
            raise MeshError("meshes to stack must have the same dims")
        items = {(i, *c): p for i, m in enumerate(meshes) for c, p in m._items.items()}
        return ProcMesh(meshes[0].plane, {dim: len(meshes), **dims0}, items)


class ActorMesh(Mesh[ActorRef]):
    """Actors on named dimensions. ``mesh.<endpoint>`` gives an endpoint to call."""

    def __init__(
        self,
        plane: ControlPlane,
        cls: type,
        dims: Mapping[str, int],
        items: Mapping[Coord, ActorRef],
    ) -> None:
        super().__init__(dims, items)
        self.plane = plane
        self.actor_class = cls

    def slice(self, **sel: int | slice) -> ActorMesh:
        dims, items = self._select(**sel)
        return ActorMesh(self.plane, self.actor_class, dims, items)

    @property
    def procs(self) -> ProcMesh:
        return ProcMesh(self.plane, self.dims, {c: a.proc for c, a in self._items.items()})

    @property
    def proc_ids(self) -> list[str]:
        return [a.proc.proc_id for a in self.items()]

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in endpoints_of(self.actor_class):
            raise AttributeError(
                f"{self.actor_class.__name__} has no endpoint {name!r} "
                f"(endpoints: {sorted(endpoints_of(self.actor_class))})"
            )
        return Endpoint(self, name)


class Endpoint:
    """One endpoint of every actor in a mesh."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self.mesh = mesh
        self.name = name

    def _call(self, items: Mapping[Coord, ActorRef], args: Any, kwargs: Any) -> dict:
        c = self.mesh.plane
        return {
            coord: c.request(
                a.proc.proc_id,
                CallEndpoint,
                actor=a.name,
                method=self.name,
                args=args,
                kwargs=kwargs,
            )
            for coord, a in items.items()
        }

    def call(self, *args: Any, **kwargs: Any) -> MeshFuture:
        """Broadcast to every actor; ``.get()`` gives a ValueMesh keyed by coordinates."""
        futures = self._call(self.mesh._items, args, kwargs)
        procs = {c: a.proc for c, a in self.mesh._items.items()}
        return MeshFuture(self.mesh.dims, futures, procs)

    def call_one(self, *args: Any, **kwargs: Any) -> OneFuture:
        """Call the only actor of a one-actor mesh."""
        if len(self.mesh) != 1:
            raise MeshError(f"call_one needs a mesh of one actor, this one is {self.mesh.dims}")
        ((coord, ref),) = self.mesh._items.items()
        return OneFuture(self._call({coord: ref}, args, kwargs)[coord], ref.proc)

    def choose(self, *args: Any, **kwargs: Any) -> OneFuture:
        """Call any one actor of the mesh (chosen at random)."""
        coord, ref = random.choice(list(self.mesh._items.items()))
        return OneFuture(self._call({coord: ref}, args, kwargs)[coord], ref.proc)


def _unwrap(fut: cf.Future, timeout: float | None, proc: ProcRef) -> Any:
    try:
        return fut.result(timeout=timeout)
    except cf.TimeoutError:
        raise CallTimeout(
            f"no reply from {proc.proc_id} {dict(proc.coords)} within {timeout} s"
        ) from None


class CallTimeout(TimeoutError):
    """An endpoint call got no reply in time (fail on timeout; nothing is retried)."""


class OneFuture:
    def __init__(self, fut: cf.Future, proc: ProcRef) -> None:
        self._fut = fut
        self.proc = proc

    def get(self, timeout: float | None = 60.0) -> Any:
        return _unwrap(self._fut, timeout, self.proc)

    def done(self) -> bool:
        return self._fut.done()

    def add_done_callback(self, fn: Callable[[cf.Future], None]) -> None:
        self._fut.add_done_callback(fn)


class MeshFuture:
    """Futures of a broadcast. ``get`` waits for all and raises the first error."""

    def __init__(
        self, dims: Mapping[str, int], futures: Mapping[Coord, cf.Future], procs: Mapping
    ) -> None:
        self.dims = dict(dims)
        self.futures = dict(futures)
        self._procs = procs

    def get(self, timeout: float | None = 60.0) -> ValueMesh:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        out = {}
        for coord, fut in self.futures.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out[coord] = _unwrap(fut, left, self._procs[coord])
        return ValueMesh(self.dims, out)

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())
