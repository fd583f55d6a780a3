"""Which quorum service a job gets: the one place that reads ``recovery.quorum``
(``harness.quorum.service`` describes both)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from harness.config import JobConfig
from harness.quorum.lighthouse import LighthouseService
from harness.quorum.service import QuorumEvents, QuorumService, TreeQuorumService
from runtime.controller import Controller
from runtime.host_handle import HostAgentHandle


def make_quorum_service(
    cfg: JobConfig,
    events: QuorumEvents,
    *,
    place: Callable[[], HostAgentHandle],
    controller: Controller,
    log_dir: str,
    state_path: Path | None = None,
    resume: bool = False,
) -> QuorumService:
    """The service ``cfg.recovery.quorum`` names. For a service that runs in a process of its
    own: ``place()`` gives a ready host, ``controller`` runs it, ``log_dir`` takes its output.
    ``state_path``: where the tree quorum keeps its durable state, and with ``resume`` the state
    it serves again after its controller died (``TreeQuorumService``; a state file it refuses
    raises ``harness.quorum.durable.QuorumStateError`` here). torchft's Lighthouse keeps none:
    it cannot resume."""
    if cfg.recovery.quorum == "tree":
        from harness.job.quorum_callers import QuorumCallers

        service: TreeQuorumService
        callers = QuorumCallers(lambda: list(controller.hosts.values()), lambda: service.address)
        service = TreeQuorumService(
            cfg, events, state_path, resume=resume, caller_refusal=callers.refusal
        )
        return service
    if resume:
        raise ValueError('recovery.quorum = "torchft": only the tree quorum can resume')
    return LighthouseService(cfg, events, place=place, controller=controller, log_dir=log_dir)
