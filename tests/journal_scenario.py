"""One simulated job's journal around an injected fault, with simulated times (no processes,
no sleeping): the records a two-replica-group job writes around one kill. Shared by the unit
tests (Grafana, telemetry) and the integration tests (the stand-in job, the HTML dashboard)."""

from __future__ import annotations

from typing import Any

REPLICAS = 2
RANKS = 2
FAULT_STEP = 12


def scenario(
    *,
    job: str = "fake",
    policy: str = "in_place",
    t0: float = 1_700_000_000.0,
    step_s: float = 0.1,
    steps: int = 40,
    fault_step: int = FAULT_STEP,
    kind: str = "kill",
    checkpoint_every: int = 10,
    fault_id: str = "f1",
    recovery_id: str = "r1",
) -> list[dict[str, Any]]:
    """Journal records (with ``t``) of a 2-group x 2-rank job hit by one fault at ``fault_step``.

    ``in_place``: the survivor stalls ~1 s then keeps committing alone while group 1 restarts
    and heals from a peer; ``full_restart``: every group stops, reloads the last checkpoint
    (losing the steps since it) and resumes together ~4 s later.
    """
    recs: list[dict[str, Any]] = []
    t = t0

    def emit(event: str, at: float, **fields: Any) -> None:
        recs.append({"t": at, "event": event, "job": job, "policy": policy, **fields})

    def commit(step: int, at: float, groups: list[int]) -> None:
        for replica in groups:
            for rank in range(RANKS):
                emit(
                    "step.commit",
                    at,
                    replica=replica,
                    rank=rank,
                    host=f"host{replica}",
                    step=step,
                    loss=round(7.0 / (1 + 0.05 * step), 4),
                    checksum=f"{step:08x}",
                    step_time_s=step_s,
                    samples=4,
                    tokens=512,
                    participants=len(groups),
                    data_pos=step * 4 * len(groups),
                )

    emit("job.start", t, config={"steps": steps, "policy": policy}, replicas=REPLICAS, ranks=RANKS)
    for replica in range(REPLICAS):
        for rank in range(RANKS):
            emit(
                "proc.start",
                t + 0.01,
                replica=replica,
                rank=rank,
                host=f"host{replica}",
                pid=1000 + 10 * replica + rank,
                spare=False,
            )
    t += 0.5
    step = 0
    while step < fault_step:
        t += step_s
        commit(step, t, [0, 1])
        step += 1

    inject = t + step_s / 2
    emit(
        "fault.inject",
        inject,
        fault_id=fault_id,
        kind=kind,
        target={"replica": 1, "rank": 0, "host": "host1"},
        seed=7,
        replica=1,
        rank=0,
        host="host1",
    )
    detected = inject + 0.04
    emit(
        "failure",
        detected - 0.01,
        cause="signal",
        detail="killed by SIGKILL",
        exit_code=None,
        signal=9,
        traceback=None,
        coords={"replicas": 1, "ranks": 0},
        replica=1,
        rank=0,
        host="host1",
        pid=1010,
    )
    emit("fault.heal", inject + 0.001, fault_id=fault_id, kind=kind)

    def phase(name: str, at: float, replica: int) -> None:
        emit(
            "recovery.phase",
            at,
            recovery_id=recovery_id,
            fault_id=fault_id,
            replica=replica,
            phase=name,
            cause="signal",
        )

    if policy == "in_place":
        emit(
            "supervisor",
            detected,
            supervisor="replica1",
            decision="restart_all",
            reason="rank 0 exited on SIGKILL",
            replica=1,
        )
        phase("detected", detected, 1)
        resumed = detected + 1.0
        phase("replacement_started", detected + 0.2, 1)
        for rank in range(RANKS):
            emit(
                "proc.start",
                detected + 0.2,
                replica=1,
                rank=rank,
                host="host1",
                pid=2000 + rank,
                spare=False,
            )
        phase("survivors_resumed", resumed, 1)
        t = resumed
        healed = detected + 2.0
        while t + step_s < healed:
            t += step_s
            commit(step, t, [0])
            step += 1
        phase("healed", healed, 1)
        participating = healed + 0.3
        phase("participating", participating, 1)
        t = participating
    else:
        emit(
            "supervisor",
            detected,
            supervisor="root",
            decision="restart_all",
            reason="full_restart policy",
            replica=None,
        )
        phase("detected", detected, 1)
        phase("replacement_started", detected + 0.5, 1)
        restart_step = (step // checkpoint_every) * checkpoint_every
        emit("checkpoint.load", detected + 3.5, step=restart_step, path="ckpt/step")
        phase("healed", detected + 3.5, 1)
        phase("survivors_resumed", detected + 4.0, 1)
        phase("participating", detected + 4.0, 1)
        t = detected + 4.0
        step = restart_step
    while step < steps:
        t += step_s
        commit(step, t, [0, 1])
        step += 1
        if step % checkpoint_every == 0:
            emit("checkpoint.save", t + 0.01, step=step, path=f"ckpt/{step}", seconds=0.01)
    emit("job.end", t + 0.1, status="ok", reason="", steps=steps)
    recs.sort(key=lambda r: r["t"])
    return recs
