"""``ftharness bench checkpoint --quick``: the JSON contract a user reads, from a real run (two
FSDP2 ranks writing torch.save files, synchronous DCP and background DCP checkpoints)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.bench.checkpoint import WAYS


@pytest.mark.timeout(300)
def test_quick_checkpoint_bench_prints_the_contract_json_last():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "bench",
            "checkpoint",
            "--quick",
            "--reps",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["model"], result["ranks"], result["reps"]) == ("tiny", 2, 1)
    assert list(result["ways"]) == list(WAYS)
    for way, fig in result["ways"].items():
        assert fig["step_s"] > 0 and fig["durable_s"] > 0, way
        assert fig["bytes"] > 0, way
        assert set(fig) == {
            "step_s", "blocked_s", "after_s", "staging_wait_s", "durable_s", "blocked_ratio",
            "stall_s", "stall_ratio", "bytes",
        }  # fmt: skip
        assert fig["stall_s"] >= fig["blocked_s"] and fig["staging_wait_s"] >= 0, way
        if way != "dcp_async":  # nothing staged in the background: no staging wait
            assert fig["staging_wait_s"] == 0, way
    # the same state either way DCP writes it (one metadata file apart in size at most)
    dcp_sync, dcp_async = result["ways"]["dcp_sync"]["bytes"], result["ways"]["dcp_async"]["bytes"]
    assert abs(dcp_sync - dcp_async) < 0.01 * dcp_sync
    assert set(result["ratios"]) == {"dcp_async/dcp_sync", "dcp_async/torch"}
