"""The experiment report: hypotheses checked and figures rendered, computed only from the journal.

``ftharness report RUN_DIR [--html] [--json]`` recomputes everything from the journal file(s)
under RUN_DIR (and, for ``no_orphans`` and ``no_shm_left``, the ``postrun.json`` the runner
wrote next to each journal once its job had stopped: experiments/postrun.py); the hypotheses
come from ``RUN_DIR/experiment.toml`` (the runner saves a copy of the experiment there) when it
exists. Exit status: 0 all hypotheses hold (or none were set),
1 one failed, 2 no journal.

Why this module is longer than 500 lines: it is the one command that turns a run folder into every
report (markdown, JSON, HTML), with the experiment's hypotheses checked against the journal; the
figures themselves are ``dashboards.metrics``, and what remains is the verification and its
rendering, which change together.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dashboards import names as N
from dashboards.metrics import CONTROL, split_by_policy, summarize
from experiments import postrun as postrun_files
from experiments.report_data import data_summary, dropped_summary, render_data, render_dropped
from experiments.report_outcome import outcome_summary, render_outcome
from experiments.report_quality import heldout_hypothesis, heldout_summary, render_heldout
from experiments.report_silent import (
    render_silent,
    silent_summary,
    unexplained,
    without_healed_divergence,
)
from experiments.spec import ExperimentError, Hypotheses, parse_hypotheses
from harness.tomlfile import read_toml
from runtime.journal import (
    DROPPED,
    ENDINGS,
    FAULT_HEAL,
    FAULT_INJECT,
    JOB_END,
    JOB_RESTART,
    JOB_START,
    OVERTAKEN,
    RECOVERY_PHASE,
    STEP_COMMIT,
    read_journal,
)

Record = dict[str, Any]
Result = dict[str, Any]

# threshold name -> (what it reads from a policy summary, "min" | "max", unit)
_THRESHOLDS = {
    "goodput_min": ("goodput", "min", ""),
    "recovery_p95_max_s": ("participate_s", "max", " s"),
    "detection_p95_max_s": ("detection_s", "max", " s"),
    "stall_p95_max_s": ("stall_s", "max", " s"),
    "steps_lost_max": ("steps_lost", "max", " steps"),
    "skipped_max": ("skipped", "max", " sequences"),
}


# -- hypotheses ---------------------------------------------------------------------------------


def _loss_finite(policy: str, records: Sequence[Record]) -> Result:
    bad = [
        r for r in records
        if r.get("event") == STEP_COMMIT and r.get("loss") is not None
        and not math.isfinite(float(r["loss"]))
    ]  # fmt: skip
    n = sum(1 for r in records if r.get("event") == STEP_COMMIT and r.get("loss") is not None)
    if n == 0:
        return _result(f"loss_finite[{policy}]", False, "no committed step reported a loss")
    if bad:
        b = bad[0]
        return _result(
            f"loss_finite[{policy}]", False,
            f"{len(bad)} of {n} committed losses not finite; first: replica {b.get('replica')} "
            f"step {b.get('step')} loss {b.get('loss')}",
        )  # fmt: skip
    return _result(f"loss_finite[{policy}]", True, f"all {n} committed losses finite")


def _steps_rise(policy: str, records: Sequence[Record]) -> Result:
    commits = [r for r in records if r.get("event") == STEP_COMMIT]
    faults = [r for r in records if r.get("event") == FAULT_INJECT]
    name = f"committed_steps_rise[{policy}]"
    if not commits:
        return _result(name, False, "no step was committed")
    stuck = []
    for f in faults:
        before = max((c["step"] for c in commits if c["t"] <= f["t"]), default=-1)
        if not any(c["step"] > before for c in commits if c["t"] > f["t"]):
            stuck.append(f"{f.get('fault_id')} ({f.get('kind')}) at step {before}")
    if stuck:
        return _result(name, False, "no progress after " + ", ".join(stuck))
    top = max(c["step"] for c in commits)
    return _result(name, True, f"progress after all {len(faults)} faults; reached step {top}")


def _replicas_equal(policy: str, records: Sequence[Record]) -> Result:
    # The checksum each replica committed for each (incarnation, step, rank). A whole-job
    # restart (job.restart) starts a new incarnation: a step redone after it is compared with
    # the other replicas' redone step, never with a commit from before the restart.
    last: dict[tuple[Any, Any, Any], dict[Any, str]] = defaultdict(dict)
    incarnation = 0
    for r in records:
        if r.get("event") == JOB_RESTART:
            incarnation += 1
        elif r.get("event") == STEP_COMMIT and r.get("checksum") is not None:
            last[(incarnation, r.get("step"), r.get("rank"))][r.get("replica")] = r["checksum"]
    name = f"replicas_equal_after_heal[{policy}]"
    apart = ranks_apart(records)
    if apart:
        return _result(name, False, apart)
    stray = unexplained(records)
    if stray:
        d = stray[0]
        return _result(
            name, False,
            f"{len(stray)} divergence(s) that no injected fault explains (no fault.bitflip "
            f"before them); first: step {d.get('step')} ({d.get('cause')}), replica(s) "
            f"{d.get('suspects')}, action {d.get('action')}",
        )  # fmt: skip
    compared = {k: v for k, v in last.items() if len(v) >= 2}
    if not compared:
        return _result(name, False, "no step was committed with a checksum by two replicas")
    bad = sorted(
        (k for k, v in compared.items() if len(set(v.values())) > 1),
        key=lambda k: (k[0], k[1] is None, k[1]),
    )
    if bad:
        _, step, rank = bad[0]
        return _result(
            name, False,
            f"{len(bad)} of {len(compared)} steps differ across replicas; first: step {step} "
            f"rank {rank}: {compared[bad[0]]}",
        )  # fmt: skip
    return _result(name, True, f"checksums equal across replicas at all {len(compared)} steps")


def ranks_apart(records: Sequence[Record]) -> str | None:
    """Where the ranks of one group committed different steps together, or None. Each rank's
    commits are cut where its process changes (its group restarted, ranks together); the k-th
    process of each rank of a group ran together, and their i-th commits must name one step (a
    rank killed before journaling its last commit only shortens its run)."""
    runs: dict[tuple[Any, Any], list[tuple[Any, list[Any]]]] = defaultdict(list)
    for r in records:
        if r.get("event") != STEP_COMMIT:
            continue
        per = runs[(r.get("replica"), r.get("rank"))]
        if not per or per[-1][0] != r.get("proc"):
            per.append((r.get("proc"), []))
        per[-1][1].append(r.get("step"))
    groups: dict[Any, dict[Any, list[tuple[Any, list[Any]]]]] = defaultdict(dict)
    for (replica, rank), per in runs.items():
        groups[replica][rank] = per
    for replica, unsorted in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ranks = dict(sorted(unsorted.items(), key=lambda kv: str(kv[0])))
        if len(ranks) < 2:
            continue
        for k, together in enumerate(zip(*ranks.values(), strict=False)):
            for i, steps in enumerate(zip(*(steps for _, steps in together), strict=False)):
                if len(set(steps)) > 1:
                    return (
                        f"the ranks of replica {replica} committed different steps together "
                        f"(process {k + 1}, commit {i + 1}): {dict(zip(ranks, steps, strict=True))}"
                    )
    return None


# -- the soak hypotheses: nothing lost, nothing left behind -------------------------------------

#: How many problems a failure message names before "and N more".
_SHOWN = 5


def _listed(problems: Sequence[str]) -> str:
    more = len(problems) - _SHOWN
    return "; ".join(problems[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")


def _clock(records: Sequence[Record]) -> Any:
    """Formats a time as seconds since the run's first ``job.start`` (or first record)."""
    starts = [r["t"] for r in records if r.get("event") == JOB_START]
    t0 = min(starts) if starts else (records[0]["t"] if records else 0.0)
    return lambda t: f"t+{t - t0:.1f} s"


