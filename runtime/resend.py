"""Journal events a worker sent to a controller that died before it read them: sent again.

Every :class:`~runtime.messages.Event` a worker sends carries a number (``Event.seq``: 1, 2, ...
for the life of the worker process, across its connections), and the controller journals it
with that number (the field :data:`EVENT_SEQ`), so the journal says, per process, the highest
event it holds. The worker keeps the last events it handed to the kernel
(:class:`Retained`): a controller that dies takes with it what was in its socket buffers,
unread. A takeover controller reads the journal's marks (``runtime.takeover.event_marks``),
keeps them as it journals more (:class:`Marks`), and answers a re-dialling worker's hello
with its mark (``Welcome.resend_after``): the worker sends the events it kept past it, in
order, before anything else, and none at or below it (the journal has those).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping

from runtime.channel import Connection, FrameError
from runtime.messages import Welcome

log = logging.getLogger(__name__)

#: The journal field of a worker event's number (``seq`` is a ``group.start``'s already).
EVENT_SEQ = "eseq"
#: What a worker keeps of the events it already sent. Only frames in flight when a controller
#: died can be lost: those in its socket buffers (the worker's send buffer and the
#: controller's receive buffer, a few MiB at most with Linux's autotuning defaults) and the
#: few it had read but not journaled yet. They are also at most what the worker emitted
#: between the death and the moment it noticed (the connection closing, or its agent's
#: ``controller_silence_s``): a training loop's few events a second, never thousands.
MAX_RETAINED_FRAMES = 8192
MAX_RETAINED_BYTES = 8 << 20


def first_welcome(conn: Connection, timeout_s: float) -> Welcome:
    """The controller's answer to a re-dialling worker's hello, read before the worker sends
    anything else (ChannelError if none comes in time)."""
    conn.sock.settimeout(timeout_s)
    try:
        msg = conn.recv()
    finally:
        conn.sock.settimeout(None)
    if not isinstance(msg, Welcome):
        raise FrameError(f"expected Welcome, got {msg!r:.80}")
    return msg


class Retained:
    """The events a worker handed to the kernel, the newest last, bounded by frames and bytes
    (past either bound the oldest go). Used by the worker's one sender thread only."""

    def __init__(
        self, max_frames: int = MAX_RETAINED_FRAMES, max_bytes: int = MAX_RETAINED_BYTES
    ) -> None:
        self._frames: collections.deque[tuple[int, bytes]] = collections.deque()
        self._bytes = 0
        self._max_frames = max_frames
        self._max_bytes = max_bytes
        self.forgotten = 0  # the highest number that fell out of the bound

    def keep(self, seq: int, payload: bytes) -> None:
        self._frames.append((seq, payload))
        self._bytes += len(payload)
        while len(self._frames) > self._max_frames or self._bytes > self._max_bytes:
            old, data = self._frames.popleft()
            self._bytes -= len(data)
            self.forgotten = old

    def after(self, mark: int) -> list[bytes]:
        """The payloads numbered above ``mark``, in order, to send again (they stay kept: the
        next controller may die with them in flight too); those at or below it are dropped."""
        while self._frames and self._frames[0][0] <= mark:
            self._bytes -= len(self._frames.popleft()[1])
        if mark < self.forgotten:
            log.error(
                "worker: events %d..%d may be lost: the journal ends at %d and no more are kept",
                mark + 1, self.forgotten, mark,
            )  # fmt: skip
        return [data for _, data in self._frames]

    def __len__(self) -> int:
        return len(self._frames)


class Marks:
    """The controller's side: per process, the highest event number journaled (from the
    journal a takeover read, then as it journals). Thread-safe."""

    def __init__(self, initial: Mapping[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._marks = dict(initial or {})

    def mark(self, proc_id: str) -> int:
        """What to tell ``proc_id``'s worker it may skip (``Welcome.resend_after``): 0 for a
        process the journal never heard from (so it sends every event it kept)."""
        with self._lock:
            return self._marks.get(proc_id, 0)

    def admit(self, proc_id: str, seq: int) -> bool:
        """Whether to journal event ``seq`` of ``proc_id``: an unnumbered one (0) always, a
        numbered one once, and only above every one journaled (never a duplicate)."""
        if seq <= 0:
            return True
        with self._lock:
            if seq <= self._marks.get(proc_id, 0):
                return False
            self._marks[proc_id] = seq
            return True
