"""The actors a training job runs in its worker processes: the trainers (torchft's Lighthouse, when
the job uses it, is ``harness.quorum.lighthouse``).

Preloaded by every host agent (with torch), so forking a replacement does not import them again.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import torch

import harness.rank.transport  # noqa: F401 - preloaded with the actors, so a fork need not import it
from harness.config import config_from_dict
from harness.rank.healing import heal_client, slow_serve
from harness.rank.trainer import Trainer, threads_per_worker
from runtime.actor import Actor, current_actors, endpoint
from runtime.journal import HEAL_START, HEALED, SERVE_START


class _ReportingTrainer(Trainer):
    """A Trainer that journals each heal: its start (``trainer.heal_start``, when a quorum says
    this group is behind, naming the source), the source's part (``trainer.serve_start``, as it
    begins to send) and its end (``trainer.healed``: torchft calls
    ``load_state_dict``, the bound method handed to its Manager, once it has a healthy peer's
    state)."""

    training = False  # False while __init__ resumes from a checkpoint: that is not a heal
    _between: collections.deque[Callable[..., Any]] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        heal_client(self.manager).on_heal = self._heal_started
        slow_serve(self.manager).on_serve = self._serve_started

    def _heal_started(self, source: str | None, step: int) -> None:
        fields = {"replica": self.replica_id, "rank": self.rank, "source": source, "step": step}
        self._emit(HEAL_START, fields)

    def _serve_started(self, step: int, dst_ranks: list[int]) -> None:
        # after the quorum's process group is configured: the heal's transfer begins
        fields = {"replica": self.replica_id, "rank": self.rank, "step": step, "to": dst_ranks}
        self._emit(SERVE_START, fields)

    def between_steps(self, fn: Callable[..., Any]) -> None:
        """Run ``fn(tensors, step, emit)`` on the training thread before the next step: the
        state as ``named_tensors()``, the steps committed so far, the journal. Thread-safe (a
        fault hook: ``faults.bitflip``)."""
        if self._between is None:
            self._between = collections.deque()
        self._between.append(fn)

    broken = False  # the broken_device fault: every step fails from now on (faults.device)

    def train_step(self) -> tuple[bool, float]:
        while self._between:
            self._between.popleft()(self.named_tensors(), self.manager.current_step(), self._emit)
        if self.broken:
            raise RuntimeError(
                "CUDA error: uncorrectable ECC error encountered (the broken_device fault: this "
                "group's device is broken, in every incarnation)"
            )
        return super().train_step()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Weights (``model.<name>``) and optimizer state (``optim.<param>.<key>``), in place:
        this rank's shards of them, when its group is sharded."""
        local = self.layout.local
        out = {f"model.{k}": local(p.data) for k, p in self.model.named_parameters()}
        for idx, st in self.optimizer.state_dict()["state"].items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim.{idx}.{key}"] = local(v)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.training:
            self._emit(
                HEALED,
                {
                    "replica": self.replica_id,
                    "rank": self.rank,
                    "data_pos": self.data.position,
                    "transport": self.cfg.transport,  # the CheckpointTransport that carried it
                    # the group it healed from (recorded for groups of several ranks, which
                    # all heal from one: harness.rank.healing.OneHealSource)
                    "source": heal_client(self.manager).source,
                },
            )


