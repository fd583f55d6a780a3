"""Monarch side of ``ftharness bench runtime``: the same four figures, measured on torchmonarch.

``measure_monarch()`` runs the measurement in a child process (``python -m
experiments.bench.monarch_side``) so Monarch's runtime threads, signal handlers and processes never
touch the caller, and returns one dict (``None`` where ``import monarch`` fails):

- ``spawn_mesh_s``: on an already-running host (one throw-away spawn first, so bootstrap is
  excluded), ``this_host().spawn_procs(per_host={"gpus": 4})`` + spawning an actor whose
  ``__init__`` imports torch + the first broadcast answered by all 4. Median over ``reps`` fresh
  proc meshes.
- ``call_p50_ms``: a no-op endpoint broadcast to those 4 actors, results gathered
  (``.call().get()``), p50 over 200 calls after 20 warm-ups.
- ``detect_kill_ms``: SIGKILL of one worker (pid from an endpoint) until Monarch delivers a
  ``MeshFailure`` for that actor mesh to its owner, the client, through supervision (the root
  client actor's ``__supervise__`` hands unhandled failures to
  ``monarch.actor.unhandled_fault_hook``, which the child replaces with a recorder). One kill per
  rep mesh, at random phases of Monarch's supervision poll (the figure depends on that phase), all
  awaited at once. A second child measures the same at a 500 ms poll (up to 3 reps).
- ``detect_hang_s``: a worker thread holds the GIL in a C call (``ctypes.PyDLL(None).sleep``);
  the time from the start of the hold until a failure for that mesh, waiting ``hang_wait_s``.
  No message is sent to the frozen worker meanwhile. ``None`` with ``"0/N"`` when never reported.

Every process the children start carries ``MARKER_ENV`` in its environment; the parent SIGKILLs
whatever still carries its marker when a child ends, so no Monarch process survives.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import psutil

MARKER_ENV = "FTHARNESS_MONARCH_BENCH"
POLL_ENV = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"
DEFAULT_POLL = "10s"  # SUPERVISION_POLL_FREQUENCY's default in hyperactor_mesh's mesh_controller
FAST_POLL = "500ms"
PER_HOST = {"gpus": 4}
CALL_WARMUP = 20
CALL_SAMPLES = 200
KILL_WAIT_S = 20.0
HOLD_DELAY_S = 0.3  # the hold starts after the endpoint's reply has left
HOLD_C_SLEEP_S = 120


def measure_monarch(
    reps: int = 5,
    heartbeat_hint_s: float = 1.0,
    hang_wait_s: float = 15.0,
    *,
    hang_reps: int = 2,
    fast_poll: bool = True,
    run_id: str = "",
) -> dict[str, Any] | None:
    """Measure Monarch's spawn, call, kill-detection and hang-detection figures.

    Returns ``None`` where torchmonarch is not importable. Otherwise a dict with ``version``,
    ``spawn_mesh_s``, ``call_p50_ms``, ``detect_kill_ms`` (median or ``None``),
    ``detect_kill_reported`` (``"k/n"``), ``detect_hang_s`` (median or ``None``),
    ``detect_hang_reported``, ``supervision_poll_note`` and, with ``fast_poll``, the kill
    figures at a 500 ms poll. ``heartbeat_hint_s`` is the ftharness heartbeat timeout the caller
    compares against; it is reported beside the hang figure (Monarch has no worker heartbeat).
    A failed child yields the figures as ``None`` and an ``error`` string instead of raising.
    ``hang_reps`` (at most ``reps``) bounds the hang measurement, which waits ``hang_wait_s``.
    Every process started carries ``MARKER_ENV`` = ``run_id`` + a random suffix, so
    ``marked_processes(run_id)`` finds any that survived (none should).
    """
    if importlib.util.find_spec("monarch") is None:
        return None
    hang_reps = max(1, min(hang_reps, reps))
    hang_wait_s = max(hang_wait_s, heartbeat_hint_s + 0.5)
    args = ["--reps", str(reps), "--hang-reps", str(hang_reps), "--hang-wait-s", str(hang_wait_s)]
    # A cap, not an estimate: a spawn takes ~3 s on a quiet 2-core machine, ~30 s on a busy one.
    timeout_s = 120 + 40 * (1 + reps + hang_reps) + KILL_WAIT_S + hang_wait_s
    main = _run_child(args, env={POLL_ENV: None}, timeout_s=timeout_s, run_id=run_id)
    if main is None:
        return None
    main["heartbeat_hint_s"] = heartbeat_hint_s
    main["hang_reps_note"] = (
        f"hang measured on {hang_reps} of {reps} reps, concurrently, {hang_wait_s:g} s wait each"
    )
    note = f"default supervision poll ({POLL_ENV} unset = {DEFAULT_POLL})"
    if fast_poll and main.get("error") is None:
        fast_reps = min(reps, 3)
        fast = _run_child(
            ["--reps", str(fast_reps), "--kill-only"],
            env={POLL_ENV: FAST_POLL},
            timeout_s=180,
            run_id=run_id,
        )
        if fast is not None and fast.get("error") is None:
            main["detect_kill_ms_poll_500ms"] = fast["detect_kill_ms"]
            main["detect_kill_reported_poll_500ms"] = fast["detect_kill_reported"]
            note += f"; *_poll_500ms: {POLL_ENV}={FAST_POLL}, {fast_reps} reps in a second child"
        elif fast is not None:
            note += f"; the {FAST_POLL} poll run failed: {fast['error']}"
    main["supervision_poll_note"] = note
    return _ordered(main)


def _ordered(result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys first, in the order the issue lists them, then the rest."""
    head = ["version", "spawn_mesh_s", "call_p50_ms", "detect_kill_ms", "detect_kill_reported"]
    head += ["detect_hang_s", "detect_hang_reported", "supervision_poll_note"]
    return {k: result[k] for k in head if k in result} | {
        k: v for k, v in result.items() if k not in head
    }