def _every_fault_recovered(
    policy: str, records: Sequence[Record], policy_summary: Mapping[str, Any] | None
) -> Result:
    """Every ``fault.inject`` fired (no ``fault.heal`` saying ``fire failed``), each recovery it
    explains reached ``participating``, and each group it hit (its target replica and its
    recoveries' groups; any group for a fault that hit none, such as a quorum-service crash
    absorbed without a failure) committed a step after its ``fault.heal``. A fault that caused
    no failure at all (a straggler, an absorbed collective abort) passes on that last test."""
    name = f"every_fault_recovered[{policy}]"
    at = _clock(records)
    faults = [r for r in records if r.get("event") == FAULT_INJECT]
    if not faults:
        return _result(name, False, "no fault was injected")
    heals: dict[Any, Record] = {}
    for r in records:
        if r.get("event") == FAULT_HEAL:
            heals.setdefault(r.get("fault_id"), r)
    recs = (policy_summary or {}).get("recoveries", [])
    commits = [r for r in records if r.get("event") == STEP_COMMIT]
    problems: list[str] = []
    no_recovery: list[str] = []
    overtaken: list[str] = []
    dropped: list[str] = []
    ended_faults: set[Any] = set()  # faults with a recovery that ended without rejoining
    for f in faults:
        fid, kind = f.get("fault_id"), f.get("kind")
        label = f"{fid} ({kind}) at {at(f['t'])}"
        heal = heals.get(fid)
        error = str((heal or {}).get("error") or "")
        if error.startswith("fire failed"):
            problems.append(f"{label} did not fire: {error}")
            continue
        mine = [r for r in recs if r.get("fault_id") == fid]
        if not mine:
            no_recovery.append(f"{fid} ({kind})")
        # the job ended while the group rejoined (runtime.journal.OVERTAKEN): nothing to rejoin;
        # or the group was dropped for a crash loop of its own (DROPPED): it never rejoins
        ended: set[Any] = set()
        for phase, listed in ((OVERTAKEN, overtaken), (DROPPED, dropped)):
            gone = {r.get("replica") for r in mine if phase in (r.get("phases") or {})}
            listed += [f"{fid} ({kind}) of replica {g}" for g in sorted(gone, key=str)]
            ended |= gone
        if ended:
            ended_faults.add(fid)
        mine = [r for r in mine if r.get("replica") not in ended]
        for r in mine:
            # A recovery the tracker never wrote (``derived``, read off failures by
            # dashboards/metrics.py) of the quorum service has no group of its own, so it can
            # never be seen participating: the commit test below judges it instead.
            if r.get("derived") and r.get("replica") is None:
                continue
            if r.get("participate_s") is None:
                phases = r.get("phases") or {}
                last = max(phases, key=phases.get) if phases else "none"
                problems.append(
                    f"{label}: recovery {r['recovery_id']} of replica {r.get('replica')} never "
                    f"reached participating (last phase: {last})"
                )
        since = heal["t"] if heal is not None else f["t"]
        target = f.get("target") or {}
        groups = ({target.get("replica")} | {r.get("replica") for r in mine}) - ended
        groups.discard(None)
        back = {c.get("replica") for c in commits if c["t"] > since}
        if groups and not groups <= back:
            missing = sorted(groups - back, key=str)
            problems.append(
                f"{label}: replica {', '.join(map(str, missing))} committed no step after the "
                f"{'heal' if heal is not None else 'fault'} at {at(since)}"
            )
        elif not groups and not back:
            problems.append(f"{label}: no group committed a step after {at(since)}")
    if problems:
        return _result(
            name,
            False,
            f"{len(problems)} problem(s) over {len(faults)} faults: {_listed(problems)}",
            problems,
        )
    reached = len(faults) - len(no_recovery) - len(ended_faults)
    what = "recovered" if not dropped else "recovered or their group dropped"
    detail = (
        f"all {len(faults)} faults {what}: {reached} through recoveries that reached participating"
    )
    if no_recovery:
        detail += (
            f"; {len(no_recovery)} caused no recovery and the group(s) they hit committed after "
            f"the heal: {_listed(no_recovery)}"
        )
    if overtaken:
        detail += (
            f"; {len(overtaken)} overtaken by the job's end (the other groups finished the last "
            f"step while the group rejoined): {_listed(overtaken)}"
        )
    if dropped:
        detail += (
            f"; {len(dropped)} ended in the group's drop (a crash loop of its own; the others "
            f"trained on): {_listed(dropped)}"
        )
    return _result(name, True, detail)


