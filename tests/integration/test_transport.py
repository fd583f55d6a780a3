"""The torchft CheckpointTransport over the data plane: send from one process, receive in
another straight into the replacement's own tensors."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def user_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        "optim": {
            "state": {0: {"exp_avg": torch.randn(256, 64, generator=g), "step": 12}},
            "param_groups": [{"lr": 3e-4, "params": [0]}],
        },
        "data": {"position": 4096 + seed},
    }


def _sender_main(seed: int, step: int) -> None:
    from harness.rank.transport import make_dataplane_transport

    user = user_state(seed)
    transport = make_dataplane_transport(None, timedelta(seconds=30), lambda: user)
    print(transport.metadata(), flush=True)  # torchft asks for it at the start of a quorum
    full = {"user": {"default": user}, "torchft": {"step": step, "batches_committed": 2 * step}}
    transport.send_checkpoint([1], step, full, timedelta(seconds=30))
    transport.disallow_checkpoint()
    sys.stdin.read()
    transport.shutdown()


def _start_sender(call: str) -> subprocess.Popen:
    """A separate process running ``call`` (a sender defined in this module); it prints the
    data-plane metadata on stdout and serves until its stdin closes."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); from test_transport import "
        f"_sender_main, _evil_sender_main; {call}"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


@pytest.mark.timeout(90)
def test_send_in_one_process_receive_in_place_in_another() -> None:
    from harness.rank.transport import DataplaneTransport

    proc = _start_sender("_sender_main(5, 9)")
    try:
        metadata = proc.stdout.readline().strip()
        assert metadata.startswith("{"), metadata
        mine = user_state(0)  # the replacement's already-built state, different values
        w = mine["model"]["w"]
        receiver = DataplaneTransport(state_dict=lambda: mine, timeout=timedelta(seconds=30))
        got = receiver.recv_checkpoint(0, metadata, 9, timedelta(seconds=30))
        want = user_state(5)
        assert got["torchft"] == {"step": 9, "batches_committed": 18}
        user = got["user"]["default"]
        assert user["model"]["w"] is w or user["model"]["w"].data_ptr() == w.data_ptr()  # in place
        assert torch.equal(w, want["model"]["w"])
        assert torch.equal(
            user["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"]
        )
        assert user["optim"]["state"][0]["step"] == 12 and user["data"]["position"] == 4101
        assert user["optim"]["param_groups"] == want["optim"]["param_groups"]
        with pytest.raises(Exception, match="timed out waiting for step 10"):
            receiver.recv_checkpoint(0, metadata, 10, timedelta(seconds=1))
        receiver.shutdown()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


class _Evil:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def _evil_sender_main(marker: str, step: int) -> None:
    """A quorum member that publishes a real snapshot whose blob is a malicious pickle."""
    import harness.rank.transport as transport

    evil = pickle.dumps(((), [_Evil(marker)], None))
    transport._encode_blob = lambda paths, values, spec: evil  # what an attacker sends
    user = user_state(1)
    t = transport.make_dataplane_transport(None, timedelta(seconds=30), lambda: user)
    print(t.metadata(), flush=True)
    t.send_checkpoint([1], step, {"user": {"default": user}}, timedelta(seconds=30))
    sys.stdin.read()
    t.shutdown()


@pytest.mark.timeout(90)
def test_a_malicious_blob_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    from harness.rank.transport import BlobError, DataplaneTransport

    marker = tmp_path / "pwned"
    proc = _start_sender(f"_evil_sender_main({str(marker)!r}, 3)")
    try:
        metadata = proc.stdout.readline().strip()
        assert metadata.startswith("{"), metadata
        mine = user_state(0)
        receiver = DataplaneTransport(state_dict=lambda: mine, timeout=timedelta(seconds=30))
        with pytest.raises(Exception) as refused:
            receiver.recv_checkpoint(0, metadata, 3, timedelta(seconds=30))
        receiver.shutdown()
        assert not marker.exists(), "the peer's pickle ran a command in the healing process"
        assert isinstance(refused.value, BlobError) and "not JSON" in str(refused.value)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_dataplane_is_selectable_by_name() -> None:
    from harness.rank.torchft_glue import transport_factory, transport_names
    from harness.rank.transport import make_dataplane_transport

    assert "dataplane" in transport_names()
    assert transport_factory("dataplane") is make_dataplane_transport
    with pytest.raises(ValueError, match="unknown transport 'carrier_pigeon'; known: dataplane"):
        transport_factory("carrier_pigeon")
