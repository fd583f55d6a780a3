"""The pure parts of ``ftharness bench multihost``."""

from __future__ import annotations

from experiments.bench.multihost import measure_calls, stale_commits


def test_stale_commits_counts_only_commits_of_a_failed_process_after_its_failure() -> None:
    records = [
        {"event": "proc.start", "t": 0.0, "proc": "host1/p0", "replica": 1},
        {"event": "step.commit", "t": 1.0, "proc": "host1/p0", "replica": 1},  # before: fine
        {"event": "failure", "t": 2.5, "t_detected": 2.0, "proc": "host1/p0", "replica": 1},
        {"event": "proc.start", "t": 2.2, "proc": "host0/p5", "replica": 1},
        {"event": "step.commit", "t": 3.0, "proc": "host0/p5", "replica": 1},  # successor: fine
        {"event": "step.commit", "t": 3.1, "proc": "host1/p0", "replica": 1},  # stale
        {"event": "failure", "t": 9.0, "fatal": True, "proc": "host0/p5"},  # the job's end
    ]
    assert stale_commits(records) == 1


def test_call_latency_is_measured_with_and_without_macs() -> None:
    got = measure_calls(50, blocks=1)
    assert set(got) == {"call_p50_ms", "call_p50_ms_unauthenticated", "call_auth_ratio"}
    assert got["call_p50_ms"] > 0 and got["call_p50_ms_unauthenticated"] > 0