def _problems_of(policy: str, problems: Sequence[str], policies: Sequence[str]) -> list[str]:
    """The skipped-line problems of ``policy``'s journal: those in a file under a folder named
    for it (the runner's layout), and those no policy's folder claims."""
    out = []
    for p in problems:
        m = re.match(r"^(.*):(\d+): ", p)
        folder = Path(m.group(1)).parent.name if m else ""
        if folder == policy or folder not in policies:
            out.append(p)
    return out


def _journal_complete(policy: str, records: Sequence[Record], problems: Sequence[str]) -> Result:
    """No line skipped, a ``job.start`` and a ``job.end``, a ``fault.heal`` for every
    ``fault.inject`` (and none without one), and every recovery that began with ``detected``
    either reached ``participating`` or was still open at ``job.end`` (named in the detail)."""
    name = f"journal_complete[{policy}]"
    at = _clock(records)
    bad: list[str] = []
    if problems:
        bad.append(f"{len(problems)} line(s) skipped: {_listed(problems)}")
    starts = [r for r in records if r.get("event") == JOB_START]
    ends = [r for r in records if r.get("event") == JOB_END]
    if not starts:
        bad.append("no job.start record")
    if not ends:
        bad.append("no job.end record (the runner did not finish writing the journal)")
    elif starts and max(r["t"] for r in ends) < max(r["t"] for r in starts):
        bad.append("the last job.start has no job.end after it")
    injected = {r.get("fault_id"): r for r in records if r.get("event") == FAULT_INJECT}
    healed = {r.get("fault_id") for r in records if r.get("event") == FAULT_HEAL}
    unhealed = [
        f"{i} ({r.get('kind')}) at {at(r['t'])}" for i, r in injected.items() if i not in healed
    ]
    if unhealed:
        bad.append(f"{len(unhealed)} fault.inject without fault.heal: {_listed(unhealed)}")
    stray = sorted(str(i) for i in healed - set(injected))
    if stray:
        bad.append(f"fault.heal without fault.inject: {_listed(stray)}")
    phases: dict[str, dict[str, float]] = defaultdict(dict)
    replica_of: dict[str, Any] = {}
    for r in records:
        if r.get("event") == RECOVERY_PHASE:
            rid = str(r.get("recovery_id"))
            phases[rid].setdefault(str(r.get("phase")), r["t"])
            replica_of.setdefault(rid, r.get("replica"))
    no_start = sorted(rid for rid, ph in phases.items() if "detected" not in ph)
    if no_start:
        bad.append(f"recovery phases without 'detected': {_listed(no_start)}")
    end_t = max((r["t"] for r in ends), default=None)
    open_at_end, never_closed = [], []
    for rid, ph in phases.items():
        if "participating" in ph or any(e in ph for e in ENDINGS) or "detected" not in ph:
            continue
        last = max(ph, key=ph.get)
        what = f"{rid} (replica {replica_of[rid]}, last phase {last} at {at(ph[last])})"
        (open_at_end if end_t is not None and end_t >= ph[last] else never_closed).append(what)
    if never_closed:
        bad.append(f"recoveries never closed and no job.end after them: {_listed(never_closed)}")
    if bad:
        return _result(name, False, "; ".join(bad), [*problems, *unhealed, *stray, *never_closed])
    closed = len(phases) - len(open_at_end)
    detail = (
        f"{len(records)} records, none skipped; job.start {len(starts)}, job.end {len(ends)}; "
        f"{len(injected)} faults, each healed; {closed} of {len(phases)} recoveries reached "
        "participating, were overtaken by the job's end or ended in a drop"
    )
    if open_at_end:
        detail += f"; open when the job ended: {_listed(open_at_end)}"
    return _result(name, True, detail)


