"""Which sequences of the data stream a job trained, skipped or trained twice, from its journal.

A pure function of the journal's ``step.commit`` records (``harness.rank.trainer`` writes, per rank
and
committed step, ``seqs``: the global sequence ranges ``[first, end)`` that step trained as far as
that rank knows, and ``seq_due``: every sequence below it should have been trained by then; see
``harness.rank.data`` for both data policies).

Definitions (per recovery policy, the ``policy`` stamp of the journal's records):

* a step's trained set is the union of the ranges in its commit records; a step number committed
  again after a rollback (``full_restart`` resumes from a checkpoint) counts once, with the
  ranges of its latest commit per rank: the same step re-trains the same data;
* ``due``: the largest ``seq_due`` of the steps up to the last step *but one* (the last step's
  records may be incomplete when the job was stopped mid-step);
* ``skipped``: sequences below ``due`` that no step trained; ``trained_twice``: sequences that
  two different steps trained; ``skipped_fraction`` = skipped / due.

Records without ``seqs`` (journals from before this field) are not counted; a policy whose
records all lack it is left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

STEP_COMMIT = "step.commit"


def coverage(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{policy: {"data_policy", "due", "trained", "skipped", "trained_twice",
    "skipped_fraction"}}`` from journal records (any order)."""
    # (policy) -> step -> (replica, rank) -> (t, ranges)
    latest: dict[str, dict[int, dict[tuple[Any, Any], tuple[float, list]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    dues: dict[str, dict[int, int]] = defaultdict(dict)
    data_policy: dict[str, str] = {}
    for r in records:
        if r.get("event") != STEP_COMMIT or r.get("seqs") is None:
            continue
        policy = str(r.get("policy", "?"))
        step = int(r["step"])
        key = (r.get("replica"), r.get("rank"))
        t = float(r.get("t", 0.0))
        prev = latest[policy][step].get(key)
        if prev is None or t >= prev[0]:
            latest[policy][step][key] = (t, r["seqs"])
        dues[policy][step] = max(dues[policy].get(step, 0), int(r.get("seq_due", 0)))
        data_policy.setdefault(policy, str(r.get("data_policy", "skip")))
    out: dict[str, dict[str, Any]] = {}
    for policy, steps in latest.items():
        last = max(steps)
        counted = [s for s in steps if s < last] or [last]
        due = max(dues[policy][s] for s in counted)
        times: dict[int, int] = defaultdict(int)  # sequence -> steps that trained it
        for s in counted:
            step_set: set[int] = set()
            for _, ranges in steps[s].values():
                for first, end in ranges:
                    step_set.update(range(int(first), int(end)))
            for i in step_set:
                times[i] += 1
        trained = sum(1 for i in times if i < due)
        out[policy] = {
            "data_policy": data_policy[policy],
            "due": due,
            "trained": trained,
            "skipped": due - trained,
            "trained_twice": sum(1 for n in times.values() if n > 1),
            "skipped_fraction": round((due - trained) / due, 4) if due else 0.0,
        }
    return out
