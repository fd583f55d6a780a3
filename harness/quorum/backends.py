"""Which quorum service a job gets: the one place that reads ``recovery.quorum``
(``harness.quorum.service`` describes both)."""

from __future__ import annotations

from collections.abc import Callable

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
) -> QuorumService:
    """The service ``cfg.recovery.quorum`` names. For a service that runs in a process of its
    own: ``place()`` gives a ready host, ``controller`` runs it, ``log_dir`` takes its output."""
    if cfg.recovery.quorum == "tree":
        return TreeQuorumService(cfg, events)
    return LighthouseService(cfg, events, place=place, controller=controller, log_dir=log_dir)
