"""How each run ended, in the report, from the journal alone: where a user reads why a run failed.

Per run (a policy, or a piece of the control run: ``control-1``, ...), from its records:

* ``status``, ``reason`` and ``steps`` of its last ``job.end`` (``"unknown"`` with no
  ``job.end``: the runner was killed before it could write one);
* ``stall``: the ``job.stall`` record of a job that committed no step for
  ``timeouts.no_progress`` while its groups kept aborting (``harness.job.stall``): ``seconds``,
  ``aborts``, ``replicas``, ``endpoint`` (the ``host:port`` the errors name, or None),
  ``error_type``, ``error`` (the last one) and ``diagnosis`` (what the console said); None if
  the job did not stall;
* ``preflight_failed``: every failed ``preflight`` round (``harness.job.preflight``): the job's
  first (``host`` None: the job stopped before training) or that of a host that joined later
  (``host``: it was kept out, the job trained on), with its table (``reason``) and its failed
  paths;
* ``kept_out``: the hosts whose last round failed (none passed after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dashboards.metrics import split_by_policy
from harness.job.stall import JOB_STALL
from runtime.journal import JOB_END, PREFLIGHT

Record = Mapping[str, Any]

_STALL_FIELDS = ("seconds", "aborts", "replicas", "endpoint", "error_type", "error", "diagnosis")
_PATH_FIELDS = ("src", "dst", "address", "port", "outcome", "detail")


def outcome_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Per run: how it ended (module doc); a run is a policy, or a piece of the control run
    (``control-1``, ...)."""
    runs: dict[str, list[Record]] = {}
    for policy, recs in split_by_policy(records).items():
        for r in recs:
            piece = r.get("control_run")
            runs.setdefault(policy if piece is None else f"{policy}-{piece}", []).append(r)
    return {run: _outcome(recs) for run, recs in runs.items()}


def _outcome(records: Sequence[Record]) -> dict[str, Any]:
    ends = [r for r in records if r.get("event") == JOB_END]
    stalls = [r for r in records if r.get("event") == JOB_STALL]
    rounds = [r for r in records if r.get("event") == PREFLIGHT and r.get("status") != "skipped"]
    end = ends[-1] if ends else {}
    last_round: dict[str, str] = {}  # host -> the status of its last round of its own
    for r in rounds:
        if r.get("host"):
            last_round[str(r["host"])] = str(r.get("status"))
    return {
        "status": end.get("status", "unknown"),
        "reason": end.get("reason") or ("" if ends else "no job.end record"),
        "steps": end.get("steps", 0),
        "stall": {k: stalls[-1].get(k) for k in _STALL_FIELDS} if stalls else None,
        "preflight_failed": [
            {
                "host": r.get("host"),
                "t": r.get("t"),
                "seconds": r.get("seconds"),
                "paths": r.get("paths"),
                "failed": r.get("failed"),
                "reason": r.get("reason", ""),
                "failed_paths": [
                    {k: c.get(k) for k in _PATH_FIELDS}
                    for c in r.get("matrix") or ()
                    if isinstance(c, Mapping) and c.get("outcome") != "ok"
                ],
            }
            for r in rounds
            if r.get("status") == "failed"
        ],
        "kept_out": sorted(h for h, status in last_round.items() if status == "failed"),
    }


def render_outcome(outcome: Mapping[str, Any]) -> list[str]:
    """The "How the run ended" section of the Markdown report (empty without runs)."""
    if not outcome:
        return []
    lines = ["## How the run ended", ""]
    for policy, o in outcome.items():
        lines.append(f"- `{policy}`: **{o['status']}**, {o['steps']} step(s) committed")
        stall = o.get("stall")
        shown: set[Any] = set()
        if stall:
            ep = stall.get("endpoint")
            what = f" ({stall['error_type']})" if stall.get("error_type") else ""
            lines.append(
                f"  - stalled: no step committed for {_num(stall.get('seconds'))} s, "
                f"{stall.get('aborts')} aborted step(s) of replica group(s) "
                f"{', '.join(str(r) for r in stall.get('replicas') or []) or '?'}; failing "
                f"endpoint: {f'`{ep}`' if ep else 'none named in the errors'}{what}"
            )
            lines.append(f"  - diagnosis: {stall.get('diagnosis')}")
            shown.add(stall.get("diagnosis"))
        for p in o.get("preflight_failed") or ():
            where = (
                f"host {p['host']} (joined late) was kept out, the job trained on"
                if p.get("host")
                else "the job stopped before training"
            )
            lines += [f"  - preflight failed, {where}:", *_block(p.get("reason") or "")]
            shown.add(p.get("reason"))
        if o.get("kept_out"):
            lines.append(f"  - kept out by their preflight at the end: {', '.join(o['kept_out'])}")
        reason = o.get("reason") or ""
        if reason and reason not in shown and o["status"] != "ok":
            lines += ["  - reason:", *_block(reason)]
    return [*lines, ""]


def _block(text: str) -> list[str]:
    """``text`` as a code block inside a list item (tables keep their columns)."""
    return ["", "    ```", *(f"    {ln}" for ln in text.splitlines()), "    ```", ""]


def _num(x: Any) -> str:
    return f"{x:.0f}" if isinstance(x, int | float) else "?"
