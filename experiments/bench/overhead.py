"""``ftharness bench overhead``: what resilience costs when nothing fails, side by side.

The same model, data, seed, optimizer, threads per worker and number of steps, fault-free, 3
replica groups x 1 rank (3 x 2 for the sharded pair), in the configurations below, run interleaved
(each repetition runs all of them, in a rotated order) so every configuration sees the same machine:

* ``plain``               — the same loop (batch, forward/backward, one flat gradient allreduce,
  AdamW) over plain ``torch.distributed`` gloo across the groups; no fault tolerance (the floor);
* ``torchft``             — torchft's Manager + Lighthouse driven as torchft's examples drive
  them: the Lighthouse in its own process, ``OptimizerWrapper`` (``zero_grad`` starts the quorum,
  ``step`` asks ``should_commit``), the default asynchronous quorum, the default HTTP transport;
* ``ftharness``           — ``harness.job.launch.run_job`` on the job's default config (supervision
  tree, its quorum service, a sparse quorum, heartbeats, checkpoints), telemetry off;
* ``ftharness_every_step`` — the same with a quorum every step (``recovery.quorum_every_steps=1``);
* ``ftharness_telemetry`` — the same with OpenTelemetry (OTLP/HTTP to a stand-in collector in its
  own process) and the Prometheus endpoint on, scraped every 2 s by that process;
* ``ftharness_lighthouse`` — the default config with ``recovery.quorum = "torchft"``: torchft's
  Lighthouse (Rust, in a supervised worker process) serves the quorum instead of the tree quorum
  (Python gRPC, in the controller). The price of the tree's faster failover, side by side;
* ``ftharness_tokens``    — the default config training on real text (``data.kind = "tokens"``,
  the default corpus, ``harness.rank.token_data``), and its peer ``ftharness_vocab2048``: the
  synthetic stream at the same vocabulary (the tokenizer's 2048), so that
  ``ratio_to_synthetic`` (tokens over vocab2048, per repetition, median) is what reading the
  token file costs, not the larger output layer;
* ``ftharness_fsdp`` and ``plain_hsdp`` — sharded groups, 3 x 2 ranks: the job with
  ``parallel.group = "fsdp"`` (FSDP2 in each group, torchft across), and the same FSDP2 layout
  (``harness.rank.group_layout.Sharded``) in plain torch, the gradient shards averaged across the
  groups over a plain gloo group per rank index, no quorum and no fault tolerance (its floor);
  ``ratio_to_plain_hsdp`` compares them per repetition (median), as ``ratio_to_plain`` does.

Figures per configuration (all over the steady-state window: steps ``warmup`` .. end):

* ``step_ms``: median and p95 of the time between a group's consecutive committed steps (its
  whole cycle: quorum, batch, forward/backward, allreduce, commit, and whatever the harness does
  around them: journal record, checksum, checkpoint), pooled over the groups and repetitions;
* ``tokens_per_s``: tokens committed by all groups over the window's wall time;
* ``ratio_to_plain``: median over repetitions of (median step / plain's median step in the same
  repetition); ``ratio_per_rep`` lists them (the spread is the noise on this machine);
* ``cpu``: fraction of one core over the window: ``controller`` (ftharness: the controller,
  i.e. this process, less the sampler's own thread, plus the Lighthouse's process where it
  serves the quorum; torchft: the Lighthouse process; plain:
  none, 0) and ``agent_max`` (the busiest host agent; 0 where there are none);
  ``worker_mean`` too (mean over the trainer processes);
* ``cpu_ms_per_step``: CPU time of all the job's processes (controller or Lighthouse, agents,
  trainers) per committed step, over the window: the work each configuration does, far less
  sensitive than wall time to other tenants of the machine;
  ``cpu_ratio_to_plain``: its median over repetitions of the ratio to plain's in the same one;
* ``ratio_to_torchft``: the same against ``torchft`` (what ftharness adds to the torchft it
  drives); ``controller_ms_per_step``: the controller's CPU per step (a quorum round of all the
  groups): it scales with the step rate, so a step of ``controller_ms_per_step / 0.02`` ms or
  longer keeps the controller under 2% of a core;
* ``rss_mb``: peak RSS (``VmHWM``) of the largest trainer process;
* ``processes``: the processes the job runs, the launching/controller process included.

The last line printed is a JSON object (``rows`` as the issue asks, plus ``meta``).

Why this module is longer than 500 lines: its configurations run interleaved in one bench so that
their ratios come from one machine state; each configuration's loop is short, and they share the
interleaving, the measurement and the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.bench.models import MODELS

#: The ftharness configurations that differ from the default, as config overrides.
VARIANTS = {
    "ftharness_lighthouse": ["recovery.quorum=torchft"],
    "ftharness_every_step": ["recovery.quorum_every_steps=1"],
    "ftharness_vocab2048": ["data.vocab_size=2048"],
    "ftharness_tokens": ["data.kind=tokens"],
    "ftharness_fsdp": ["ranks=2", "parallel.group=fsdp"],
}
#: Every configuration's overrides: the variants, and the plain sharded loop's shape (the same
#: as ``ftharness_fsdp``'s, which it is the floor of).
OVERRIDES = VARIANTS | {"plain_hsdp": VARIANTS["ftharness_fsdp"]}
CONFIGS = ["plain", "torchft", "ftharness", "ftharness_telemetry", *VARIANTS, "plain_hsdp"]
#: (steps per run, steady-state window starts after this many commits, repetitions)
PLAN = {"tiny": (200, 40, 3), "llama3_debug": (36, 8, 2)}
QUICK_PLAN = {"tiny": (150, 30, 2)}
REPO = Path(__file__).resolve().parents[2]


# --- the plain and torchft trainers (one process per replica group) ---------------------------


def worker(
    mode: str, cfg_dict: dict[str, Any], replica: int, addr: str, out: str, rank: int = 0
) -> None:
    """One replica group's trainer for ``plain`` or ``torchft``, or rank ``rank`` of one for
    ``plain_hsdp``: train ``cfg.steps`` steps and write the wall-clock time of every committed
    step to ``out`` (JSON)."""
    from datetime import timedelta

    import torch

    from harness.config import config_from_dict
    from harness.rank.data import TokenStream
    from harness.rank.model import build_model, build_optimizer, loss_fn
    from harness.rank.trainer import threads_per_worker

    cfg = config_from_dict(cfg_dict)
    torch.set_num_threads(threads_per_worker(cfg))
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.data.seed)
    opt = build_optimizer(model, cfg.optim)
    data = TokenStream(cfg.data, shard=replica, num_shards=cfg.replicas)
    timeout = timedelta(seconds=cfg.timeouts.process_group_timeout)
    params = list(model.parameters())

    def flat_grads() -> tuple[list[torch.Tensor], torch.Tensor]:
        grads = [p.grad for p in params if p.grad is not None]
        return grads, torch.cat([g.reshape(-1) for g in grads])

    def unflatten(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    times: list[float] = []
    if mode == "plain_hsdp":
        _plain_hsdp(cfg, replica, rank, addr, times)
    elif mode == "plain":
        from torch.distributed import PrefixStore, TCPStore

        host, port = addr.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        pg = torch.distributed.ProcessGroupGloo(
            PrefixStore("plain", store), replica, cfg.replicas, timeout
        )
        for _ in range(cfg.steps):
            inputs, targets = data.batch()
            opt.zero_grad(set_to_none=False)
            loss_fn(model(inputs), targets).backward()
            grads, flat = flat_grads()
            pg.allreduce([flat]).wait()
            flat /= cfg.replicas
            unflatten(grads, flat)
            opt.step()
            data.advance()
            times.append(time.time())
    else:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.optim import OptimizerWrapper

        def load(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=1,
            load_state_dict=load,
            state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
            replica_id=f"replica_{replica}",
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=addr,
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=cfg.timeouts.manager_timeout),
        )
        optimizer = OptimizerWrapper(manager, opt)
        while manager.current_step() < cfg.steps:
            inputs, targets = data.batch()
            optimizer.zero_grad(set_to_none=False)  # starts the (async) quorum
            loss_fn(model(inputs), targets).backward()
            grads, flat = flat_grads()
            manager.allreduce(flat).wait()
            unflatten(grads, flat)
            before = manager.current_step()
            optimizer.step()  # should_commit, then the optimizer step if every rank agreed
            if manager.current_step() > before:
                data.advance()
                times.append(time.time())
        manager.shutdown(wait=False)
    Path(out).write_text(json.dumps({"replica": replica, "times": times}))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown once the peers have gone (it can abort)


def _plain_hsdp(cfg: Any, replica: int, rank: int, addr: str, times: list[float]) -> None:
    """HSDP in plain torch: the group's own gloo world (FSDP2 over its ranks, the same layout
    as ``parallel.group = "fsdp"``: ``harness.rank.group_layout.Sharded``), and a plain gloo
    group of rank ``rank`` of every group averaging the gradient shards across the groups after
    the backward pass; no quorum, no commit protocol, no fault tolerance."""
    from datetime import timedelta

    import torch
    from torch.distributed import PrefixStore, TCPStore

    from harness.rank.data import TokenStream
    from harness.rank.group_layout import Asks, Sharded, init_group_world
    from harness.rank.model import build_model, build_optimizer, loss_fn, model_blocks

    timeout = timedelta(seconds=cfg.timeouts.process_group_timeout)
    host, port = addr.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    init_group_world(PrefixStore(f"group{replica}", store), rank, cfg.ranks, timeout)
    cross = torch.distributed.ProcessGroupGloo(
        PrefixStore(f"across{rank}", store), replica, cfg.replicas, timeout
    )

    def across(t: torch.Tensor) -> None:
        cross.allreduce([t]).wait()  # type: ignore[attr-defined]
        t /= cfg.replicas

    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.data.seed)
    layout = Sharded(model, model_blocks(model), across)
    opt = build_optimizer(model, cfg.optim)
    n = cfg.replicas * cfg.ranks
    data = TokenStream(
        cfg.data, shard=replica * cfg.ranks + rank, num_shards=n, group_size=cfg.ranks
    )
    for _ in range(cfg.steps):
        inputs, targets = data.batch()
        opt.zero_grad(set_to_none=False)
        layout.backward(loss_fn(model(inputs), targets), Asks())  # reduce-scatter in the group
        layout.average(model, contribute=True)  # then across the groups
        opt.step()
        data.advance()
        times.append(time.time())


def _spawn(code: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )


def _lighthouse_code(min_replicas: int, join_ms: int) -> str:
    # torchft's examples run the Lighthouse as its own process (torchft_lighthouse).
    return (
        "import sys, time\n"
        "from torchft._torchft import LighthouseServer\n"
        f"s = LighthouseServer(bind='127.0.0.1:0', min_replicas={min_replicas}, "
        f"join_timeout_ms={join_ms})\n"
        "print(s.address().rsplit(':', 1)[1], flush=True)\n"
        "time.sleep(1e6)\n"
    )


def _collector_code() -> str:
    """A stand-in OTLP/HTTP collector (answers 200) that also scrapes Prometheus every 2 s."""
    return (
        "import sys, threading, time, urllib.request\n"
        "from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_POST(self):\n"
        "        self.rfile.read(int(self.headers.get('Content-Length', 0)))\n"
        "        self.send_response(200); self.send_header('Content-Length', '0')\n"
        "        self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "s = ThreadingHTTPServer(('127.0.0.1', 0), H)\n"
        "print(s.server_address[1], flush=True)\n"
        "threading.Thread(target=s.serve_forever, daemon=True).start()\n"
        "url = None\n"
        "for line in sys.stdin:\n"
        "    url = line.strip(); break\n"
        "while True:\n"
        "    time.sleep(2)\n"
        "    try: urllib.request.urlopen(url, timeout=5).read()\n"
        "    except Exception: pass\n"
    )


# --- resource sampling ---------------------------------------------------------------------


class Sampler:
    """Samples, every ``period`` s, the CPU seconds and peak RSS of this process and all its
    descendants. Its own thread's CPU is counted separately (``self_cpu``) so it can be taken
    off this process's figure."""

    def __init__(self, period: float = 0.5) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.samples: list[tuple[float, float, dict[int, dict[str, Any]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.period = period

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> None:
        procs: dict[int, dict[str, Any]] = {}
        for p in [self.me, *self.me.children(recursive=True)]:
            with contextlib.suppress(self._psutil.Error), p.oneshot():
                ct = p.cpu_times()
                procs[p.pid] = {
                    "cpu": ct.user + ct.system,
                    "ppid": p.ppid(),
                    "hwm_mb": _hwm_mb(p.pid),
                    "cmd": " ".join(p.cmdline()[:3])[:120],
                }
        self.samples.append((time.time(), time.thread_time(), procs))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """CPU fraction of a core per pid between the samples nearest inside [t0, t1]."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            inside = self.samples[-2:]
        (a_t, a_self, a), (b_t, b_self, b) = inside[0], inside[-1]
        dt = max(1e-9, b_t - a_t)
        out = {}
        for pid, rec in b.items():
            if pid in a:
                cpu = rec["cpu"] - a[pid]["cpu"]
                if pid == self.me.pid:
                    cpu -= b_self - a_self  # the sampler's own work
                out[pid] = {**rec, "frac": max(0.0, cpu) / dt}
        return {"procs": out, "seconds": dt}


def _hwm_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# --- one run of one configuration ----------------------------------------------------------


def _job_config(model: str, steps: int, seed: int, variant: tuple[str, ...] = ()) -> Any:
    from harness.config import load_config

    overrides = [
        "replicas=3",
        "ranks=1",
        "hosts=1",
        f"steps={steps}",
        f"data.seed={seed}",
        *MODELS[model],
        *variant,
    ]
    return load_config(str(REPO / "experiments" / "tiny.toml"), overrides)


def _run_subprocess_config(
    mode: str, cfg: Any, workdir: Path, sampler_period: float
) -> tuple[list[list[float]], Sampler, int, set[int]]:
    from harness.config import config_to_dict

    workdir.mkdir(parents=True, exist_ok=True)
    cfg_dict = config_to_dict(cfg)
    extra: list[subprocess.Popen[bytes]] = []
    store = None
    with Sampler(sampler_period) as sampler:
        if mode in ("plain", "plain_hsdp"):
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr = f"127.0.0.1:{store.port}"
        else:
            join_ms = int(cfg.timeouts.lighthouse_join_timeout * 1000)
            with open(workdir / "lighthouse.log", "ab") as err:
                lh = subprocess.Popen(
                    [sys.executable, "-c", _lighthouse_code(1, join_ms)],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    cwd=REPO,
                )
            extra.append(lh)
            port = lh.stdout.readline().decode().strip()  # type: ignore[union-attr]
            addr = f"http://127.0.0.1:{port}"
        procs = []
        ranks = cfg.ranks if mode == "plain_hsdp" else 1
        for r, rank in itertools.product(range(cfg.replicas), range(ranks)):
            out = workdir / (f"times_{r}.json" if rank == 0 else f"times_{r}_{rank}.json")
            args = (mode, cfg_dict, r, addr, str(out), rank)
            code = (
                "import json\nfrom experiments.bench.overhead import worker\n"
                f"worker(*json.loads({json.dumps(json.dumps(list(args)))}))\n"
            )
            procs.append(_spawn(code, workdir / f"worker_{r}_{rank}.log"))
        nprocs = 1 + len(procs) + len(extra)
        try:
            for p in procs:
                p.wait(timeout=1200)
        finally:
            for p in procs + extra:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    times = []
    for r in range(cfg.replicas):
        f = workdir / f"times_{r}.json"
        if not f.exists():
            raise RuntimeError(f"{mode}: replica {r} wrote no times; see {workdir}/worker_{r}.log")
        times.append(json.loads(f.read_text())["times"])
    return times, sampler, nprocs, {p.pid for p in extra}


def _run_ftharness(
    cfg: Any, workdir: Path, telemetry: bool, sampler_period: float
) -> tuple[list[list[float]], Sampler, int, set[int], set[int]]:
    from harness.job.launch import attach_telemetry, run_job
    from runtime.journal import PROC_START, STEP_COMMIT, Journal, read_journal

    collector = None
    run_dir = workdir / "run"
    nprocs = [0]
    if telemetry:
        collector = subprocess.Popen(
            [sys.executable, "-c", _collector_code()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        port = collector.stdout.readline().decode().strip()  # type: ignore[union-attr]
        import dataclasses

        cfg = dataclasses.replace(
            cfg,
            telemetry=dataclasses.replace(
                cfg.telemetry, prometheus_port=0, otlp_endpoint=f"http://127.0.0.1:{port}"
            ),
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(run_dir / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    tel = attach_telemetry(cfg, journal, quiet=True)
    if tel is not None and collector is not None:
        host, pport = tel.prometheus_address
        collector.stdin.write(f"http://{host}:{pport}/metrics\n".encode())  # type: ignore[union-attr]
        collector.stdin.flush()  # type: ignore[union-attr]

    def started(job: Any) -> None:
        import psutil

        me = psutil.Process()
        mine = {p.pid for p in me.children(recursive=True)}
        if collector is not None:
            mine.discard(collector.pid)
        nprocs[0] = 1 + len(mine)

    try:
        with Sampler(sampler_period) as sampler:
            outcome = run_job(cfg, run_dir, journal=journal, quiet=True, on_started=started)
    finally:
        if tel is not None:
            tel.shutdown()
        journal.close()
        if collector is not None:
            collector.kill()
            collector.wait()
    if outcome.get("status") != "ok":
        raise RuntimeError(f"ftharness job failed: {outcome}")
    records = read_journal(run_dir / "journal.jsonl")
    times: list[list[float]] = [[] for _ in range(cfg.replicas)]
    for r in records:
        if r["event"] == STEP_COMMIT and r.get("rank", 0) == 0:
            times[r["replica"]].append(r["t"])
    # the quorum service's process (torchft's Lighthouse in a worker): the controller's part
    service = {r["pid"] for r in records if r["event"] == PROC_START and "service" in r}
    aside = {collector.pid} if collector is not None else set()
    return times, sampler, nprocs[0], aside, service


def _roles(
    mode: str,
    procs: dict[int, dict[str, Any]],
    me: int,
    aside: set[int],
    service: frozenset[int] = frozenset(),
) -> dict[str, list[dict]]:
    """Sort the sampled processes into controller / agents / workers per configuration.
    ``aside``: the Lighthouse (torchft) or the stand-in collector (ftharness_telemetry).
    ``service``: an ftharness job's quorum service process (its Lighthouse), counted with the
    controller as torchft's Lighthouse is."""
    roles: dict[str, list[dict]] = {"controller": [], "agents": [], "workers": [], "other": []}
    for pid, rec in procs.items():
        if mode.startswith("ftharness"):
            if pid == me or pid in service:
                roles["controller"].append(rec)
            elif rec["ppid"] == me:
                # host agents are the controller's children (the collector is not the job's)
                (roles["other"] if pid in aside else roles["agents"]).append(rec)
            else:
                roles["workers"].append(rec)
        else:
            if pid == me:
                continue
            if pid in aside:
                roles["controller"].append(rec)
            else:
                roles["workers"].append(rec)
    return roles


def run_one(model: str, mode: str, rep: int, workdir: Path, steps: int, warmup: int) -> dict:
    cfg = _job_config(model, steps, seed=7, variant=tuple(OVERRIDES.get(mode, ())))
    d = workdir / f"{model}_{mode}_{rep}"
    service: set[int] = set()
    if mode in ("plain", "torchft", "plain_hsdp"):
        times, sampler, nprocs, aside = _run_subprocess_config(mode, cfg, d, 0.25)
    else:
        telemetry = mode == "ftharness_telemetry"
        times, sampler, nprocs, aside, service = _run_ftharness(cfg, d, telemetry, 0.25)
    gaps: list[float] = []
    for ts in times:
        ts = ts[warmup:]
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    if not gaps:
        raise RuntimeError(f"{model}/{mode}: no steady-state steps")
    t0 = max(ts[warmup] for ts in times if len(ts) > warmup)
    t1 = min(ts[-1] for ts in times if ts)
    n_commits = sum(len([t for t in ts if t0 <= t <= t1]) for ts in times)
    tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.ranks
    win = sampler.window(t0, t1)
    roles = _roles(mode, win["procs"], sampler.me.pid, aside, frozenset(service))
    # peak RSS over the whole run (the last sample holds the highest VmHWM seen)
    hwm = max((r["hwm_mb"] for r in roles["workers"]), default=0.0)
    workers = roles["workers"]
    job = roles["controller"] + roles["agents"] + workers
    steps_in_window = n_commits / cfg.replicas
    ctl_cpu = sum(r["frac"] for r in roles["controller"])
    return {
        # CPU time of every process of the job per committed step: the work the machinery
        # adds, much less sensitive than wall time to what else runs on the machine
        "cpu_ms_per_step": sum(r["frac"] for r in job) * win["seconds"] / steps_in_window * 1e3
        if steps_in_window
        else 0.0,
        "gaps": gaps,
        "tokens_per_s": n_commits * tokens / max(1e-9, t1 - t0),
        "cpu_controller": ctl_cpu,
        # the controller's CPU per step (one quorum round of all groups): its cost scales with
        # the step rate, so this says at which step time it stays under a given share of a core
        "controller_ms_per_step": ctl_cpu * win["seconds"] / max(steps_in_window, 1e-9) * 1e3,
        "cpu_agent_max": max((r["frac"] for r in roles["agents"]), default=0.0),
        "cpu_worker_mean": statistics.fmean(r["frac"] for r in workers) if workers else 0.0,
        "rss_mb": hwm,
        "processes": nprocs,
        "window_s": win["seconds"],
    }


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per configuration over its repetitions (run i of every configuration = one rep)."""
    plain_med = [statistics.median(r["gaps"]) for r in runs["plain"]]
    torchft_med = [statistics.median(r["gaps"]) for r in runs.get("torchft", [])]
    rows: dict[str, Any] = {}
    for mode, reps in runs.items():
        gaps = [g for r in reps for g in r["gaps"]]
        ratios = [
            statistics.median(r["gaps"]) / p for r, p in zip(reps, plain_med, strict=False) if p
        ]
        # what ftharness adds on top of the torchft it drives, in the same repetition
        to_torchft = [
            statistics.median(r["gaps"]) / p for r, p in zip(reps, torchft_med, strict=False) if p
        ]
        cpu_ratios = [
            r["cpu_ms_per_step"] / p["cpu_ms_per_step"]
            for r, p in zip(reps, runs["plain"], strict=False)
            if p["cpu_ms_per_step"]
        ]
        rows[mode] = {
            "step_ms": {
                "median": round(statistics.median(gaps) * 1e3, 2),
                "p95": round(_p(gaps, 0.95) * 1e3, 2),
            },
            "step_ms_median_per_rep": [round(statistics.median(r["gaps"]) * 1e3, 2) for r in reps],
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in reps), 1),
            "cpu_ms_per_step": round(statistics.median(r["cpu_ms_per_step"] for r in reps), 2),
            "cpu_ms_per_step_per_rep": [round(r["cpu_ms_per_step"], 2) for r in reps],
            "cpu_ratio_to_plain": round(statistics.median(cpu_ratios), 3) if cpu_ratios else None,
            "ratio_to_plain": round(statistics.median(ratios), 3) if ratios else None,
            "ratio_per_rep": [round(x, 3) for x in ratios],
            "ratio_to_torchft": round(statistics.median(to_torchft), 3) if to_torchft else None,
            "controller_ms_per_step": round(
                statistics.median(r.get("controller_ms_per_step", 0.0) for r in reps), 3
            ),
            "cpu": {
                "controller": round(statistics.median(r["cpu_controller"] for r in reps), 4),
                "agent_max": round(statistics.median(r["cpu_agent_max"] for r in reps), 4),
                "worker_mean": round(statistics.median(r["cpu_worker_mean"] for r in reps), 3),
            },
            "rss_mb": round(max(r["rss_mb"] for r in reps), 1),
            "processes": max(r["processes"] for r in reps),
        }
    if runs.get("ftharness_tokens") and runs.get("ftharness_vocab2048"):
        pairs = zip(runs["ftharness_tokens"], runs["ftharness_vocab2048"], strict=False)
        to_synthetic = [
            statistics.median(t["gaps"]) / statistics.median(v["gaps"]) for t, v in pairs
        ]
        rows["ftharness_tokens"]["ratio_to_synthetic"] = round(statistics.median(to_synthetic), 3)
    if runs.get("ftharness_fsdp") and runs.get("plain_hsdp"):
        # what ftharness adds to a sharded group, against the same HSDP loop in plain torch
        pairs = zip(runs["ftharness_fsdp"], runs["plain_hsdp"], strict=False)
        to_hsdp = [statistics.median(f["gaps"]) / statistics.median(p["gaps"]) for f, p in pairs]
        rows["ftharness_fsdp"]["ratio_to_plain_hsdp"] = round(statistics.median(to_hsdp), 3)
    return rows


def time_lost(*, overhead: float, per_failure_s: float, mtbf_min: float) -> float:
    """Fraction of wall time lost to fault tolerance by a job that fails every ``mtbf_min``
    minutes: the fault-free overhead (``overhead``: step time / plain step time - 1) plus what
    each failure costs, spread over the interval between failures. A first-order model: it
    ignores failures during a recovery and treats the overhead as spent on every step."""
    return overhead + per_failure_s / (60.0 * mtbf_min)


def break_even(
    *,
    groups: int,
    in_place_overhead: float,
    stall_s: float,
    back_s: float,
    restart_overhead: float,
    restart_s: float,
    steps_lost: float,
    step_s: float,
    mtbf_min: list[float],
) -> dict[str, Any]:
    """In place vs checkpoint-and-restart for a job of ``groups`` replica groups.

    Per failure, in place: every group stalls ``stall_s``, and the failed group is out for
    ``back_s``, i.e. ``1/groups`` of the job for that long: ``stall_s + back_s / groups`` of
    job time. Checkpoint-and-restart: the whole job is down ``restart_s`` and re-trains
    ``steps_lost`` steps: ``restart_s + steps_lost * step_s``. Fault-free, in place costs
    ``in_place_overhead`` and restart ``restart_overhead`` (its checkpoints) of every step.
    ``restart_wins_below_per_hour``: the failure rate below which plain restart loses less time
    (None: in place wins at every rate, its fault-free overhead being no larger)."""
    ip_fail = stall_s + back_s / groups
    rs_fail = restart_s + steps_lost * step_s
    rows = [
        {
            "mtbf_min": m,
            "in_place": round(
                time_lost(overhead=in_place_overhead, per_failure_s=ip_fail, mtbf_min=m), 4
            ),
            "restart": round(
                time_lost(overhead=restart_overhead, per_failure_s=rs_fail, mtbf_min=m), 4
            ),
        }
        for m in mtbf_min
    ]
    extra = in_place_overhead - restart_overhead
    m_star = (rs_fail - ip_fail) / (60.0 * extra) if extra > 0 else None
    return {
        "groups": groups,
        "per_failure_s": {"in_place": round(ip_fail, 3), "restart": round(rs_fail, 3)},
        "rows": rows,
        "break_even_mtbf_min": round(m_star, 1) if m_star is not None else None,
        "restart_wins_below_per_hour": round(60.0 / m_star, 3) if m_star else None,
    }


def chosen(only: str | None) -> list[str]:
    """The configurations ``--only`` names, with the floors their ratios need, in
    :data:`CONFIGS` order; every configuration when ``only`` is empty."""
    if not only:
        return list(CONFIGS)
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(names - set(CONFIGS))
    if unknown:
        print(f"bench overhead --only: unknown {unknown}; choose from {CONFIGS}", file=sys.stderr)
        raise SystemExit(2)
    names.add("plain")
    if "ftharness_fsdp" in names:
        names.add("plain_hsdp")
    return [c for c in CONFIGS if c in names]


def main(args: argparse.Namespace) -> int:
    plan = dict(QUICK_PLAN if args.quick else PLAN)
    configs = chosen(getattr(args, "only", None))

    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench overhead] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"rows": {}, "meta": {"replicas": 3, "ranks": 1, "plan": {}}}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="ftharness-bench-overhead-") as tmp:
        for model, (steps, warmup, reps) in plan.items():
            reps = args.reps or reps
            result["meta"]["plan"][model] = {"steps": steps, "warmup": warmup, "reps": reps}
            runs: dict[str, list[dict]] = {m: [] for m in configs}
            for rep in range(reps):
                order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
                for mode in order:
                    t = time.monotonic()
                    row = run_one(model, mode, rep, Path(tmp), steps, warmup)
                    runs[mode].append(row)
                    log(
                        f"{model} rep {rep + 1}/{reps} {mode}: step median "
                        f"{statistics.median(row['gaps']) * 1e3:.1f} ms, controller cpu "
                        f"{row['cpu_controller']:.3f}, agent {row['cpu_agent_max']:.3f}, "
                        f"rss {row['rss_mb']:.0f} MB, {row['processes']} procs "
                        f"({time.monotonic() - t:.0f} s)"
                    )
            result["rows"][model] = summarize(runs)
    result["meta"]["loadavg_before"] = load_before
    result["meta"]["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(result))
    return 0
