"""What SLURM's commands print, read (pure: no command is run here): node lists, node states,
job states and ``srun``'s complaints. ``runtime.launchers.slurm`` runs the commands."""

from __future__ import annotations

import re

#: Node states (``sinfo %T``, lower case, flags stripped) that mean: never use this node.
UNUSABLE = frozenset(
    {"down", "drain", "drained", "draining", "fail", "failing", "future", "unknown", "inval"}
)


#: Job states (``squeue %T``) in which the allocation is over: its steps are killed, no new one
#: starts. (COMPLETING: the job is ending; its steps are being killed.)
ENDED = frozenset(
    {"CANCELLED", "COMPLETED", "COMPLETING", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
     "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip
#: What ``srun`` says when the job it is to run a step in is gone.
SRUN_JOB_GONE = re.compile(
    r"^.*(?:has expired|Invalid job id|[Ee]xpired or invalid job|already completing or completed|"
    r"Job has been cancelled|Unable to confirm allocation).*$",
    re.MULTILINE,
)


class SlurmError(RuntimeError):
    """Not inside an allocation, a SLURM command failed, or a node cannot be used."""


def expand_nodelist(text: str) -> list[str]:
    """``n[1-3],gpu07`` -> ``[n1, n2, n3, gpu07]``, as ``scontrol show hostnames`` does (the
    zero padding of a range is kept)."""
    out: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if m is None:
            out.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                out.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise SlurmError(f"node list {text!r}: bad range {part!r}")
            for i in range(int(lo), int(hi) + 1):
                out.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return out


def parse_node_states(text: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N %T'`` output -> {node: state}, lower case. A trailing ``*`` (not
    responding) and other flag characters are kept: :func:`unusable` reads them."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out[parts[0]] = parts[1].lower()
    return out


def unusable(state: str) -> bool:
    """Whether a node in this state must not get a group: down, drained/draining, failing...,
    or not responding (``*``: slurmctld has missed its pings; DOWN follows)."""
    base = state.rstrip("*~#!%$@^-")
    return state.endswith("*") or base in UNUSABLE or "drain" in base


def allocation_end(job_id: str, state: str | None) -> str | None:
    """Why the allocation is over given the job's state (:func:`job_state`), or None."""
    if state is None:
        return f"SLURM no longer knows job {job_id} (squeue: invalid job id)"
    base = state.rstrip("+")  # e.g. CANCELLED+ (cancelled by its user, in sacct's style)
    return f"SLURM job {job_id} is {base}" if base in ENDED else None
