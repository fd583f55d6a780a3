"""``ftharness bench checkpoint``: what a checkpoint costs the training step, three ways, side by
side in one run, on a sharded group (FSDP2 over 2 ranks, gloo on CPU; llama3 debug, or the tiny
model with ``--quick``).

Each of 2 rank processes trains one sharded group (``harness.rank.group_layout.Sharded``) and,
rep after rep, runs one window per way, interleaved (a slow minute of a shared machine hits all
alike): ``warmup`` plain steps, one step that checkpoints, ``after`` plain steps, then waits for
the write to be in place. The ways, through the same code the trainer uses:

* ``torch``: ``checkpoint.snapshot`` (``torch.save`` of this rank's shards into memory) on the
  training thread, the file written by ``checkpoint.BackgroundWriter`` (``checkpoint.format =
  "torch"``);
* ``dcp_sync``: ``harness.rank.dcp_checkpoint.Writer(asynchronous=False)``: DCP's ``save``,
  every rank writing its shards, all on the training thread;
* ``dcp_async``: the same writer asynchronous (``checkpoint.format = "dcp"``): the staging copy
  is taken on a thread while the next forward and backward passes run (the optimizer's step
  waits for it), then DCP's ``async_save`` writes on a thread over a gloo group of its own.

Figures (medians over reps, rank 0's clock; every step ends with the ranks in step, FSDP2's
collectives being a barrier):

* ``step_s``: a plain step's time (median of the window's plain steps);
* ``blocked_s``: the checkpointing step's time minus ``step_s``: what the step waited for;
  ``blocked_ratio`` = ``blocked_s / step_s`` (#48's goal for ``dcp_async``: <= 0.10);
* ``after_s``: the extra time of the ``after`` steps that followed (a background write competes
  with training for the cores: on 2 cores it is not free, on a GPU host it is mostly I/O);
* ``staging_wait_s``: how much of ``after_s`` the steps spent waiting for the staging copy
  (``dcp_async``: the optimizer's step waits for it; the copy overlaps the passes before it);
  ``stall_s`` = ``blocked_s + staging_wait_s``: all the checkpoint held training for, and
  ``stall_ratio`` = ``stall_s / step_s``;
* ``durable_s``: from the checkpoint call to the checkpoint in place;
* ``bytes``: the checkpoint's size on disk.

The last line printed is ``{"model", "ranks", "reps", "ways": {way: {figures}}, "ratios":
{"dcp_async/dcp_sync", "dcp_async/torch"}}`` (ratios of ``blocked_s``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

WAYS = ("torch", "dcp_sync", "dcp_async")
RANKS = 2
TIMEOUT = timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, root: str, model_kind: str, reps: int, out: str) -> None:
    """One rank of the sharded group: train, checkpoint each way each rep, report (rank 0)."""
    import torch
    from torch.distributed import TCPStore

    from harness.config import ModelConfig
    from harness.rank import checkpoint, dcp_checkpoint
    from harness.rank.group_layout import Sharded, init_group_world
    from harness.rank.model import build_model, loss_fn, model_blocks

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, RANKS, rank == 0, timeout=TIMEOUT)
    init_group_world(store, rank, RANKS, TIMEOUT)
    vocab = 2048 if model_kind == "llama3_debug" else 64
    model = build_model(ModelConfig(kind=model_kind), vocab_size=vocab, seed=0)  # type: ignore[arg-type]
    layout = Sharded(model, model_blocks(model), lambda t: None, TIMEOUT)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    seq = 64 if model_kind == "llama3_debug" else 16

    def step() -> None:
        tokens = torch.randint(0, vocab, (4, seq + 1), generator=gen)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        t_wait = time.perf_counter()
        # as the trainer: the staging copy in before the state moves (counted only where one
        # was under way: the other ways stage nothing)
        if [w for w in writers.values() if w.wait_staged()]:
            staging_wait[0] += time.perf_counter() - t_wait
        optim.step()
        optim.zero_grad()

    staging_wait = [0.0]  # seconds step() waited for a staging copy, this window
    torch_writer = checkpoint.BackgroundWriter("bench-ckpt")
    pg = layout.checkpoint_group()
    durable: dict[str, float] = {}

    def when_durable(way: str) -> Any:
        return lambda _step, _path: durable.__setitem__(way, time.perf_counter())

    writers = {
        way: dcp_checkpoint.Writer(
            Path(root, way),
            pg,
            rank=rank,
            keep=1,
            asynchronous=way == "dcp_async",
            on_durable=when_durable(way),
        )
        for way in ("dcp_sync", "dcp_async")
    }

    def save(way: str, n: int) -> None:
        if way == "torch":
            payload = checkpoint.snapshot(layout.state_dict(model, optim))
            folder = Path(root, way, f"rank_{rank}")

            def write() -> None:
                checkpoint.write(folder, n, payload, keep=1)
                durable[way] = time.perf_counter()

            torch_writer.submit(write)
        else:
            state = dcp_checkpoint.app_state(
                model, optim, dataloader={"position": n}, train_state={"step": n}
            )
            writers[way].save(n, state)

    def wait(way: str) -> None:
        torch_writer.wait() if way == "torch" else writers[way].wait()
        layout.group_min(0)  # every rank's write in: a barrier before the next window

    for _ in range(3):  # warm up: allocator, FSDP2's buffers, the optimizer's state
        step()
    warmup, after = 3, 6
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    n = 0
    for _rep in range(reps):
        for way in WAYS:
            times = []
            for i in range(warmup + 1 + after):
                if i == warmup + 1:
                    staging_wait[0] = 0.0
                t0 = time.perf_counter()
                step()
                if i == warmup:
                    n += 1
                    t_save = time.perf_counter()
                    save(way, n)
                times.append(time.perf_counter() - t0)
            wait(way)
            plain = times[:warmup] + times[warmup + 1 :]
            step_s = statistics.median(plain)
            rows[way].append(
                {
                    "step_s": step_s,
                    "blocked_s": times[warmup] - step_s,
                    "after_s": sum(t - step_s for t in times[warmup + 1 :]),
                    "staging_wait_s": staging_wait[0],
                    "durable_s": durable.pop(way, float("nan")) - t_save,  # rank 0 knows
                }
            )
    if rank == 0:
        sizes = {
            way: sum(f.stat().st_size for f in Path(root, way).rglob("*") if f.is_file())
            for way in WAYS
        }
        Path(out).write_text(json.dumps({"rows": rows, "bytes": sizes}))
    torch_writer.close()
    for w in writers.values():
        w.close()


def main(args: Any) -> int:
    """Run the benchmark; ``args`` has ``.json``, ``.reps`` and ``.quick``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    model_kind = "tiny" if args.quick else "llama3_debug"
    reps = args.reps or (2 if args.quick else 5)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    log(f"{model_kind}, {RANKS} FSDP2 shards, {reps} reps of {', '.join(WAYS)} (interleaved)")
    tmp = Path(tempfile.mkdtemp(prefix="ftharness-bench-ckpt-"))
    try:
        port, out = _free_port(), tmp / "result.json"
        cmd = [sys.executable, "-m", "experiments.bench.checkpoint", "--rank"]
        procs = [
            subprocess.Popen(
                [*cmd, str(r), str(port), str(tmp / "ckpt"), model_kind, str(reps), str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(RANKS)
        ]
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            print("\n".join(logs), file=sys.stderr)
            return 1
        raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ways: dict[str, dict[str, float]] = {}
    for way, rows in raw["rows"].items():
        fig = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        fig["blocked_ratio"] = statistics.median(r["blocked_s"] / r["step_s"] for r in rows)
        stalls = [r["blocked_s"] + r["staging_wait_s"] for r in rows]
        fig["stall_s"] = statistics.median(stalls)
        ratios_ = (st / r["step_s"] for st, r in zip(stalls, rows, strict=True))
        fig["stall_ratio"] = statistics.median(ratios_)
        fig["bytes"] = raw["bytes"][way]
        ways[way] = {k: round(v, 4) if isinstance(v, float) else v for k, v in fig.items()}
        log(
            f"{way:>9}: step {fig['step_s'] * 1e3:.1f} ms, blocked {fig['blocked_s'] * 1e3:.1f} ms"
            f" ({fig['blocked_ratio']:.1%} of a step), with the staging wait "
            f"{fig['stall_s'] * 1e3:.1f} ms ({fig['stall_ratio']:.1%}), after "
            f"{fig['after_s'] * 1e3:.1f} ms, "
            f"durable in {fig['durable_s']:.2f} s, {fig['bytes'] / 2**20:.1f} MiB"
        )
    ratios = {
        f"dcp_async/{other}": round(ways["dcp_async"]["blocked_s"] / ways[other]["blocked_s"], 3)
        if ways[other]["blocked_s"] > 0
        else None
        for other in ("dcp_sync", "torch")
    }
    print(
        json.dumps(
            {"model": model_kind, "ranks": RANKS, "reps": reps, "ways": ways, "ratios": ratios}
        )
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        r, p, root, kind, reps, out = sys.argv[2:8]
        _rank_main(int(r), int(p), root, kind, int(reps), out)
    else:
        raise SystemExit("run it as: ftharness bench checkpoint [--quick] [--reps N] [--json]")