# --------------------------------------------------------------------------------------------
# Parent side: run one child, parse its JSON line, leave nothing behind.


def _run_child(
    args: list[str], env: dict[str, str | None], timeout_s: float, run_id: str = ""
) -> dict[str, Any] | None:
    """Run the measuring child with ``env`` applied (``None`` removes a variable); its last stdout
    line is the JSON result. ``None`` when the child says monarch is not importable; a dict with
    ``error`` when it fails or times out."""
    marker = f"{run_id}{uuid.uuid4().hex}"
    child_env = {k: v for k, v in os.environ.items() if env.get(k, "") is not None}
    child_env.update({k: v for k, v in env.items() if v is not None})
    child_env[MARKER_ENV] = marker
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench.monarch_side", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env,
            start_new_session=True,  # a process group of its own, killed as a whole
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            error = None if proc.returncode == 0 else f"child exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            out, error = b"", f"timed out after {timeout_s:.0f} s"
        finally:
            kill_marked(marker, also=proc)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    result = _last_json_line(out.decode(errors="replace"))
    if result is not None and result.get("unavailable"):
        return None
    if result is not None and "error" in result:
        return _failed(str(result["error"]), tail)
    if result is None or error is not None:
        return _failed(error or "child printed no JSON", tail)
    return result


def kill_marked(marker: str, also: subprocess.Popen | None = None) -> list[int]:
    """SIGKILL ``also``'s process group and every process whose ``MARKER_ENV`` starts with
    ``marker`` (Monarch's procs inherit it, even if re-parented); return their pids."""
    if also is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(also.pid, signal.SIGKILL)
    victims = marked_processes(marker)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(victims, timeout=5)
    if also is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            also.wait(timeout=5)
    return [p.pid for p in victims]


def marked_processes(marker: str = "") -> list[psutil.Process]:
    """Live processes (other than this one) whose ``MARKER_ENV`` starts with ``marker``."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            value = p.environ().get(MARKER_ENV)
            mine = value is not None and value.startswith(marker)
            if mine and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    return None


def _failed(error: str, stderr_tail: str) -> dict[str, Any]:
    return {
        "version": _version(),
        "spawn_mesh_s": None,
        "call_p50_ms": None,
        "detect_kill_ms": None,
        "detect_kill_reported": None,
        "detect_hang_s": None,
        "detect_hang_reported": None,
        "error": error,
        "stderr_tail": stderr_tail[-500:],
    }


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchmonarch")
    except PackageNotFoundError:
        return None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


# --------------------------------------------------------------------------------------------
# Child side: everything below runs only inside ``python -m experiments.bench.monarch_side``.


class _FailureLog:
    """Records (monotonic time, mesh name) of each MeshFailure that reaches the client."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[tuple[float, str]] = []

    def hook(self, failure: Any) -> None:
        """Stands in for ``monarch.actor.unhandled_fault_hook``; returning marks it handled."""
        now = time.monotonic()
        with self._cond:
            self.events.append((now, str(failure.mesh_name)))
            self._cond.notify_all()

    def first(self, prefix: str, after: float) -> float | None:
        """Time of the first failure after ``after`` for the actor mesh named ``prefix``-*."""
        with self._cond:
            for t, name in self.events:
                if t >= after and name.startswith(prefix + "-"):
                    return t
        return None

    def wait_all(self, wanted: dict[str, float], deadline: float) -> dict[str, float]:
        """Wait until each ``prefix -> since`` in ``wanted`` has a failure, or ``deadline``."""
        while True:
            got = {k: t for k, since in wanted.items() if (t := self.first(k, since)) is not None}
            left = deadline - time.monotonic()
            if len(got) == len(wanted) or left <= 0:
                return got
            with self._cond:
                self._cond.wait(timeout=min(left, 0.5))


def _hold_gil_at(at: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))
    import ctypes

    # PyDLL keeps the GIL across the foreign call: the whole interpreter freezes.
    ctypes.PyDLL(None).sleep(HOLD_C_SLEEP_S)


