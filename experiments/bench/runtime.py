"""``ftharness bench runtime``: spawn, call latency and failure detection of the tree.

Figures (median over ``--reps``, default 5), all on a host agent that is already running and
has imported torch (``agent_start_s`` reports that one-off cost separately):

* ``spawn_mesh_s``  — 4 worker processes forked, an actor constructed in each (it imports
  torch, already loaded), and a first broadcast answered;
* ``call_p50_ms``   — a no-op endpoint broadcast to the 4 actors, results gathered;
* ``detect_kill_ms`` — ``os.kill(worker, SIGKILL)`` to the failure value at the controller;
* ``detect_hang_s`` — a thread holding the GIL inside a C call to the failure value, beside the
  configured heartbeat timeout.

Where torchmonarch is installed (extra ``compare``), the same figures for Monarch, measured in
the same run by ``experiments.bench.monarch_side``, appear under ``"monarch"``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

from experiments.bench.monarch_side import measure_monarch
from runtime.actor import Actor, endpoint
from runtime.controller import Controller
from runtime.failure import Failure
from runtime.spec import ControllerSpec, HeartbeatSpec


class BenchActor(Actor):
    def __init__(self) -> None:
        import torch  # already imported by the agent: this is what makes spawn cheap

        self.t = torch.zeros(1)

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def hold_gil(self, seconds: float) -> None:
        import ctypes

        threading.Thread(target=lambda: ctypes.PyDLL(None).sleep(int(seconds)), daemon=True).start()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _progress(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"[bench runtime] {msg}", file=sys.stderr, flush=True)


def measure(reps: int, heartbeat_timeout_s: float, quiet: bool) -> dict[str, Any]:
    # The agent preloads the actor's module along with torch, as a fork server would.
    spec = ControllerSpec(
        heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=heartbeat_timeout_s),
        preload=("torch", __name__),
    )
    failures: list[tuple[float, Failure]] = []
    seen = threading.Condition()

    def on_failure(f: Failure) -> bool:
        with seen:
            failures.append((time.perf_counter(), f))
            seen.notify_all()
        return True  # absorbed: the bench kills on purpose

    def wait_failure(n: int, timeout: float) -> float | None:
        with seen:
            seen.wait_for(lambda: len(failures) >= n, timeout)
            return failures[n - 1][0] if len(failures) >= n else None

    out: dict[str, Any] = {"workers": 4, "reps": reps, "heartbeat_timeout_s": heartbeat_timeout_s}
    t0 = time.perf_counter()
    with Controller(spec, on_failure=on_failure) as c:
        host = c.spawn_host("bench")
        out["agent_start_s"] = round(time.perf_counter() - t0, 3)
        _progress(quiet, f"agent up in {out['agent_start_s']} s (imports torch once)")

        spawns = []
        for _ in range(reps):
            t = time.perf_counter()
            procs = host.spawn_procs({"ranks": 4})
            actors = procs.spawn("bench", BenchActor)
            actors.noop.call().get(timeout=60)
            spawns.append(time.perf_counter() - t)
            procs.stop(grace_s=0.5)
        out["spawn_mesh_s"] = round(_median(spawns), 4)
        _progress(quiet, f"spawn_mesh_s {out['spawn_mesh_s']}")

        actors = host.spawn_procs({"ranks": 4}).spawn("bench", BenchActor)
        for _ in range(20):
            actors.noop.call().get(timeout=60)
        lat = []
        for _ in range(200 * max(1, reps // 5)):
            t = time.perf_counter()
            actors.noop.call().get(timeout=60)
            lat.append((time.perf_counter() - t) * 1e3)
        out["call_p50_ms"] = round(_median(lat), 3)
        _progress(quiet, f"call_p50_ms {out['call_p50_ms']}")

        kills = []
        for _ in range(reps):
            victim = actors.slice(ranks=0)
            pid = victim.pid.call_one().get(timeout=60)
            n = len(failures) + 1
            t = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            got = wait_failure(n, 10.0)
            if got is not None:
                kills.append((got - t) * 1e3)
            actors.procs.stop(grace_s=0.2)
            actors = host.spawn_procs({"ranks": 4}).spawn("bench", BenchActor)
        out["detect_kill_ms"] = round(_median(kills), 3)
        out["detect_kill_reported"] = f"{len(kills)}/{reps}"
        _progress(quiet, f"detect_kill_ms {out['detect_kill_ms']}")

        hangs = []
        for _ in range(reps):
            victim = actors.slice(ranks=0)
            n = len(failures) + 1
            t = time.perf_counter()
            victim.hold_gil.call_one(60)
            got = wait_failure(n, heartbeat_timeout_s + 10.0)
            if got is not None:
                hangs.append(got - t)
            actors.procs.stop(grace_s=0.2)
            actors = host.spawn_procs({"ranks": 4}).spawn("bench", BenchActor)
        out["detect_hang_s"] = round(_median(hangs), 3)
        out["detect_hang_reported"] = f"{len(hangs)}/{reps}"
        _progress(quiet, f"detect_hang_s {out['detect_hang_s']} (timeout {heartbeat_timeout_s})")
    return out


def main(args: argparse.Namespace) -> int:
    reps = args.reps or (2 if args.quick else 5)
    result = measure(reps, heartbeat_timeout_s=1.0, quiet=args.json)
    if not args.quick:
        _progress(args.json, "measuring Monarch in the same run")
        result["monarch"] = measure_monarch(reps=reps)
    m = result.get("monarch") or {}
    if m.get("spawn_mesh_s") and m.get("call_p50_ms"):
        result["spawn_vs_monarch"] = round(result["spawn_mesh_s"] / m["spawn_mesh_s"], 3)
        result["call_vs_monarch"] = round(result["call_p50_ms"] / m["call_p50_ms"], 3)
    result["targets"] = {
        "detect_kill_ms<=50": result["detect_kill_ms"] <= 50,
        "detect_hang_s<=timeout+0.5": result["detect_hang_s"] <= 1.0 + 0.5,
        **(
            {
                "call<=2x_monarch": result["call_vs_monarch"] <= 2.0,
                "spawn<=monarch/5": result["spawn_vs_monarch"] <= 0.2,
            }
            if "call_vs_monarch" in result
            else {}
        ),
    }
    if not args.json:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    print(json.dumps(result))
    return 0