def _postrun_missing(name: str) -> Result:
    return _result(
        name, False,
        "no post-run check recorded for this policy (postrun.json, written by `ftharness chaos` "
        "once the job has stopped)",
    )  # fmt: skip


def _no_orphans(policy: str, check: Mapping[str, Any] | None) -> Result:
    name = f"no_orphans[{policy}]"
    if check is None:
        return _postrun_missing(name)
    orphans = check.get("orphans") or []
    zombies = check.get("zombies") or []
    after = f"{check.get('waited_s', 0):.1f} s after the job stopped"

    def shown(procs: Sequence[Mapping[str, Any]]) -> str:
        return _listed(
            [f"pid {o['pid']} ({o.get('name')}: {o.get('cmdline') or '?'}; {o.get('source')})"
             for o in procs]
        )  # fmt: skip

    note = f" (not alive, but not reaped: {len(zombies)} zombie(s): {shown(zombies)})"
    if orphans:
        detail = f"{len(orphans)} process(es) still alive {after}: {shown(orphans)}"
        return _result(name, False, detail + (note if zombies else ""))
    detail = (
        f"{after}: none of the {check.get('journal_pids', 0)} pids of proc.start records and none "
        f"of the {check.get('new_descendants_seen', 0)} new descendants of the runner alive"
    )
    return _result(name, True, detail + (note if zombies else ""))