def _worker_class() -> type:
    from monarch.actor import Actor, endpoint

    class BenchWorker(Actor):
        """The measured actor: imports torch in __init__, as a trainer would."""

        def __init__(self) -> None:
            import torch  # noqa: F401

        @endpoint
        def pid(self) -> int:
            return os.getpid()

        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def hold_gil(self, delay_s: float) -> float:
            """Start a thread that holds the GIL from the returned monotonic time on."""
            at = time.monotonic() + delay_s
            threading.Thread(target=_hold_gil_at, args=(at,), daemon=True).start()
            return at

    return BenchWorker


def _spawn(host: Any, worker: type, name: str) -> tuple[Any, Any, list[int]]:
    procs = host.spawn_procs(per_host=PER_HOST)
    actors = procs.spawn(name, worker)
    pids = [pid for _, pid in actors.pid.call().get().items()]
    return procs, actors, pids


def _child(reps: int, hang_reps: int, hang_wait_s: float, kill_only: bool) -> dict[str, Any]:
    """The figures at the poll the environment sets (see the module docstring); ``kill_only``
    measures just ``detect_kill_ms``, skipping the warm-up spawn, the calls and the hangs."""
    import monarch.actor
    from monarch.actor import this_host

    log = _FailureLog()
    monarch.actor.unhandled_fault_hook = log.hook
    worker = _worker_class()
    host = this_host()
    meshes: list[tuple[Any, Any, list[int]]] = []
    try:
        if not kill_only:
            # Throw-away spawn: brings up the host side so bootstrap is not counted.
            warm = _spawn(host, worker, "warm")
            warm[0].stop().get()

        # One fresh mesh per rep: 0.7.0 reports only the first failed rank of a mesh (a second
        # SIGKILLed rank of the same mesh went unreported for 20 s here).
        spawns = []
        for i in range(reps):
            t0 = time.perf_counter()
            meshes.append(_spawn(host, worker, f"rep{i}"))
            spawns.append(time.perf_counter() - t0)

        lat: list[float] = []
        hang_meshes = []
        if not kill_only:
            actors = meshes[0][1]
            for _ in range(CALL_WARMUP):
                actors.noop.call().get()
            for _ in range(CALL_SAMPLES):
                t0 = time.perf_counter()
                actors.noop.call().get()
                lat.append(time.perf_counter() - t0)
            lat.sort()
            hang_meshes = [_spawn(host, worker, f"hang{i}") for i in range(hang_reps)]
            meshes.extend(hang_meshes)

        # Kills at random phases of the supervision poll (each mesh has its own controller),
        # then the GIL holds; the waits for both overlap.
        killed_at: dict[str, float] = {}
        for i in range(reps):
            time.sleep(random.uniform(0.0, 0.5))
            pids = meshes[i][2]
            killed_at[f"rep{i}"] = time.monotonic()
            os.kill(pids[i % len(pids)], signal.SIGKILL)
        held_at = {
            f"hang{i}": a.slice(gpus=1).hold_gil.call_one(HOLD_DELAY_S).get()
            for i, (_, a, _) in enumerate(hang_meshes)
        }
        kill_seen = log.wait_all(killed_at, time.monotonic() + KILL_WAIT_S)
        hang_seen = log.wait_all(held_at, max(held_at.values(), default=0.0) + hang_wait_s)

        kills = [(kill_seen[k] - t) * 1000 for k, t in killed_at.items() if k in kill_seen]
        hangs = [hang_seen[k] - t for k, t in held_at.items() if k in hang_seen]
        result: dict[str, Any] = {
            "version": _version(),
            "detect_kill_ms": _round(_median(kills), 1),
            "detect_kill_reported": f"{len(kills)}/{reps}",
            "detect_kill_samples_ms": [round(k, 1) for k in kills],
        }
        if not kill_only:
            result["spawn_mesh_s"] = _round(_median(spawns), 3)
            result["call_p50_ms"] = _round(lat[len(lat) // 2] * 1000, 3)
            result["detect_hang_s"] = _round(_median(hangs), 3)
            result["detect_hang_reported"] = f"{len(hangs)}/{hang_reps}"
        return result
    finally:
        _kill_pids(meshes)


def _kill_pids(meshes: list[tuple[Any, Any, list[int]]]) -> None:
    # Frozen and surviving workers die here; the parent sweeps anything else.
    for _, _, pids in meshes:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hang-reps", type=int, default=2)
    parser.add_argument("--hang-wait-s", type=float, default=15.0)
    parser.add_argument("--kill-only", action="store_true")
    a = parser.parse_args(argv)
    try:
        import monarch  # noqa: F401
    except Exception as e:  # any import failure means "not available here"
        print(json.dumps({"unavailable": True, "reason": repr(e)}), flush=True)
        return 0
    code = 0
    try:
        result = _child(a.reps, min(a.hang_reps, a.reps), a.hang_wait_s, a.kill_only)
    except Exception as e:
        result, code = {"error": f"{type(e).__name__}: {e}"}, 1
    print(json.dumps(result), flush=True)
    # Skip Monarch's interpreter teardown (its threads can keep a failed run alive, and stopping
    # meshes of dead procs waits on timeouts); the parent kills whatever carries the marker.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(_cli())
