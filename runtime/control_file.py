"""The run directory's control file and secret: how agents find the controller serving a run.

``RUN/controller.json`` holds ``{"address": "HOST:PORT", "epoch": N, "pid": P, "started": T}``.
A controller writes it once its listener serves, before it starts any agent; a takeover
controller writes its own with the epoch one higher. Agents that lost their controller re-read
it to find the new one (``runtime.orphan``), and a controller whose epoch is no longer the
file's knows it was replaced (:class:`EpochFence`) and must stop acting at once.

Both files are written whole or not at all (a temporary file in the same folder, fsync,
``os.replace``, fsync of the folder): a reader never sees half a file, and a crash right after a
write cannot lose it. A file that is there but does not parse is refused with the reason
(:class:`ControlFileError`): it was edited by hand or written by something else, and guessing
an address or an epoch from it could hand the run to the wrong controller.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ftharness.control")

#: Bytes a control file may have: it is one small object; anything larger is not ours.
MAX_BYTES = 4096


class ControlFileError(ValueError):
    """A control file that is there but cannot be trusted (torn, edited, not ours)."""


@dataclass(frozen=True)
class ControlInfo:
    """What one controller of a run wrote: where it listens, its epoch, its pid, since when."""

    address: tuple[str, int]
    epoch: int
    pid: int
    started: float


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` by ``data`` durably and whole: readers see the old file or the new one,
    never a mix, and a crash after this returns does not lose it."""
    target = Path(path)
    folder = target.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_control(
    path: str | os.PathLike[str], address: tuple[str, int], epoch: int, pid: int | None = None
) -> ControlInfo:
    """Say durably that the controller at ``address`` with ``epoch`` (>= 1) serves this run."""
    host, port = address
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"a controller epoch is an integer >= 1, got {epoch!r}")
    info = ControlInfo((str(host), int(port)), epoch, os.getpid() if pid is None else pid,
                       time.time())  # fmt: skip
    body = {
        "address": f"{info.address[0]}:{info.address[1]}",
        "epoch": info.epoch,
        "pid": info.pid,
        "started": info.started,
    }
    write_atomic(path, (json.dumps(body) + "\n").encode())
    return info


def read_control(path: str | os.PathLike[str]) -> ControlInfo | None:
    """The controller serving the run, or None if no controller wrote the file yet (it does
    not exist). ControlFileError, saying what is wrong, for a file that does not parse."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_BYTES:
        raise ControlFileError(f"{path}: over {MAX_BYTES} bytes: not a controller file")
    try:
        body = json.loads(raw)
    except ValueError:
        raise ControlFileError(f"{path}: not valid JSON (torn or edited by hand)") from None
    if not isinstance(body, dict):
        raise ControlFileError(f"{path}: not a JSON object")
    address, epoch, pid, started = (body.get(k) for k in ("address", "epoch", "pid", "started"))
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ControlFileError(f"{path}: 'address' must be HOST:PORT, got {address!r:.60}")
    for name, value in (("epoch", epoch), ("pid", pid)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ControlFileError(f"{path}: {name!r} must be an integer >= 1, got {value!r:.40}")
    if (
        isinstance(started, bool)
        or not isinstance(started, int | float)
        or not math.isfinite(started)
    ):
        raise ControlFileError(f"{path}: 'started' must be a time, got {started!r:.40}")
    assert isinstance(epoch, int) and isinstance(pid, int)
    return ControlInfo((host.strip("[]"), int(port)), epoch, pid, float(started))


class EpochFence:
    """``fence()`` is True while ``epoch`` is still the run's controller epoch in ``path``.

    A controller passes it to its journal (``Journal(fence=...)``) and checks it before it acts
    on a host: once a takeover controller wrote a higher epoch, this process is a stale
    controller (SIGSTOPped, partitioned, slow) and must not append or command anything. The
    file is re-read only when its inode or mtime changes, so a check costs one ``stat``. A file
    that is gone or unreadable does not fence (the run directory being cleaned at the end must
    not kill a controller mid-shutdown); one that names another epoch does."""

    def __init__(self, path: str | os.PathLike[str], epoch: int) -> None:
        self.path = Path(path)
        self.epoch = epoch
        self._seen: tuple[int, int] | None = None
        self._current = True

    def __call__(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._current
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._seen:
            try:
                info = read_control(self.path)
            except (OSError, ControlFileError):
                return self._current
            self._seen = key
            self._current = info is None or info.epoch == self.epoch
        return self._current

    def exit_if_replaced(self, what: str) -> None:
        """End this process at once (status 75) if a newer controller serves the run."""
        if not self():
            superseded(self.path, self.epoch, what)


#: The exit status of a controller that found itself replaced (EX_TEMPFAIL: not its failure).
EXIT_SUPERSEDED = 75


def superseded(path: Path, epoch: int, what: str) -> None:
    """Say why, then exit now: no thread of a replaced controller may act any further."""
    with contextlib.suppress(Exception):
        print(
            f"ftharness controller (epoch {epoch}, pid {os.getpid()}): {path} names a newer "
            f"controller; exiting before {what}",
            file=sys.stderr,
            flush=True,
        )
    os._exit(EXIT_SUPERSEDED)


def write_secret(path: str | os.PathLike[str], secret: bytes) -> None:
    """Store the job secret (hex) durably, mode 0600: a takeover controller reads it back."""
    write_atomic(path, secret.hex().encode() + b"\n", 0o600)


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The job secret (hex) from ``path`` (``-``: stdin). A file anyone but its owner can read,
    or that another user owns, is refused: the secret is the job's only credential."""
    if path == "-":
        text = sys.stdin.readline()
    else:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise PermissionError(
                f"{path} is readable by others (mode {st.st_mode & 0o777:o}): "
                f"the job secret must be mode 0600 (chmod 600 {path})"
            )
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to another user (uid {st.st_uid})")
        with open(path) as f:
            text = f.read()
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{path}: not a hex secret") from None
