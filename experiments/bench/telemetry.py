"""``ftharness bench telemetry``: what the telemetry sink costs a training step.

Trains the tiny model (the default ``ModelConfig``/``DataConfig`` shapes) and, after every step,
emits a ``step.commit`` into a Journal, as the train loop does. Two journals run side by side in
one process: one bare, one with a :class:`dashboards.telemetry.Telemetry` sink attached whose
Prometheus endpoint is live and scraped once a second (so collection runs too). Each repetition
runs ``steps`` steps on each, alternating step by step; ``telemetry_overhead`` is the median over
repetitions of (median over adjacent pairs of ``with - without``) / median step without. On a
shared 2-core machine that difference is mostly noise around zero, so the sink's own cost is
also timed directly (``sink_us_per_step``, over many records) and given as a fraction of the
step (``sink_fraction``), a tighter bound.

The last line printed is a JSON object.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from argparse import Namespace
from pathlib import Path
from typing import Any

from runtime.journal import STEP_COMMIT

DEFAULT_REPS = 9
DEFAULT_STEPS = 30


def _train_setup():
    import torch

    from harness.config import DataConfig, ModelConfig
    from harness.rank.model import build_model, loss_fn

    torch.set_num_threads(1)  # fewer threads, less noise from the other tenants of the machine
    mcfg, dcfg = ModelConfig(), DataConfig()
    model = build_model(mcfg, vocab_size=dcfg.vocab_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, dcfg.vocab_size, (dcfg.batch_size, dcfg.seq_len + 1), generator=gen)

    def step() -> float:
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits, tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    desc = f"tiny dim={mcfg.dim} layers={mcfg.layers} batch={dcfg.batch_size}x{dcfg.seq_len}"
    return step, dcfg.batch_size, dcfg.seq_len, desc


def _commit_fields(step: int, loss: float, step_time: float, batch: int, seq: int) -> dict:
    return {
        "replica": 0,
        "rank": 0,
        "host": "localhost",
        "step": step,
        "loss": loss,
        "checksum": "0",
        "step_time_s": step_time,
        "samples": batch,
        "tokens": batch * seq,
        "participants": 2,
        "data_pos": step * batch,
        "policy": "in_place",
    }


def _timed_step(train_step, journal, step: int, batch: int, seq: int) -> float:
    """Seconds for one train step plus its journal emit (and the journal's sinks)."""
    t0 = time.perf_counter()
    loss = train_step()
    t1 = time.perf_counter()
    journal.emit(STEP_COMMIT, **_commit_fields(step, loss, t1 - t0, batch, seq))
    return time.perf_counter() - t0


def _paired(train_step, bare, with_tel, first: int, steps: int, batch: int, seq: int):
    """Per-step times of both journals, alternating step by step (ABBA...) so both see the
    same contention from the machine's other tenants; medians are robust to the spikes."""
    a, b = [], []
    for i in range(steps):
        if i % 2 == 0:
            a.append(_timed_step(train_step, bare, first + i, batch, seq))
            b.append(_timed_step(train_step, with_tel, first + i, batch, seq))
        else:
            b.append(_timed_step(train_step, with_tel, first + i, batch, seq))
            a.append(_timed_step(train_step, bare, first + i, batch, seq))
    diffs = [y - x for x, y in zip(a, b, strict=True)]  # adjacent pairs share the load
    return statistics.median(a), statistics.median(b), statistics.median(diffs)


def _scraper(url: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        with contextlib.suppress(OSError):  # a missed scrape only makes the bench milder
            urllib.request.urlopen(url, timeout=5).read()


def _sink_cost_us(n: int = 5000) -> float:
    """Microseconds per ``step.commit`` record spent in ``Telemetry.sink`` alone."""
    from dashboards.telemetry import Telemetry

    tel = Telemetry("bench-sink", prometheus_port=0)
    try:
        recs = [
            {
                "t": 1e9 + i,
                "event": STEP_COMMIT,
                "job": "bench",
                **_commit_fields(i, 1.0, 0.01, 8, 32),
            }
            for i in range(n)
        ]
        for r in recs[:200]:
            tel.sink(r)
        start = time.perf_counter()
        for r in recs:
            tel.sink(r)
        return (time.perf_counter() - start) / n * 1e6
    finally:
        tel.shutdown()


def measure(*, reps: int, steps: int) -> dict[str, Any]:
    """Run the side-by-side measurement and return the result object."""
    from dashboards.telemetry import Telemetry
    from runtime.journal import Journal

    train_step, batch, seq, desc = _train_setup()
    with tempfile.TemporaryDirectory(prefix="ftharness-bench-tel-") as tmp:
        bare = Journal(Path(tmp) / "bare.jsonl", job="bench")
        with_tel = Journal(Path(tmp) / "tel.jsonl", job="bench")
        tel = Telemetry("bench", prometheus_port=0)
        with_tel.add_sink(tel.sink)
        host, port = tel.prometheus_address  # type: ignore[misc]
        stop = threading.Event()
        scraper = threading.Thread(
            target=_scraper, args=(f"http://{host}:{port}/metrics", stop), daemon=True
        )
        scraper.start()
        try:
            _paired(train_step, bare, with_tel, 0, max(4, steps // 3), batch, seq)  # warm up
            ratios, without, with_ = [], [], []
            for rep in range(reps):
                a, b, d = _paired(train_step, bare, with_tel, rep * steps, steps, batch, seq)
                without.append(a)
                with_.append(b)
                ratios.append(d / a)
        finally:
            stop.set()
            scraper.join(timeout=5)
            tel.shutdown()
            bare.close()
            with_tel.close()
    sink_us = _sink_cost_us()
    step_s = statistics.median(without)
    return {
        "bench": "telemetry",
        "telemetry_overhead": statistics.median(ratios),
        "telemetry_overhead_reps": [round(r, 5) for r in ratios],
        "step_s_without": step_s,
        "step_s_with": statistics.median(with_),
        "sink_us_per_step": sink_us,
        "sink_fraction": sink_us * 1e-6 / step_s,
        "reps": reps,
        "steps_per_rep": steps,
        "model": desc,
        "exporters": "prometheus (scraped every 1 s)",
    }


def main(args: Namespace) -> int:
    """Entry point for ``ftharness bench telemetry [--json] [--reps N] [--quick]``."""
    quick = bool(getattr(args, "quick", False))
    reps = args.reps or (3 if quick else DEFAULT_REPS)
    steps = 10 if quick else DEFAULT_STEPS
    result = measure(reps=reps, steps=steps)
    if not getattr(args, "json", False):
        print(f"model: {result['model']}, {reps} reps x {steps} steps, side by side")
        print(
            f"step without telemetry: {result['step_s_without'] * 1e3:.2f} ms, "
            f"with: {result['step_s_with'] * 1e3:.2f} ms"
        )
        print(f"telemetry_overhead (median of reps): {result['telemetry_overhead']:+.3%}")
        print(
            f"sink alone: {result['sink_us_per_step']:.1f} us per step.commit "
            f"= {result['sink_fraction']:.3%} of a step"
        )
    print(json.dumps(result))
    return 0
