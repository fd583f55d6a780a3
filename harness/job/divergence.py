"""Silent divergence, found online: the groups' weight checksums (and losses) for the same step,
compared by majority as the commit records arrive. Pure: no I/O, no clock; the controller side
that acts on a :class:`Verdict` is ``harness.job.silent``.

Evidence, per (step, rank index): each group's commit record of that step, from its rank of that
index (ranks of one group hold the same weights, but a bit flipped in rank 1 only is caught only
by comparing rank 1 with the other groups' rank 1). A (step, rank) is judged once as many groups
have reported it as the record says took part (``participants``):

* **checksum** (every ``CHECKSUM_EVERY`` steps, ``harness.rank.trainer``): one value everywhere
  is agreement (the step becomes :attr:`Divergence.last_agreed`); otherwise the groups holding
  the most common value are the majority if they are more than half, and the others the
  suspects (action ``heal``). No strict majority (two groups that differ, three that all
  differ): nobody can tell which is right, every group is a suspect and the action is
  ``rollback`` to the last step whose checksums agreed.
* **non-finite loss** (every step): the groups whose loss is NaN or infinite are suspects
  when at least one group's loss is finite; when every group's is non-finite the training
  itself diverged, which is not a silent fault of one replica, and nothing is decided. Every
  group checksums a step in which any group's loss was not finite (``Asks.nonfinite``,
  ``harness.rank.group_layout``), and the checksums decide: where they all agree, the suspects'
  weights are the others' and the data is to blame (action ``data``: nobody is condemned, the
  sequences it named are quarantined, ``harness.job.poison``); where they differ (or a group
  sent none), the suspects are healed (a non-finite loss on weights that differ is evidence in
  itself, so with two groups the finite one is believed).

Not guaranteed: corruption that spreads before it is seen is not told apart. A group healed from
a corrupted one before the next checksum step votes with it (the kill of a third group between
the flip and the checksum, say), and two corrupted votes outvote one healthy one. A flipped
*gradient* before the cross-group allreduce reaches every replica identically: no comparison of
replicas can see it (docs: "Silent failures").

Once a verdict names a group, the records of its condemned processes are ignored: they keep
committing until they are killed, and must not raise the same alarm again.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

#: Steps kept waiting for their last report; older ones are dropped (a group that left).
KEEP_STEPS = 64


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What :meth:`Divergence.on_commit` decided for one step."""

    step: int
    rank: int
    cause: Literal["checksum", "nonfinite"]
    action: Literal["heal", "rollback", "data"]
    suspects: tuple[int, ...]
    majority: tuple[int, ...]
    rollback_to: int | None  # for ``rollback``: the last step whose checksums agreed
    values: dict[int, str]  # replica -> checksum, or repr of the loss


@dataclass
class _Step:
    participants: int
    checksums: dict[int, str] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    judged_checksum: bool = False
    judged_loss: bool = False


class Divergence:
    """Feed every ``step.commit`` to :meth:`on_commit`; it returns a verdict when one is due."""

    def __init__(self) -> None:
        self._steps: dict[tuple[int, int], _Step] = {}
        self._latest: dict[tuple[int, int], str] = {}  # (replica, rank) -> its newest process
        self._condemned: set[str] = set()
        self._named: dict[int, set[int]] = {}  # step -> groups a verdict named at it
        self.last_agreed = 0  # the last step every reporting group's checksums agreed at

    def restart(self) -> None:
        """The job went back to a checkpoint: step numbers repeat, pending evidence is void."""
        self._steps.clear()
        self._named.clear()

    def on_commit(
        self,
        *,
        replica: int,
        rank: int,
        step: int,
        checksum: str | None,
        loss: float | None,
        participants: int,
        proc: str | None = None,
    ) -> Verdict | None:
        if proc is not None:
            if proc in self._condemned:
                return None
            self._latest[(replica, rank)] = proc
        key = (step, rank)
        entry = self._steps.get(key)
        if entry is None:
            entry = self._steps[key] = _Step(participants=max(1, participants))
            for old in [k for k in self._steps if k[0] < step - KEEP_STEPS]:
                del self._steps[old]
            for old_step in [k for k in self._named if k < step - KEEP_STEPS]:
                del self._named[old_step]
        entry.participants = max(entry.participants, participants)
        if checksum is not None:
            entry.checksums[replica] = checksum
        if loss is not None:
            entry.losses[replica] = float(loss)
        verdict = self._judge_loss(step, rank, entry) or self._judge_checksum(step, rank, entry)
        if verdict is None:
            return None
        named = self._named.setdefault(step, set())
        if set(verdict.suspects) <= named:
            return None  # another rank index of the same groups, same step: one alarm
        named.update(verdict.suspects)
        if verdict.action != "data":
            self._condemn(verdict.suspects)
        return verdict

    def _condemn(self, replicas: tuple[int, ...]) -> None:
        for (replica, _rank), proc in self._latest.items():
            if replica in replicas:
                self._condemned.add(proc)

    def _judge_loss(self, step: int, rank: int, e: _Step) -> Verdict | None:
        if e.judged_loss or len(e.losses) < e.participants:
            return None
        e.judged_loss = True
        bad = tuple(sorted(r for r, v in e.losses.items() if not math.isfinite(v)))
        good = tuple(sorted(r for r, v in e.losses.items() if math.isfinite(v)))
        if not bad or not good:
            return None  # all finite, or the training itself diverged everywhere
        e.judged_checksum = True  # one verdict per step
        checked = set(e.checksums) >= set(e.losses) and len(set(e.checksums.values())) == 1
        if checked:
            self.last_agreed = max(self.last_agreed, step)
        return Verdict(
            step=step,
            rank=rank,
            cause="nonfinite",
            action="data" if checked else "heal",
            suspects=bad,
            majority=good,
            rollback_to=None,
            values={r: repr(v) for r, v in e.losses.items()},
        )

    def _judge_checksum(self, step: int, rank: int, e: _Step) -> Verdict | None:
        if e.judged_checksum or len(e.checksums) < e.participants:
            return None
        e.judged_checksum = True
        counts = Counter(e.checksums.values())
        if len(counts) == 1:
            self.last_agreed = max(self.last_agreed, step)
            return None
        value, n = counts.most_common(1)[0]
        groups = sorted(e.checksums)
        if 2 * n > len(e.checksums):
            majority = tuple(r for r in groups if e.checksums[r] == value)
            suspects = tuple(r for r in groups if e.checksums[r] != value)
            action: Literal["heal", "rollback"] = "heal"
        else:
            majority, suspects, action = (), tuple(groups), "rollback"
        return Verdict(
            step=step,
            rank=rank,
            cause="checksum",
            action=action,
            suspects=suspects,
            majority=majority,
            rollback_to=self.last_agreed if action == "rollback" else None,
            values=dict(e.checksums),
        )
