"""A stand-in training job for the telemetry tests: a real process that drives a real Journal.

It emits the record sequence a two-replica-group job writes around one injected fault (steps
committing, ``fault.inject``, the failure, the recovery phases, steps resuming), with the
Telemetry sink attached, so Prometheus can scrape it and an OTLP receiver can receive from it.
The runtime's ``ftharness run --prometheus-port`` replaces it once a real job exists: the tests
take the job command from one fixture.

The records come from ``journal_scenario.scenario()`` (tests that only need the records import
that module directly).

Usage: python telemetry_stand_in_job.py --journal J --job NAME [--prometheus-port 0]
       [--otlp-endpoint URL]
       [--address-file F] [--policy in_place|full_restart] [--step-s 0.05] [--steps 40]
       [--hold]   (keep serving metrics after the last record until SIGTERM)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tests/ too
from journal_scenario import scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--job", default="fake")
    parser.add_argument("--policy", default="in_place")
    parser.add_argument("--prometheus-port", type=int, default=None)
    parser.add_argument("--otlp-endpoint", default=None)
    parser.add_argument("--address-file", default=None)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args(argv)

    from dashboards.telemetry import Telemetry
    from runtime.journal import Journal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tel = Telemetry(
        args.job,
        prometheus_port=args.prometheus_port,
        otlp_endpoint=args.otlp_endpoint,
        resource={"ftharness.test": "h3"},
    )
    journal = Journal(args.journal, job=args.job)
    journal.add_sink(tel.sink)
    if args.address_file:
        addr = tel.prometheus_address
        tmp = Path(args.address_file + ".tmp")
        tmp.write_text(f"{addr[0]}:{addr[1]}\n" if addr else "none\n")
        tmp.rename(args.address_file)  # atomic: the test never reads half a line

    records = scenario(job=args.job, policy=args.policy, step_s=args.step_s, steps=args.steps)
    start_sim, start_real = records[0]["t"], time.time()
    for rec in records:
        # replay in real time, stamping the real clock as a live job would
        delay = (rec["t"] - start_sim) - (time.time() - start_real)
        if delay > 0 and stop.wait(delay):
            break
        fields = {k: v for k, v in rec.items() if k not in ("t", "event", "job")}
        journal.emit(rec["event"], **fields)
    if args.hold:
        stop.wait()
    tel.shutdown()
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
