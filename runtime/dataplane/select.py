"""Automatic backend choice, as a pure function of what the source offers and where the
reader runs: shared memory on the same host, RDMA where both ends have a device, TCP
otherwise."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("shm", "ibverbs", "tcp")


@dataclass(frozen=True, kw_only=True)
class Choice:
    backend: str
    reason: str


def choose_backend(
    *,
    offered: tuple[str, ...],
    same_host: bool,
    local_rdma: bool,
    requested: str = "auto",
) -> Choice:
    """Pick the backend a reader uses for one source.

    ``requested`` other than ``"auto"`` is honoured if the source offers it and it can work
    from here (shm needs the same host); otherwise ``ValueError`` says why.
    """
    if requested != "auto":
        if requested not in offered:
            raise ValueError(f"backend {requested!r} requested, source offers {list(offered)}")
        if requested == "shm" and not same_host:
            raise ValueError("backend 'shm' requested but the source is on another host")
        return Choice(backend=requested, reason="requested")
    if "shm" in offered and same_host:
        return Choice(backend="shm", reason="same host: map the source's shared memory")
    if "ibverbs" in offered and local_rdma:
        return Choice(backend="ibverbs", reason="both ends have an RDMA device")
    if "tcp" in offered:
        why = "other host" if not same_host else "source offers no shared memory"
        return Choice(backend="tcp", reason=f"{why}: parallel TCP streams")
    raise ValueError(f"no usable backend: source offers {list(offered)}, same_host={same_host}")