def _no_shm_left(policy: str, check: Mapping[str, Any] | None) -> Result:
    name = f"no_shm_left[{policy}]"
    if check is None:
        return _postrun_missing(name)
    left = check.get("shm_left") or []
    where = check.get("shm_dir", postrun_files.SHM_DIR)
    if left:
        return _result(
            name, False,
            f"{len(left)} snapshot segment(s) of the job's processes left in {where}: "
            f"{_listed(left)}",
        )  # fmt: skip
    return _result(name, True, f"no snapshot segment of the job's processes left in {where}")


def _threshold(name: str, bound: float, policy: str, summary: dict[str, Any]) -> Result:
    label = f"{name}[{policy}]"
    p = summary["policies"].get(policy)
    if p is None:
        return _result(label, False, f"policy {policy} did not run")
    key, sense, unit = _THRESHOLDS[name]
    if key == "goodput":
        value = p["goodput"]
    elif key == "steps_lost":
        value = sum(k["steps_lost"] for k in p["faults"].values())
    elif key == "skipped":
        value = (p.get("data") or {}).get("skipped")
    else:  # over the recoveries of injected faults, as the comparison
        value = p["all_faults"][key]["p95"]
    if value is None:
        return _result(label, False, f"no {key} measured")
    ok = value >= bound if sense == "min" else value <= bound
    op = ">=" if sense == "min" else "<="
    shown = f"p95 {key}" if name.endswith("p95_max_s") else key
    return _result(label, ok, f"{shown} = {value:.3g}{unit} (want {op} {bound:g}{unit})")


def _result(name: str, passed: bool, detail: str, problems: Sequence[str] = ()) -> Result:
    """One verdict; ``problems`` (report.json only) lists every problem the detail shortens."""
    out: Result = {"name": name, "passed": bool(passed), "detail": detail}
    if problems:
        out["problems"] = list(problems)
    return out


def evaluate_hypotheses(
    spec_hypotheses: Hypotheses | None,
    summary: dict[str, Any],
    records: Sequence[Record],
    *,
    journal_problems: Sequence[str] = (),
    postrun: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Result]:
    """Check each hypothesis per policy; a hypothesis with nothing to check against fails (an
    unverifiable claim is not a passed one). ``journal_problems``: the lines ``read_journal``
    skipped; ``postrun``: policy -> its post-run check (experiments/postrun.py)."""
    if spec_hypotheses is None:
        return []
    h = spec_hypotheses
    by_policy = split_by_policy(records)
    by_policy.pop(CONTROL, None)  # the yardstick, not a policy under test
    out: list[Result] = []
    for policy, recs in by_policy.items():
        repaired = without_healed_divergence(recs)  # a healed divergence: experiments.report_silent
        if h.loss_finite:
            out.append(_loss_finite(policy, repaired))
        if h.committed_steps_rise:
            out.append(_steps_rise(policy, recs))
        if h.replicas_equal_after_heal:
            out.append(_replicas_equal(policy, repaired))
        if h.every_fault_recovered:
            out.append(_every_fault_recovered(policy, recs, summary["policies"].get(policy)))
        if h.journal_complete:
            mine = _problems_of(policy, journal_problems, list(by_policy))
            out.append(_journal_complete(policy, recs, mine))
        if h.no_orphans:
            out.append(_no_orphans(policy, (postrun or {}).get(policy)))
        if h.no_shm_left:
            out.append(_no_shm_left(policy, (postrun or {}).get(policy)))
    for name, per in spec_hypotheses.thresholds.items():
        policies = list(by_policy) if "*" in per else []
        policies += [p for p in per if p != "*" and p not in policies]
        for policy in policies:
            bound = spec_hypotheses.bound(name, policy)
            assert bound is not None
            if name == "heldout_loss_within":  # experiments/report_quality.py
                held = summary.get("heldout") or heldout_summary(records)
                out.append(heldout_hypothesis(bound, policy, held))
                continue
            out.append(_threshold(name, bound, policy, summary))
    return out


