"""Poison data: data that crashes the step of whichever group reads it is quarantined.

A token id outside the vocabulary from a corrupted shard, or a record a loader cannot decode, is
a fault of the data, not of the replica that met it. With ``data.policy = "replay"`` a dead
group's batches go to the survivors, so one bad sequence used to kill every group in turn until
the restart intensity ended the job (issue #50). Now (``harness.rank.trainer``):

* **ids outside the vocabulary** are bad data for certain, whoever reads them: the rank that
  reads them quarantines them at once (``data.quarantine``, ``found = "vocabulary"``), before
  its pass, and trains the rest of its batch: no group fails;
* a sequence that **cannot be read**, or a **pass that raises** where some rows raise alone (or
  hold bad ids), fails the group as before, and its rank journals the sequences to blame
  (``data.suspect``). One group's failure alone proves nothing (a replica with a bad local copy
  or broken state fails on good data, which another group then reads without failing), so the
  data is quarantined when a **second group** fails on it: journaled (``data.quarantine``),
  said on the console.

Either way the key (a sequence; a chunk of the corpus for a token file, met again at each epoch)
is then skipped by every group: the ones running (a system call,
``harness.rank.actors.quarantine_data``) and every group started later (its trainers get
:meth:`DataMarks.marks`). The ``poison_data`` fault (``faults.data``) marks a key here too, so
that a group started after it meets the same bad data, as it would in a corrupted corpus.

A **non-finite loss** is no failure: the step commits, the rank's gradients count as zeros,
and its rank journals the sequences whose own loss is not finite (``data.suspect``, ``found =
"nonfinite"``). Every group checksums that step, and where the checksums agree the weights are
not to blame (``harness.job.divergence``, action ``data``): the sequences are quarantined at
once, since any group would compute the same non-finite loss on the same weights and data.
Where they differ, the group is healed as a silent divergence, and its suspicion is dropped.

A controller that takes over a run (``harness.job.takeover``) rebuilds all of it from the
journal (:meth:`DataMarks.resume`): the groups it starts skip what the dead controller had
quarantined, and a suspicion from before counts toward the second group.

Not covered yet: a quarantine sent while a group is being constructed reaches that group only at
its next failure on the key (which sends it again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from runtime.journal import (
    DATA_QUARANTINE,
    DATA_SUSPECT,
    POISON_DATA,
    SILENT_DIVERGENCE,
    Journal,
    Record,
)

#: Different groups that must fail on a key before it is quarantined.
GROUPS_TO_QUARANTINE = 2
#: Steps a non-finite suspicion waits for the checksums' verdict before it is forgotten.
NONFINITE_KEEP_STEPS = 64


class DataMarks:
    """The job's poisoned and quarantined keys (module doc). ``send(func, *args)`` runs a
    system call of ``harness.rank.actors`` in every running trainer."""

    def __init__(
        self, journal: Journal, say: Callable[[str], None], send: Callable[..., None]
    ) -> None:
        self._journal = journal
        self._say = say
        self._send = send
        self._lock = threading.Lock()
        self.poisoned: dict[int, str] = {}  # key -> its effect (TokenStream.poison)
        self.quarantined: dict[int, Record] = {}  # key -> its data.quarantine record
        self._suspects: dict[int, dict[int, Record]] = {}  # key -> replica -> its suspicion
        # (replica, step) -> its ranks' non-finite suspicions, until the checksums judge it
        self._nonfinite: dict[tuple[int, int], list[Record]] = {}

    @classmethod
    def attach(
        cls, journal: Journal, say: Callable[[str], None], send: Callable[..., None]
    ) -> DataMarks:
        """Marks fed by ``journal`` (its records are the rule's input)."""
        marks = cls(journal, say, send)
        journal.add_sink(marks.on_record)
        return marks

    def resume(self, records: list[Record]) -> None:
        """Take up what a dead controller's journal says (a takeover): the keys poisoned and
        quarantined, and who suspected what, without journaling, sending or saying any of it
        again (the groups still running have had it sent; new ones get :meth:`marks`)."""
        with self._lock:
            for r in records:
                event, key = r.get("event"), r.get("key")
                if event == POISON_DATA and isinstance(key, int):
                    self.poisoned[key] = str(r.get("effect", "unreadable"))
                elif event == DATA_QUARANTINE and isinstance(key, int):
                    self.quarantined.setdefault(key, r)
                elif event == DATA_SUSPECT and r.get("found") != "nonfinite":
                    for k, _ in _keys(r):
                        self._suspects.setdefault(k, {}).setdefault(r["replica"], r)

    def marks(self) -> dict[str, list[int]]:
        """What a trainer started now must know (``TrainerActor``'s ``data_marks``)."""
        with self._lock:
            poisoned = sorted(self.poisoned.items())
            return {
                "poisoned": [k for k, e in poisoned if e == "unreadable"],
                "poisoned_nonfinite": [k for k, e in poisoned if e == "nonfinite"],
                "quarantined": sorted(self.quarantined),
            }

    def poison(self, key: int, effect: str = "unreadable") -> None:
        """The ``poison_data`` fault: the data of ``key`` crashes every step that reads it (or
        gives it a non-finite loss: ``effect = "nonfinite"``)."""
        from harness.rank.actors import poison_data

        with self._lock:
            self.poisoned[key] = effect
        self._send(poison_data, key, effect)

    def on_record(self, r: Record) -> None:
        """A journal sink: counts each ``data.suspect``, quarantines at the second group; a
        rank's own ``data.quarantine`` (ids outside the vocabulary) goes to every group."""
        if r.get("event") == DATA_QUARANTINE and "rank" in r and isinstance(r.get("key"), int):
            self._found(r["key"], r)
            return
        if r.get("event") == SILENT_DIVERGENCE and r.get("action") == "data":
            self._vindicated(r)
            return
        if r.get("event") != DATA_SUSPECT or not isinstance(r.get("replica"), int):
            return
        if r.get("found") == "nonfinite":
            self._nonfinite_suspected(r)
            return
        for key, seq in _keys(r):
            self._suspected(key, r["replica"], r, seq)

    def _nonfinite_suspected(self, r: Record) -> None:
        step = int(r.get("step", 0))
        with self._lock:
            self._nonfinite.setdefault((r["replica"], step), []).append(r)
            for old in [k for k in self._nonfinite if k[1] < step - NONFINITE_KEEP_STEPS]:
                del self._nonfinite[old]

    def _vindicated(self, v: Record) -> None:
        """The checksums of step ``v["step"]`` agreed: what the suspects named is quarantined."""
        from harness.rank.actors import quarantine_data

        step = int(v.get("step", 0))
        found: dict[int, Record] = {}
        with self._lock:
            for replica in v.get("suspects") or ():
                for r in self._nonfinite.pop((replica, step), []):
                    for key, seq in _keys(r):
                        if key in self.quarantined or key in found:
                            continue
                        found[key] = {
                            **{k: x for k, x in seq.items() if k != "key"},
                            "key": key,
                            "groups": sorted(v.get("suspects") or ()),
                            "steps": [step],
                            "found": "nonfinite",
                            "what": f"a non-finite loss, on weights every group's checksum of "
                            f"step {step} shows equal",
                        }
            self.quarantined.update(found)
        if not found:
            return
        for record in found.values():
            self._journal.emit(DATA_QUARANTINE, **record)
            self._say(f"quarantined {describe(record)}")
        self._send(quarantine_data, sorted(found))

    def _found(self, key: int, r: Record) -> None:
        from harness.rank.actors import quarantine_data

        with self._lock:
            if key in self.quarantined:
                return
            self.quarantined[key] = r
        self._send(quarantine_data, [key])
        self._say(f"quarantined {describe(r)}")

    def _suspected(self, key: int, replica: int, r: Record, seq: dict[str, Any]) -> None:
        from harness.rank.actors import quarantine_data

        with self._lock:
            if key in self.quarantined:
                again = True  # a group that missed it (started while it was sent): once more
            else:
                again = False
                by = self._suspects.setdefault(key, {})
                by.setdefault(replica, r)
                if len(by) < GROUPS_TO_QUARANTINE:
                    return
                record = {
                    **{k: v for k, v in seq.items() if k != "key"},
                    "key": key,
                    "groups": sorted(by),
                    "what": r.get("what", ""),
                    "steps": sorted({int(x.get("step", 0)) for x in by.values()}),
                }
                self.quarantined[key] = record
        if again:
            self._send(quarantine_data, [key])
            return
        self._journal.emit(DATA_QUARANTINE, **record)
        self._send(quarantine_data, [key])
        self._say(f"quarantined {describe(record)}")


def _keys(r: Record) -> list[tuple[int, dict[str, Any]]]:
    """(key, sequence) of each sequence a ``data.suspect`` record names."""
    if not isinstance(r.get("replica"), int):
        return []
    return [
        (seq["key"], seq)
        for seq in r.get("sequences") or ()
        if isinstance(seq, dict) and isinstance(seq.get("key"), int)
    ]


def describe(record: Record) -> str:
    """One line about a ``data.quarantine`` record: what, where, who met it."""
    if "document" in record:
        where = (
            f"chunk {record['key']} of the corpus (offset {record['offset']}, document "
            f"{record['document']}, offset {record['in_document']} in it)"
        )
    else:
        where = f"sequence {record['key']}"
    groups = ", ".join(str(g) for g in record.get("groups", ()))
    if record.get("found") == "vocabulary":
        return f"{where}: {record.get('what', '')}, found by group {groups} before its pass"[:400]
    if record.get("found") == "nonfinite":
        return f"{where}: group {groups} met {record.get('what', '')}"[:400]
    return f"{where}: groups {groups} failed on it with {record.get('what', '')}"[:400]
