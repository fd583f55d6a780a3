"""The data-plane transport's blob (``harness.rank.transport``): the non-tensor part of a state,
decoded from a peer without running anything the peer sent."""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_unflatten

from harness.rank.transport import _TENSOR, BlobError, _encode_blob, _flatten, decode_blob


def trainer_like_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(1, 3)).sum().backward()
    optim.step()
    user = {"model": model.state_dict(), "optim": optim.state_dict(), "data": {"position": 7}}
    return {"user": {"default": user}, "torchft": {"step": 3, "batches_committed": 4}}


def test_round_trip_of_a_trainers_state() -> None:
    state = trainer_like_state()
    paths, values, spec = _flatten(state)
    got_paths, others, got_spec = decode_blob(_encode_blob(paths, values, spec))
    assert got_paths == paths and got_spec == spec
    assert [v is _TENSOR for v in others] == [isinstance(v, torch.Tensor) for v in values]
    rebuilt = tree_unflatten(
        [v if o is _TENSOR else o for v, o in zip(values, others, strict=True)], got_spec
    )
    assert type(rebuilt["user"]["default"]["model"]) is OrderedDict
    assert rebuilt["user"]["default"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert list(rebuilt["user"]["default"]["optim"]["state"]) == [0, 1]  # int keys stay ints
    assert rebuilt["torchft"] == {"step": 3, "batches_committed": 4}


class _WritesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.path}",))


def test_a_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(BlobError, match="not JSON"):
        decode_blob(pickle.dumps(_WritesAFile(str(marker))))
    assert not marker.exists()


def _blob(**change: Any) -> bytes:
    doc = {"paths": [["['a']"]], "leaves": [1], "tensors": [], "spec": ["dict", ["a"], [None]]}
    doc.update(change)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "bad",
    [
        # torch's treespec_loads would import the module an "__enum__" object names
        _blob(spec=["dict", [{"__enum__": 1, "fqn": "antigravity:x", "name": "y"}], [None]]),
        _blob(spec=["builtins.eval", None, [None]]),
        _blob(spec=["collections.defaultdict", ["a"], [None]]),
        _blob(spec=["dict", ["a", "b"], [None]]),  # keys and children disagree
        _blob(spec=["dict", ["a"], [None, None]]),
        _blob(leaves=[{"x": 1}]),  # leaves are scalars only
        _blob(tensors=[5]),
        _blob(paths=[[1]]),
        _blob(extra=1),
        _blob(spec=["list", None, [None] * 2]),  # two leaves in the tree, one in the blob
        b'{"paths":' + b"[" * 100_000,
        b"\xff\xfe",
    ],
)
def test_malformed_or_hostile_blobs_are_refused(bad: bytes) -> None:
    with pytest.raises(BlobError):
        decode_blob(bad)


def test_deep_nesting_is_refused() -> None:
    spec: Any = None
    for _ in range(200):
        spec = ["list", None, [spec]]
    with pytest.raises(BlobError, match="deeper"):
        decode_blob(_blob(spec=spec))


def test_a_state_with_other_leaves_is_refused_when_sent() -> None:
    paths, values, spec = _flatten({"model": {"dtype": torch.float32}})
    with pytest.raises(BlobError, match=r"\['model'\]\['dtype'\]: a dtype leaf"):
        _encode_blob(paths, values, spec)