# -- rendering ----------------------------------------------------------------------------------

#: The recovery figures' column headings: their labels in dashboards/names.py, in that order.
_LABELS = " | ".join(str(m.label) for m in N.RECOVERY_METRICS)


def _f(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}{unit}"
    return f"{x}{unit}"


def _stat(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.2f} / {s['p50']:.2f} / {s['p95']:.2f}"


def _throughput_lines(policy: str, p: Mapping[str, Any]) -> list[str]:
    """Committed samples/s, goodput (against the control run where there is one) and the data
    the policy skipped."""
    if policy == CONTROL:
        runs = ", ".join(_f(x) for x in p.get("control_runs") or [])
        return [
            f"- fault-free control: committed samples/s {_f(p['samples_per_s'])} (mean of its "
            f"pieces: {runs}); the goodput baseline of the other policies"
        ]
    if p.get("goodput_basis") == "control":
        spread = p["goodput_spread"]
        lines = [
            f"- committed samples/s: {_f(p['samples_per_s'])}; fault-free control: "
            f"{_f(p['control_samples_per_s'])}; **goodput {_f(p['goodput'])}** (control's "
            f"spread: {_f(spread['min'])}-{_f(spread['max'])})"
        ]
        if p.get("goodput_above_control"):
            lines.append(
                "- ⚠ goodput above the control beyond the control's spread: the control was "
                "disturbed, or groups that share CPUs ran faster while one was down (not "
                "possible when every group has devices of its own)"
            )
    else:
        lines = [
            f"- committed samples/s: {_f(p['samples_per_s'])}; fault-free stretch of this run: "
            f"{_f(p['baseline_samples_per_s'])}; **goodput {_f(p['goodput'])}** (no control run: "
            "against the stretch before the first fault, warm-up included)"
        ]
    d = p.get("data")
    if d:
        lines.append(
            f"- data (`{d['data_policy']}`): {d['skipped']} of {d['due']} sequences due were "
            f"never trained ({_f(100.0 * d['skipped_fraction'])} %); {d['trained_twice']} "
            "trained twice"
        )
    return lines


