"""The tree quorum's durable state (``RUN/quorum.json``): what a new controller needs to serve the
same members on the same port after the old one died (``issues show 26``).

What is kept, and why each is enough (``harness.quorum.tree`` keeps the state; this module only
reads and writes it):

* ``host`` and ``port``: the torchft Managers were given ``http://host:port`` once, at start, and
  keep dialing it; a resumed service must serve exactly there.
* ``secret``, ``incarnations`` (and ``member_ids``, derived, for a reader; checked on load): the
  running Managers' tagged ids stay valid, and an older incarnation of a group stays refused.
* ``fenced``: ids declared failed stay out (a group declared dead but still running, stopped or
  cut off, must not slip back in before its replacement is admitted).
* ``quorum_id_lease`` *L*: every quorum id issued so far is below *L*. The service raises it in
  blocks (:data:`LEASE_BLOCK`), durably, *before* it issues an id that reaches it, so saving
  costs one fsync per block of ids, not one per quorum; a resumed service numbers its quorums
  from *L* on, above every id any Manager has seen (torchft rendezvouses each quorum under its
  id: a reused id meets the keys of an old rendezvous, ``harness.rank.torchft_glue``).
* ``last_quorum`` (its member ids), ``highest_step``, ``reported`` (each live member's last
  reported step): saved lazily, by a background writer (:class:`StateWriter`), so they may lag.
  That is safe because a resumed service treats no saved step as the truth: a member may have
  committed steps past what it last reported (between quorums, and after the last save), so
  until each saved member joins again and reports its step, no quorum is issued
  (``Continuation.resumed``); only a member that neither joins nor heartbeats within the
  join timeout (dead, awaiting its fence) falls back to its saved step, as a dead member's last
  step always counted (``harness.quorum.rule._behind``). Too high a saved step could stall the
  job, too low one let members behind it re-commit steps; neither is ever used while a live
  member can say better.

The file is written whole and durably (``runtime.control_file.write_atomic``: a temporary file,
fsync, rename, fsync of the directory; mode 0600, it holds the secret) and carries a SHA-256
digest of its contents. :func:`load` refuses, naming the file and the problem, anything else: a
torn or truncated file, a key missing or unknown, a wrong type or range, member ids that do not
follow from the secret, a digest that does not match (edited by hand). Nothing of a refused file
is adopted.

Only one service writes a file: a resumed one must bind the same port first, which a live old
service holds (``TreeQuorumService.resume``), so an old controller that was merely stopped
cannot overwrite its successor's state.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.quorum import rule
from runtime.control_file import write_atomic

log = logging.getLogger(__name__)

#: What a file of this layout says it is (a later layout gets another name).
FORMAT = "ftharness.tree-quorum.v1"
#: How many quorum ids one durable write of the lease covers. Ids change only when membership
#: does (or a member reports commit failures), so this is one fsync per hundred such changes; a
#: resume skips at most this many ids.
LEASE_BLOCK = 100
_KEYS = frozenset(
    {
        "format",
        "host",
        "port",
        "secret",
        "incarnations",
        "member_ids",
        "fenced",
        "quorum_id_lease",
        "last_quorum",
        "highest_step",
        "reported",
        "saved",
        "digest",
    }
)
_SEQ = itertools.count(1)


class QuorumStateError(ValueError):
    """A quorum state file that must not be adopted; the message names the file and why."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"tree quorum state {path}: {problem}; refusing to resume from it")
        self.path = Path(path)
        self.problem = problem


def next_seq() -> int:
    """A number that orders snapshots taken in this process (under a service's lock): the
    writer never replaces a newer snapshot in the file by an older one."""
    return next(_SEQ)


def next_lease(quorum_id: int, lease: int, block: int = LEASE_BLOCK) -> int | None:
    """The lease to make durable before issuing ``quorum_id`` under ``lease`` (every id issued
    is below the lease), or None if ``quorum_id`` is below it already."""
    return None if quorum_id < lease else quorum_id + block


