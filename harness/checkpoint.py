"""Durable, atomic checkpoints: a crash at any instant leaves the newest complete one loadable.

Layout under ``dir``::

    step_00000040.pt          torch.save of the state
    step_00000040.json        manifest: {"step", "file", "bytes", "xxh3_128"}

Write protocol (each checkpoint): write the payload to a temp file, fsync it, rename it into
place, fsync the directory; then the same for the manifest, which carries the payload's checksum.
The manifest is renamed last, so a checkpoint exists only once its manifest does, and
:func:`load_latest` verifies the checksum before trusting the payload. A crash mid-write leaves
temp files (ignored and cleaned up on the next save) or a payload without a manifest (ignored).

Not guaranteed: durability against a lying disk, or two writers on one directory at once.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import xxhash

_NAME = re.compile(r"^step_(\d{8,})\.json$")
_TMP_SUFFIX = ".tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}{_TMP_SUFFIX}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(dir: str | os.PathLike[str], step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint for ``step`` and return the manifest's path; keep only
    the newest ``keep`` checkpoints. Either the whole checkpoint is written or (after a crash) it
    is invisible to :func:`load_latest`."""
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    base = f"step_{step:08d}"
    _write_atomic(d / f"{base}.pt", payload)
    manifest = {
        "step": step,
        "file": f"{base}.pt",
        "bytes": len(payload),
        "xxh3_128": xxhash.xxh3_128_hexdigest(payload),
    }
    path = d / f"{base}.json"
    _write_atomic(path, json.dumps(manifest).encode())
    _prune(d, keep)
    return path


def _manifests(d: Path) -> list[tuple[int, Path]]:
    found = []
    for p in d.glob("step_*.json"):
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _prune(d: Path, keep: int) -> None:
    for _, manifest in _manifests(d)[keep:]:
        manifest.unlink(missing_ok=True)  # manifest first: the payload is then invisible
        manifest.with_suffix(".pt").unlink(missing_ok=True)
    for tmp in d.glob(f".*{_TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)  # left by a crashed writer (we are the only writer)


def _load_verified(manifest: Path) -> tuple[int, dict[str, Any]] | None:
    try:
        meta = json.loads(manifest.read_text())
        payload = (manifest.parent / meta["file"]).read_bytes()
    except (OSError, ValueError, KeyError):
        return None
    if len(payload) != meta["bytes"] or xxhash.xxh3_128_hexdigest(payload) != meta["xxh3_128"]:
        return None
    return int(meta["step"]), torch.load(io.BytesIO(payload), weights_only=False)


def load_latest(dir: str | os.PathLike[str]) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint whose payload matches its manifest's checksum, as ``(step, state)``;
    corrupt or partial ones are skipped. None if there is none (or ``dir`` does not exist)."""
    d = Path(dir)
    if not d.is_dir():
        return None
    for _, manifest in _manifests(d):
        loaded = _load_verified(manifest)
        if loaded is not None:
            return loaded
    return None