class TrainerActor(Actor):
    """One rank of one replica group (see harness.rank.trainer for the training loop itself).

    ``train`` occupies the worker's main thread for the whole run; the fault hooks
    (``set_step_delay``, ``abort_collectives``) and ``stop`` are therefore reached through
    the runtime's system calls (``run_in_worker``), which run on another thread.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        store_addrs: dict[int, str],
        lighthouse_addr: str,
        run_dir: str | None,
        member_ids: dict[int, str] | None = None,
        data_marks: dict[str, list[int]] | None = None,
        broken: list[int] | None = None,
        peers_hold_state: bool = False,
    ) -> None:
        """``store_addrs`` maps each replica group to its TCPStore, ``member_ids`` to the name
        the quorum service admitted for it (none: torchft's Lighthouse); this actor's group and
        rank are its mesh coordinates. ``data_marks``: the job's ``poisoned`` (unreadable),
        ``poisoned_nonfinite`` and ``quarantined`` data so far (``harness.job.poison``).
        ``broken``: the groups whose device is broken (``faults.device``).
        ``peers_hold_state``: live groups hold committed state: heal from them, load no
        checkpoint (``Trainer``)."""
        self.replica_id = replica_id = self.coords["replica"]
        self.rank = self.coords["rank"]
        store_addr = store_addrs[replica_id]
        job = config_from_dict(cfg)
        torch.set_num_threads(threads_per_worker(job))
        self.trainer = _ReportingTrainer(
            job,
            replica_id=replica_id,
            rank=self.rank,
            store_addr=store_addr,
            lighthouse_addr=lighthouse_addr,
            emit=lambda event, fields: self.emit(event, **fields),
            run_dir=run_dir,
            member_id=(member_ids or {}).get(replica_id),
            peers_hold_state=peers_hold_state,
        )
        marks = data_marks or {}
        for key in marks.get("poisoned", ()):
            self.trainer.poison_data(key)
        for key in marks.get("poisoned_nonfinite", ()):
            self.trainer.poison_data(key, "nonfinite")
        self.trainer.quarantine_data(list(marks.get("quarantined", ())))
        self.trainer.broken = replica_id in (broken or ())

    @endpoint(supervised=True)  # an exception escaping training is a failure of the group
    def train(self) -> dict[str, Any]:
        self.trainer.training = True
        try:
            return self.trainer.train()
        finally:
            self.trainer.training = False

    @endpoint
    def checksum(self) -> str:
        return self.trainer.checksum()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    # Hooks for the fault injector (faults/inworker.py calls these on the trainer actor).
    def set_step_delay(self, seconds: float) -> None:
        self.trainer.set_step_delay(seconds)

    def set_serve_delay(self, seconds: float) -> None:
        self.trainer.set_serve_delay(seconds)

    def set_checkpoint_delay(self, seconds: float) -> None:
        self.trainer.set_checkpoint_delay(seconds)

    def abort_collectives(self) -> None:
        self.trainer.abort_collectives()

    def between_steps(self, fn: Callable[..., Any]) -> None:
        self.trainer.between_steps(fn)


def stop_training(after_step: int | None = None) -> None:
    """System call: make every trainer in this worker return from ``train`` once ``after_step``
    steps are committed (None: after its current step). ``Job.stop`` gives every group the same
    step, so that none waits in a quorum for a group that stopped a step earlier."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.stop(after_step)


def quarantine_data(keys: list[int]) -> None:
    """System call: every trainer in this worker skips the data of ``keys`` from its next pass
    on (``harness.job.poison``)."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.quarantine_data(keys)


def poison_data(key: int, effect: str = "unreadable") -> None:
    """System call (the ``poison_data`` fault): the data of ``key`` crashes the step of every
    trainer in this worker that reads it (``effect = "nonfinite"``: gives it a NaN loss)."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.poison_data(key, effect)


def break_device() -> None:
    """The ``broken_device`` fault, in a worker: its trainer fails every step from now on."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.broken = True


def request_quorum(hold_s: float = 0.0, groups: int = 0) -> None:
    """System call: every trainer in this worker raises the quorum flag at its next allreduce
    (sparse quorum, ``recovery.quorum_every_steps``): a new member waits in the tree quorum.
    With ``hold_s``: a replacement is starting; raise it at every step until a quorum of
    ``groups`` groups commits, for up to ``hold_s`` seconds (``Trainer.request_quorum``)."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.request_quorum(hold_s, groups)


def checkpoint_next_step() -> None:
    """System call: every trainer in this worker checkpoints at its next committed step (SLURM's
    time-limit signal, harness/job/slurm.py)."""
    for actor in current_actors().values():
        if isinstance(actor, TrainerActor):
            actor.trainer.checkpoint_next_step()