@dataclass(frozen=True, kw_only=True)
class QuorumSnapshot:
    """The durable part of a tree quorum's state (module doc); ``seq`` orders snapshots."""

    host: str
    port: int
    secret: bytes
    incarnations: Mapping[int, int]
    fenced: frozenset[str]
    quorum_id_lease: int
    last_quorum: tuple[str, ...]
    highest_step: int
    reported: Mapping[str, int]
    seq: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Continuation:
    """What a tree quorum continues from: a live service restarted (its ``TreeQuorum.secret``,
    ``incarnations``, ``highest_step``, ``reported``, next ``quorum_id`` and lease), or one resumed
    from its durable state by a new controller (a :class:`QuorumSnapshot`: also ``fenced``,
    ``last_quorum``, ``quorum_id`` = the saved lease, and ``resumed``). A fresh service has none
    and a new random secret."""

    secret: bytes
    incarnations: Mapping[int, int] = field(default_factory=dict)
    highest_step: int = -1
    reported: Mapping[str, int] = field(default_factory=dict)
    quorum_id: int = 0
    quorum_id_lease: int = 1
    fenced: frozenset[str] = frozenset()
    last_quorum: tuple[str, ...] = ()
    resumed: bool = False  # from saved state: the saved steps are only lower bounds (class doc)


def _digest(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def encode(s: QuorumSnapshot) -> bytes:
    """The file's bytes for ``s``."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "host": s.host,
        "port": s.port,
        "secret": s.secret.hex(),
        "incarnations": {str(r): i for r, i in sorted(s.incarnations.items())},
        "member_ids": {
            str(r): rule.member_id(s.secret, r, i) for r, i in sorted(s.incarnations.items())
        },
        "fenced": sorted(s.fenced),
        "quorum_id_lease": s.quorum_id_lease,
        "last_quorum": list(s.last_quorum),
        "highest_step": s.highest_step,
        "reported": dict(sorted(s.reported.items())),
        "saved": time.time(),
    }
    doc["digest"] = _digest(doc)
    return (json.dumps(doc, indent=1) + "\n").encode()


def save(path: Path | str, s: QuorumSnapshot) -> None:
    """Replace the file at ``path`` by ``s``, whole and durably (mode 0600)."""
    write_atomic(path, encode(s), 0o600)


def load(path: Path | str) -> QuorumSnapshot:
    """The snapshot in ``path``; :class:`QuorumStateError` if the file is missing, unreadable
    or not exactly what :func:`save` writes (module doc)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise QuorumStateError(path, f"cannot be read ({e.strerror or e})") from e
    return decode(data, path)


def decode(data: bytes, path: Path | str = "<bytes>") -> QuorumSnapshot:
    """:func:`load` on bytes already read (``path`` names them in errors)."""

    def bad(problem: str) -> QuorumStateError:
        return QuorumStateError(path, problem)

    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not valid JSON, torn or truncated? ({e})") from e
    if not isinstance(doc, dict):
        raise bad(f"not a JSON object but {type(doc).__name__}")
    if missing := sorted(_KEYS - doc.keys()):
        raise bad(f"missing key(s) {', '.join(missing)}")
    if unknown := sorted(doc.keys() - _KEYS):
        raise bad(f"unknown key(s) {', '.join(unknown)}")
    if doc["format"] != FORMAT:
        raise bad(f"format is {doc['format']!r}, expected {FORMAT!r}")
    host = _str(doc, "host", bad)
    port = _int(doc, "port", bad, 1, 65535)
    secret_hex = _str(doc, "secret", bad)
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        secret = b""
    if len(secret) < 16 or secret.hex() != secret_hex:
        raise bad("secret is not a lower-case hex string of at least 16 bytes")
    incarnations = {int(r): i for r, i in _int_map(doc, "incarnations", bad, numeric_keys=True)}
    member_ids = doc["member_ids"]
    expected = {str(r): rule.member_id(secret, r, i) for r, i in incarnations.items()}
    if member_ids != expected:
        raise bad("member_ids do not follow from the secret and the incarnations")
    fenced = _str_list(doc, "fenced", bad)
    lease = _int(doc, "quorum_id_lease", bad, 1)
    last_quorum = _str_list(doc, "last_quorum", bad)
    if len(set(last_quorum)) != len(last_quorum):
        raise bad("last_quorum lists a member twice")
    highest = _int(doc, "highest_step", bad, -1)
    reported = dict(_int_map(doc, "reported", bad, numeric_keys=False))
    saved = doc["saved"]
    if isinstance(saved, bool) or not isinstance(saved, int | float) or not math.isfinite(saved):
        raise bad(f"saved must be a time in seconds, not {saved!r}")
    if doc["digest"] != _digest(doc):
        raise bad("its digest does not match its contents (edited by hand, or corrupted)")
    return QuorumSnapshot(
        host=host,
        port=port,
        secret=secret,
        incarnations=incarnations,
        fenced=frozenset(fenced),
        quorum_id_lease=lease,
        last_quorum=tuple(last_quorum),
        highest_step=highest,
        reported=reported,
    )


_Bad = Callable[[str], QuorumStateError]
_BIG = 2**62  # far beyond any step or id, below int64's end (the wire carries int64)


def _int(doc: Mapping[str, Any], key: str, bad: _Bad, lo: int, hi: int = _BIG) -> int:
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"{key} must be an integer in [{lo}, {hi}], not {v!r}")
    return v


