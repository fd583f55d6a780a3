"""Durable, atomic checkpoints: a crash at any instant leaves the newest complete one loadable.

Layout under ``dir``::

    step_00000040.pt          torch.save of the state
    step_00000040.json        manifest: {"step", "file", "bytes", "xxh3_128"}

Write protocol (each checkpoint): write the payload to a temp file, fsync it, rename it into
place, fsync the directory; then the same for the manifest, which carries the payload's checksum.
The manifest is renamed last, so a checkpoint exists only once its manifest does, and
:func:`load_latest` verifies the checksum before trusting the payload. A crash mid-write leaves
temp files (ignored and cleaned up on the next save) or a payload without a manifest (ignored).

Two halves, so the slow one can leave the training thread (:class:`BackgroundWriter`):
:func:`snapshot` serializes the state to bytes (the consistent copy: it must run where the state
cannot change under it, i.e. on the training thread between steps) and :func:`write` does the
file work above (writes, fsyncs, renames, prune), which needs nothing but those bytes.
:func:`save` is the two in a row.

Trust: payloads are loaded with ``torch.load(weights_only=True)``, so a planted checkpoint can
hold only tensors and plain data (dicts, lists, tuples, numbers, strings, None), never code. A
manifest's ``file`` must name a file in the same directory; a manifest that is not a JSON object
(or nested too deeply to parse), or names anything else, is skipped like a corrupt one. Folders
are created ``0700`` and files ``0600``: the weights are the run's, not every local user's.

Not guaranteed: durability against a lying disk, or two writers on one directory at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

_NAME = re.compile(r"^step_(\d{8,})\.json$")
_TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (ENOSPC, EIO) leaves no temp file behind
        raise
    fsync_dir(path.parent)


def snapshot(state: dict[str, Any]) -> bytes:
    """The checkpoint payload of ``state``: ``torch.save`` into memory. This is the consistent
    copy (tensors are copied out as they are now), so call it where the state cannot change
    meanwhile; what it returns can be handed to :func:`write` on any thread."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def write(dir: str | os.PathLike[str], step: int, payload: bytes, *, keep: int = 2) -> Path:
    """Write ``payload`` (from :func:`snapshot`) as the checkpoint for ``step`` and return the
    manifest's path; keep only the newest ``keep`` checkpoints. The manifest is written only once
    the payload is durable, so if this raises (or the process dies) part way, the checkpoint is
    invisible to :func:`load_latest` and the previous one is still the newest."""
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
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


def save(dir: str | os.PathLike[str], step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint for ``step`` and return the manifest's path; keep only
    the newest ``keep`` checkpoints. Either the whole checkpoint is written or (after a crash) it
    is invisible to :func:`load_latest`. (:func:`snapshot` then :func:`write`, on this thread.)"""
    return write(dir, step, snapshot(state), keep=keep)


class BackgroundWriter:
    """Runs checkpoint writes on one thread, at most one at a time, in the order given (a
    one-thread executor, and the future of the write in flight). Used from one thread.

    :meth:`submit` hands a write (any callable) over and returns at once, unless the previous
    write is still running: then it waits for that one first, so at most one payload is held in
    memory and checkpoints land in step order. A write that raised is not lost: its exception is
    raised, once, by the next :meth:`submit` or :meth:`wait` (on the caller's thread, as a
    synchronous write would have).

    Not guaranteed: a write still running when the process dies is lost (what :func:`write`
    guarantees then is that it is invisible, not that it is finished)."""

    def __init__(self, name: str = "harness-checkpoint-writer") -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: cf.Future[object] | None = None

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the writer thread; first wait for (and raise the error of) the
        previous one. RuntimeError once closed."""
        self.wait()
        self._pending = self._pool.submit(job)

    def busy(self) -> bool:
        """A write is handed over and not finished."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until no write is in flight; raise the error of a write that failed (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`wait` (raising as it does), then end the thread; later submits raise."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=False)


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


def _payload_path(manifest: Path, meta: Any) -> Path | None:
    """The payload a manifest names, or None unless the manifest is a well-formed object whose
    ``file`` is a plain file name in the manifest's own directory (no ``/``, no ``..``, no
    symlink leading out)."""
    if not isinstance(meta, dict):
        return None
    name, size, digest, step = (meta.get(k) for k in ("file", "bytes", "xxh3_128", "step"))
    if not (isinstance(name, str) and isinstance(digest, str)):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, step)):
        return None
    if name in ("", ".", "..") or Path(name).name != name:
        return None
    path = manifest.parent / name
    if path.resolve().parent != manifest.parent.resolve():
        return None
    return path


def _load_verified(manifest: Path) -> tuple[int, dict[str, Any]] | None:
    try:
        meta = json.loads(manifest.read_text())
        path = _payload_path(manifest, meta)
        if path is None:
            return None
        payload = path.read_bytes()
    except (OSError, ValueError, RecursionError):  # RecursionError: a manifest of [[[[...]]]]
        return None
    if len(payload) != meta["bytes"] or xxhash.xxh3_128_hexdigest(payload) != meta["xxh3_128"]:
        return None
    try:
        # weights_only: a checkpoint is data. Anything that would need code to unpickle is
        # refused (and the checkpoint skipped) rather than run.
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError):
        return None
    return meta["step"], state


def steps(dir: str | os.PathLike[str]) -> list[int]:
    """The steps ``dir`` has a manifest for, newest first (not verified: :func:`load` checks)."""
    d = Path(dir)
    return [step for step, _ in _manifests(d)] if d.is_dir() else []


def load(dir: str | os.PathLike[str], step: int) -> dict[str, Any] | None:
    """The state of the checkpoint for ``step`` in ``dir`` if its payload matches its manifest's
    checksum (and loads as data), else None."""
    loaded = _load_verified(Path(dir) / f"step_{step:08d}.json")
    return loaded[1] if loaded is not None and loaded[0] == step else None


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


def common_step(newest_at_most: Callable[[int], int], group_min: Callable[[int], int]) -> int:
    """The newest step every rank of a group has a valid checkpoint for, or -1 if there is none.

    Each rank of a group writes and prunes its own checkpoints, so after a crash they can differ:
    rank 0's step 60 durable, rank 1's still being written when the group died. A group whose
    ranks resumed from their own newest ones would commit steps 60 and 50 together (silently
    wrong: their shards, or their data positions, belong to different steps). So each rank says
    the newest step it has at or below a bound (``newest_at_most(bound)``, -1: none), the group
    takes the minimum (``group_min``: a collective every rank of the group calls, in the same
    order), and they go round again with that as the bound until every rank has it: the first
    round gives the oldest of the ranks' newest, each further round only skips a step some rank
    lacks. Every rank returns the same step."""
    bound = 2**62
    while True:
        agreed = group_min(newest_at_most(bound))
        if agreed == bound or agreed < 0:
            return agreed
        # Each rank has a step >= agreed only if it has exactly agreed: ask once more with it
        # as the bound; unchanged means every rank has it.
        bound = agreed
