"""The small verbs interface the ibverbs backend is written against.

Two implementations: ``ibverbs.PyverbsVerbs`` (real hardware, through Debian's pyverbs) and
``fake_verbs.FakeVerbs`` (in memory, checks the call sequence). Objects returned are opaque
to the backend except for ``mr.lkey``, ``mr.rkey`` and ``qp.qp_num``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# ibv_access_flags values (stable ABI)
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4
WC_SUCCESS = 0
WC_RETRY_EXC_ERR = 12  # what hardware reports when the remote QP stopped answering


@dataclass(frozen=True, kw_only=True)
class QpInfo:
    """What each side of an RC connection tells the other (exchanged out of band)."""

    qpn: int
    psn: int
    lid: int
    gid: str

    def to_dict(self) -> dict:
        return {"qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid}

    @classmethod
    def from_dict(cls, d: dict) -> QpInfo:
        return cls(qpn=int(d["qpn"]), psn=int(d["psn"]), lid=int(d["lid"]), gid=str(d["gid"]))


@dataclass(frozen=True, kw_only=True)
class Completion:
    wr_id: int
    status: int


class Verbs(ABC):
    """The verbs calls the data plane makes, in the order it makes them."""

    @abstractmethod
    def devices(self) -> list[str]: ...

    @abstractmethod
    def open_device(self, name: str) -> Any: ...

    @abstractmethod
    def query_port(self, ctx: Any, port: int, gid_index: int) -> tuple[int, str]:
        """(lid, gid as text) of a local port."""

    @abstractmethod
    def alloc_pd(self, ctx: Any) -> Any: ...

    @abstractmethod
    def reg_mr(self, pd: Any, addr: int, length: int, access: int) -> Any: ...

    @abstractmethod
    def create_cq(self, ctx: Any, cqe: int) -> Any: ...

    @abstractmethod
    def create_qp(self, pd: Any, cq: Any, max_send_wr: int) -> Any:
        """An RC queue pair in RESET."""

    @abstractmethod
    def qp_to_init(self, qp: Any, port: int, access: int) -> None: ...

    @abstractmethod
    def qp_to_rtr(self, qp: Any, remote: QpInfo, port: int, gid_index: int) -> None: ...

    @abstractmethod
    def qp_to_rts(self, qp: Any, psn: int) -> None: ...

    @abstractmethod
    def post_read(
        self,
        qp: Any,
        wr_id: int,
        local_addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        """Post one signalled RDMA READ of ``length`` bytes."""

    @abstractmethod
    def poll_cq(self, cq: Any, max_entries: int) -> list[Completion]: ...

    @abstractmethod
    def close(self, obj: Any) -> None:
        """Destroy a QP, CQ, MR, PD or context."""