def _str(doc: Mapping[str, Any], key: str, bad: _Bad) -> str:
    v = doc[key]
    if not isinstance(v, str) or not v:
        raise bad(f"{key} must be a non-empty string, not {v!r}")
    return v


def _str_list(doc: Mapping[str, Any], key: str, bad: _Bad) -> list[str]:
    v = doc[key]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise bad(f"{key} must be a list of non-empty strings")
    return v


def _int_map(
    doc: Mapping[str, Any], key: str, bad: _Bad, *, numeric_keys: bool
) -> list[tuple[str, int]]:
    v = doc[key]
    if not isinstance(v, dict):
        raise bad(f"{key} must be an object, not {type(v).__name__}")
    out = []
    for k, n in v.items():
        if numeric_keys and not (k.isdigit() and str(int(k)) == k):
            raise bad(f"{key}: {k!r} is not a replica group number")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _BIG:
            raise bad(f"{key}[{k!r}] must be a non-negative integer, not {n!r}")
        out.append((k, n))
    return out


class StateWriter:
    """Keeps the file in step with a service. :meth:`save` writes a snapshot at once (what must
    be durable before the caller goes on: an admission, the quorum-id lease); :meth:`changed`,
    cheap enough to call with the service's lock held, has a background thread write the
    latest snapshot (``snapshot()``) soon, at most every ``interval_s``. A snapshot never
    replaces a newer one (``seq``). A failed background write is logged and tried again at the
    next change; a failed :meth:`save` raises."""

    def __init__(
        self,
        path: Path | str,
        snapshot: Callable[[], QuorumSnapshot | None],
        interval_s: float = 0.5,
    ) -> None:
        self.path = Path(path)
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._io = threading.Lock()
        self._written = -1
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-quorum-save", daemon=True)
        self._thread.start()

    def changed(self) -> None:
        self._wake.set()

    def save(self, s: QuorumSnapshot) -> None:
        with self._io:
            if s.seq and s.seq <= self._written:
                return  # the file already holds a newer snapshot
            save(self.path, s)
            self._written = s.seq

    def flush(self) -> None:
        """Write the latest snapshot now (raises as :meth:`save`)."""
        s = self._snapshot()
        if s is not None:
            self.save(s)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
                failing = False
            except OSError as e:
                if not failing:  # once per run of failures, not once per change
                    log.error("tree quorum: cannot save its state to %s: %s", self.path, e)
                failing = True
            self._stop.wait(self._interval_s)

    def close(self, flush: bool = True) -> None:
        """Stop the background thread, then write the latest snapshot (best effort) if
        ``flush``."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if not flush:
            return
        try:
            self.flush()
        except OSError as e:
            log.error("tree quorum: cannot save its state to %s: %s", self.path, e)
