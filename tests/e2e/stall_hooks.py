"""Run inside a trainer's worker by ``test_stall.py`` (``Controller.run_in_worker``): a plain
module, importable by the workers (the job's ``sys.path`` is the test process's)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, cast

from runtime.actor import current_actors


@dataclass
class _Closed:
    port: int  # what torchft's ProcessGroup reads of its rendezvous store for its handle


def advertise_a_refusing_store(port: int) -> None:
    """This rank's cross-group process group advertises its rendezvous store at ``port`` of this
    host, where nothing listens (a store behind a firewall, or at an address that is not the
    host's, as with a hostname that resolves to loopback): every rendezvous on it is refused
    until the process-group timeout. Then the communicator is aborted, so the next step
    reconfigures, and from then on every step aborts."""
    for actor in current_actors().values():
        trainer = cast(Any, actor).trainer  # harness.rank.actors.TrainerActor
        trainer._pg._rendezvous_store = _Closed(port)
        trainer.abort_collectives()


def closed_port() -> int:
    """A port of this host that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