def render_markdown(summary: dict[str, Any], hypotheses_results: Sequence[Result]) -> str:
    """The report as Markdown: hypotheses, how each run ended (a stall's diagnosis, a failed
    preflight), then per policy the throughput, a per-fault-kind table and every recovery, then
    the comparison."""
    lines = ["# Chaos experiment report", ""]
    if hypotheses_results:
        ok = all(h["passed"] for h in hypotheses_results)
        lines += [f"## Hypotheses: {'all passed' if ok else 'FAILED'}", ""]
        lines += ["| | hypothesis | detail |", "|---|---|---|"]
        for h in hypotheses_results:
            lines.append(f"| {'✅' if h['passed'] else '❌'} | {h['name']} | {h['detail']} |")
        lines.append("")
    lines += render_outcome(summary.get("outcome") or {})  # how each run ended, and why
    for policy, p in summary["policies"].items():
        lines += [
            f"## Policy `{policy}`",
            "",
            f"- committed steps: {p['committed_steps']}; duration {_f(p['duration_s'], ' s')}",
            *_throughput_lines(policy, p),
            "",
        ]
        if p["faults"]:
            lines += [
                "Times in seconds, mean / p50 / p95 over the recoveries (a fault that took down "
                "several groups has one recovery per group; definitions: dashboards/metrics.py).",
                "",
                f"| fault | count | recovered | {_LABELS} | steps lost |",
                "|---|---|---|---|---|---|---|",
            ]
            for kind, k in p["faults"].items():
                none = k.get("no_recovery", 0)
                recovered = f"{k['recovered']}" + (f" ({none} took down no group)" if none else "")
                if k.get("overtaken"):
                    recovered += f" ({k['overtaken']} overtaken by the job's end)"
                if k.get("dropped"):
                    recovered += f" ({k['dropped']} ended in the group's drop)"
                lines.append(
                    f"| {kind} | {k['count']} | {recovered} | "
                    + " | ".join(_stat(k[str(m.quantity)]) for m in N.RECOVERY_METRICS)
                    + f" | {k['steps_lost']} |"
                )
            lines.append("")
        if p["recoveries"]:
            lines += [
                f"| recovery | fault | kind | replica | {_LABELS} | steps lost |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in p["recoveries"]:
                rid = r["recovery_id"] + (" (derived)" if r.get("derived") else "")
                lines.append(
                    f"| {rid} | {_f(r['fault_id'])} | {r['kind']} | {_f(r['replica'])} | "
                    + " | ".join(_f(r[str(m.quantity)], " s") for m in N.RECOVERY_METRICS)
                    + f" | {_f(r['steps_lost'])} |"
                )
            lines.append("")
    comp = summary.get("comparison")
    if comp:
        lines += [
            "## in_place vs full_restart (full_restart ÷ in_place)",
            "",
            f"- {N.PARTICIPATE.label}: x{_f(comp['participate_s_ratio'])}",
            f"- {N.SURVIVOR_STALL.label}: x{_f(comp['stall_s_ratio'])}",
            f"- {N.GOODPUT.label}: x{_f(comp['goodput_ratio'])}",
            "",
        ]
    lines += render_silent(summary.get("silent") or {})
    lines += render_data(summary.get("data") or {})
    lines += render_dropped(summary.get("dropped") or {})
    lines += render_heldout(summary.get("heldout"))
    lines.append("Computed from the run's journal only (definitions: dashboards/metrics.py).")
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path,
    records: Sequence[Record],
    hypotheses: Hypotheses | None,
    *,
    journal_problems: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``report.md`` and ``report.json`` into ``out_dir``; return the report
    ``{"summary", "hypotheses", "passed"}``. The post-run checks are read from the
    ``postrun.json`` files under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    summary["silent"] = silent_summary(records)
    summary["data"] = data_summary(records)  # experiments/report_data.py
    summary["dropped"] = dropped_summary(records)
    summary["heldout"] = heldout_summary(records)
    summary["outcome"] = outcome_summary(records)  # experiments/report_outcome.py
    results = evaluate_hypotheses(
        hypotheses,
        summary,
        records,
        journal_problems=journal_problems,
        postrun=postrun_files.load(out),
    )
    report = {
        "summary": summary,
        "hypotheses": results,
        "passed": all(h["passed"] for h in results),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(summary, results), encoding="utf-8")
    return report


# -- the CLI ------------------------------------------------------------------------------------


def load_run_hypotheses(run_dir: Path) -> Hypotheses | None:
    """The ``[hypotheses]`` of the experiment copy saved in ``run_dir`` (None if absent).
    ExperimentError if it cannot be read or is not a valid table of hypotheses."""
    path = run_dir / "experiment.toml"
    if not path.exists():
        return None
    data = read_toml(path, "experiment copy", ExperimentError)
    table = data.get("hypotheses", {})
    if not isinstance(table, dict):
        raise ExperimentError(f"{path}: hypotheses: must be a table, got {type(table).__name__}")
    return parse_hypotheses(table, source=path)


def main(args: argparse.Namespace) -> int:
    """``ftharness report RUN_DIR [--html] [--json]``."""
    target = Path(args.run_dir)
    if not target.exists():
        print(f"ftharness report: {target} does not exist", file=sys.stderr)
        return 2
    out_dir = target if target.is_dir() else target.parent
    problems: list[str] = []
    try:
        records = read_journal(target, problems=problems)
    except OSError as e:  # the file's contents never raise; a file that cannot be opened does
        print(f"ftharness report: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"ftharness report: no journal records under {target}", file=sys.stderr)
        return 2
    if problems:  # said, not fatal: the report is computed from the records every reader can use
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"ftharness report: skipped journal line {problems[0]}{more}", file=sys.stderr)
    try:
        hypotheses = load_run_hypotheses(out_dir)
    except ExperimentError as e:
        print(f"ftharness report: {e}", file=sys.stderr)
        return 2
    report = write_report(out_dir, records, hypotheses, journal_problems=problems)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_markdown(report["summary"], report["hypotheses"]), end="")
        print(f"wrote {out_dir / 'report.md'} and {out_dir / 'report.json'}")
    if getattr(args, "html", False):
        from dashboards.html import write_dashboard

        path = write_dashboard(out_dir, records, report["summary"])
        if not getattr(args, "json", False):
            print(f"wrote {path or out_dir / 'dashboard.html'}")
    return 0 if report["passed"] else 1
