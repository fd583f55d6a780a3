"""``ftharness bench transfer --quick``: the JSON contract a user reads, from a real run (a real
source process serving shm, tcp, a raw socket, torchft HTTP and PG)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.bench.transfer import METHODS, QUICK_SIZES, RATIOS


@pytest.mark.timeout(300)
def test_quick_transfer_bench_prints_the_contract_json_last():
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "bench", "transfer", "--quick", "--reps", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes = result["sizes"]
    assert len(sizes) == len(QUICK_SIZES)
    assert [s["bytes"] for s in sizes] == sorted(s["bytes"] for s in sizes)  # largest last
    for s in sizes:
        assert s["verified"] is True
        assert all(s[m] > 0 for m in METHODS)
        assert set(s["ratios"]) == {f"{a}/{b}" for a, b in RATIOS} | {"tcp/http_reuse"}
        assert s["http_reuse"] > 0
        # the contract's keys come in the order
        keys = [k for k in s if k in ("memcpy", "shm", "tcp", "http", "pg", "verified")]
        assert keys == ["memcpy", "shm", "tcp", "http", "pg", "verified"]
        assert abs(s["bytes"] - QUICK_SIZES[sizes.index(s)]) < 0.01 * s["bytes"]
