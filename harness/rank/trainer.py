"""The training loop of one rank of one replica group, read top to bottom like nanoGPT:

    start quorum (heal if behind) -> batch -> forward/backward -> average gradients across the
    participating replica groups -> should_commit -> optimizer step -> advance the data

Protocol invariants, and where they are kept:

* **A committed step never goes back.** The step counter is torchft's Manager's; it only grows in
  ``should_commit`` when every rank of the group agreed, and a heal only loads a peer's state at
  the quorum's *max* step (never behind ours). The optimizer steps and the data advances only
  after that agreement (see :meth:`Trainer.train_step`).
* **After a heal every replica holds the same weights** (bitwise: same checksum at the same
  step). The replacement loads the peer's model, optimizer and data state (the transport copies
  tensors exactly) before its first forward pass (synchronous quorum,
  ``harness.rank.torchft_glue``); from
  then on every group applies the same averaged gradient with the same deterministic AdamW.
* **No data position is trained twice by a group**: positions advance only on commit, a healed
  group takes the peer's (later) position; see ``harness.rank.data``. With ``data.policy =
  "replay"``
  moreover no sequence is skipped: each committed step trains the next unread group batches,
  one per participant in quorum order, so the survivors take up a down group's share.

Checkpoints: at a checkpoint step the training thread only serializes the state (the consistent
copy); a background writer makes it durable while training goes on. The per-step quorum is a
barrier across the groups, so one group's slow step stalls every group: a synchronous write
(15-30 ms, a step being ~21 ms on the tiny model) made every checkpoint step long for all.
See :meth:`Trainer._maybe_checkpoint`.

Sparse quorum (the default with the tree quorum; ``recovery.quorum_every_steps``,
``JobConfig.quorum_every``): a quorum is a round trip through the quorum service for every group
on every step, and fault-free it returns the same membership. So a step asks for one only when
membership may have changed, decided by every rank of every group from what all of them saw, so
that all ask at the same step (one that asked while the others went on to the allreduce would
wait for them in the quorum, and they for it in the collective):

* every N-th step, and the first step of this trainer;
* after a step that did not commit (a peer died mid-collective: every group's collective fails,
  the communicator is closed on failure, see ``_average_gradients``);
* after a step in which any rank of any group raised the quorum flag, one float averaged along
  with the gradients. A trainer raises it when the controller says a new member waits in the
  tree quorum (``request_quorum``): a replacement is let in within two steps, not N. And
  sooner: as the controller starts a replacement it asks every running trainer to raise it at
  every step until a quorum of all the groups has committed (``request_quorum``'s hold, bounded
  in time), so the groups meet at every step while the replacement starts and its join is
  taken in at the next step.

The tree quorum then waits for live members of the last quorum past its join timeout
(``harness.quorum.rule``): a group that skips quorums is not left out of one. What it costs: a
group cut off from the others is found by the collective (the host's connections are closed
once its agent is lost: the host timeout) rather than by its quorum heartbeats going stale.

Fault-tolerance machinery (quorum, commit, heal, fault hooks) lives here and in
``harness.rank.torchft_glue``; the model code knows nothing of it.

Why this module is longer than 500 lines: the per-step protocol of one rank stays in one file on
purpose, as torchft keeps its own in ``manager.py``: each invariant above is kept by code a few
lines from the step that needs it, and a reader follows the step top to bottom.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from torch.distributed import TCPStore

from harness.config import JobConfig, config_from_dict
from harness.rank import checkpoint
from harness.rank.data import IGNORE, BadData, masked
from harness.rank.group_layout import (
    Asks,
    GroupLayout,
    Replicated,
    Sharded,
    init_group_world,
    intra_group_pg,
    intra_group_timeout,
)
from harness.rank.healing import slow_serve
from harness.rank.model import build_model, build_optimizer, loss_fn, model_blocks
from harness.rank.token_data import HeldOut, make_stream
from harness.rank.torchft_glue import (
    close_communicator,
    forget_failed_quorum,
    host_store,
    make_manager,
)
from runtime.journal import (
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    CHECKPOINT_START,
    DATA_QUARANTINE,
    DATA_SUSPECT,
    EVAL,
    PROC_START,
    STEP_ABORT,
    STEP_COMMIT,
    TRAINER_START,
)
from runtime.worker import controller_survivable

if TYPE_CHECKING:
    import torch.distributed as dist

    from harness.rank.dcp_checkpoint import Writer as DcpWriter

#: Consecutive failed quorum requests a rank rides out (about a minute of backoff) before it
#: gives up and lets its supervisor restart the group.
MAX_QUORUM_FAILURES = 60
#: When the controller (and its quorum service) can be replaced under a running trainer, how
#: often torchft's ManagerServer asks the new quorum service again (:func:`quorum_retries`).
QUORUM_RETRY_S = 0.25


def quorum_retries(cfg: JobConfig) -> int:
    """torchft's ``quorum_retries`` for a trainer whose quorum service may restart with a new
    controller (``harness.job.takeover``): a retry every ~``QUORUM_RETRY_S``. torchft spaces
    retries ``quorum_timeout / (retries + 1)`` apart. Measured by ``bench takeover`` (10
    controller SIGKILLs): without retries a quorum request in flight when the controller died
    hung for the whole quorum timeout (10 s, 3 crashes in 10); with these, the longest time
    without a commit was 0.32 s at p50 and 0.39 s at p95 (docs/BENCHMARKS.md)."""
    return max(1, math.ceil(cfg.timeouts.quorum_timeout / QUORUM_RETRY_S) - 1)


#: Every this many steps (and at every checkpoint step) a commit record carries the checksum of
#: the weights and optimizer state; other records carry None. The checksum is what shows the
#: replicas equal, and it is a pass over the whole state on the step's critical path (1.8 ms a
#: tiny step, 14.6 ms a llama3 debug step, timed alone). Sampling loses little: replicas whose
#: weights differ after a step differ after every later one (the same averaged update applied to
#: different weights; only a heal makes them equal again), so every group checksumming the same
#: step numbers still shows a fork within this many steps. Checkpoint steps keep theirs so a
#: resume can be checked against the step it resumed from.
CHECKSUM_EVERY = 10

#: Run the forward/backward pass while the (synchronous) quorum forms, instead of after it; see
#: ``Trainer._quorum_overlapped``. The quorum is a barrier across the groups, so on a busy or
#: uneven machine most of its time is waiting for the slowest group, which the pass now hides.
OVERLAP_QUORUM = True

#: ``emit(event, fields)``: report a journal event (names and fields in ``runtime/journal.py``);
#: what it returns (``Journal.emit`` returns the record) is ignored.
Emit = Callable[[str, dict[str, Any]], object]


class PeersGone(RuntimeError):
    """A replacement that skipped its checkpoint to heal from a live group found none at its
    first quorum (:meth:`Trainer._check_healed`): its group restarts and loads the checkpoint."""


@dataclass
class _DcpCheckpoints:
    """A rank's DCP checkpointing (``checkpoint.format = "dcp"``): its background writer (None
    on a rank that writes nothing: ranks > 0 of a replicated group), the group's checkpoint
    process group (None: one rank writes alone), when each checkpoint under way was started
    (``perf_counter``, by step) and how long the last one held the training thread."""

    writer: DcpWriter | None
    pg: dist.ProcessGroup | None
    started: dict[int, float] = field(default_factory=dict)
    blocked_s: float | None = None


class Trainer:
    """One rank of one replica group. Build it, then call :meth:`train`.

    ``store_addr`` is the group's TCPStore (``host:port``); ``None`` on rank 0 means this rank
    hosts it on a free port (read :attr:`store_addr` and give it to the group's other ranks).
    ``run_dir`` is where checkpoints go when ``cfg.checkpoint.dir`` is None (None: no
    checkpoints). On start the newest valid checkpoint (if any) is loaded; a group that is behind
    its peers then heals from them on its first quorum. ``member_id``: the name the quorum
    service admitted for this incarnation of the group (``harness.rank.torchft_glue.make_manager``).
    ``peers_hold_state``: other groups hold committed state (a replacement started beside live
    groups): it loads no checkpoint, its first quorum heals it from one of them
    (:meth:`_check_healed` says what happens if none is left by then).
    """

    def __init__(
        self,
        cfg: JobConfig,
        *,
        replica_id: int,
        rank: int,
        store_addr: str | None,
        lighthouse_addr: str,
        emit: Emit,
        run_dir: str | None = None,
        member_id: str | None = None,
        peers_hold_state: bool = False,
    ) -> None:
        self.cfg = cfg
        self.replica_id = replica_id
        self.rank = rank
        self._emit = emit
        # train() returns once this many steps are committed (stop(): the current step)
        self._stop_after: float = float("inf")
        self._checkpoint_asked = threading.Event()  # checkpoint_next_step (a time limit)
        self._step_delay = 0.0
        self._checkpoint_delay = 0.0  # a slow disk under a checkpoint write (fault injection)
        self._compute_s = 0.0  # this step's own forward/backward time (stragglers: compute_s)
        self._quorum_failures = 0
        # Overlapping the quorum with the pass (``_quorum_overlapped``): a heal takes the lock.
        self._state_lock = threading.RLock()
        self._state_changed = False
        self._last_slot: int | None = None  # None until this trainer has joined a quorum
        # Sparse quorum (see the module doc): the period, whether the next step asks for a
        # quorum, and the flag a controller raises to have every group ask (a new member waits).
        self._quorum_every = cfg.quorum_every()
        self._quorum_next = True
        self._quorum_asked = threading.Event()
        # A replacement is starting (request_quorum's hold): ask for a quorum at every step
        # until (monotonic deadline, groups in a quorum); the participants of the last commit.
        self._quorum_hold: tuple[float, int] = (0.0, 0)
        self._participants = 0
        self._group_asks = Asks()  # what the group's ranks agreed on in the last pass
        # Makes checkpoints durable off the training thread, one at a time (_maybe_checkpoint).
        self._writer = checkpoint.BackgroundWriter(f"harness-ckpt-r{replica_id}-{rank}")
        # Joins the quorum while the training thread runs the pass (_quorum_overlapped): one
        # thread for the whole run, not one started per step.
        self._quorum_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="harness-quorum")

        self._store = None
        if store_addr is None:
            if rank != 0:
                raise ValueError("only rank 0 may host the group's store (store_addr=None)")
            self._store, store_addr = host_store(cfg.bind_host, cfg.timeouts)
        self.store_addr = store_addr

        # Same seed in every group and rank: identical initial weights everywhere. A sharded
        # group then keeps each rank's shards of them (before the optimizer sees the params).
        lap = _Laps()  # what each part of a (replacement's) start costs: trainer.start
        self.model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.data.seed)
        lap("model")
        self.layout = self._group_layout(store_addr)
        lap("layout")
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.data = make_stream(
            cfg.data,
            shard=replica_id * cfg.ranks + rank,
            num_shards=cfg.replicas * cfg.ranks,
            group_size=cfg.ranks,
        )
        lap("optimizer")

        self.manager, self._pg = make_manager(
            cfg,
            replica_id=replica_id,
            rank=rank,
            store_addr=store_addr,
            lighthouse_addr=lighthouse_addr,
            state_dict=self.state_dict,
            load_state_dict=self.load_state_dict,
            member_id=member_id,
            quorum_retries=quorum_retries(cfg) if controller_survivable() else 0,
        )
        lap("manager")
        self._heldout = HeldOut(cfg.data) if cfg.data.eval_every else None
        self._initial_eval_due = self._heldout is not None
        self._ckpt_dir = self._checkpoint_root(run_dir)
        self._dcp: _DcpCheckpoints | None = None  # checkpoint.format = "dcp"
        if self._ckpt_dir is not None and self._ckpt_format() == "dcp":
            self._dcp_init()
            lap("checkpoint")
        # A replacement beside live groups heals from them at its first quorum, overwriting all
        # a checkpoint load would have given it: it skips the load (for a sharded group a
        # collective DCP load, the larger part of its start).
        self._awaiting_heal = peers_hold_state and self._ckpt_dir is not None
        if not self._awaiting_heal:
            self._resume()
            lap("resume")
        self._emit(
            TRAINER_START,
            {"replica": replica_id, "rank": rank, "seconds": lap.total(), "parts": lap.parts},
        )

    # --- the loop --------------------------------------------------------------------------

    def train(self, steps: int | None = None) -> dict[str, Any]:
        """Train until ``steps`` (default ``cfg.steps``) steps are committed or :meth:`stop`;
        return a summary. Returns normally after a stop; raises on an unrecoverable error.
        Returns only once the last checkpoint handed to the background writer is durable (and
        raises its error if that write failed)."""
        target = self.cfg.steps if steps is None else steps
        commits = aborts = 0
        last_loss = float("nan")
        t0 = time.perf_counter()
        try:
            while self.manager.current_step() < min(target, self._stop_after):
                committed, last_loss = self.train_step()
                commits += committed
                aborts += not committed
        except BaseException as exc:
            try:
                # The pending checkpoint still lands, if it can. (Not a DCP write: it needs the
                # group's other ranks, and a rank failing here is often why they are gone; left
                # unfinished, it is never loaded.)
                self._writer.wait()
            except Exception as write_error:
                exc.add_note(f"and a checkpoint write failed: {write_error!r}")
            raise
        self._writer.wait()
        if self._dcp is not None and self._dcp.writer is not None:
            self._dcp.writer.wait()
        return {
            "replica": self.replica_id,
            "rank": self.rank,
            "step": self.manager.current_step(),
            "commits": commits,
            "aborts": aborts,
            "loss": last_loss,
            "checksum": self.checksum(),
            "seconds": time.perf_counter() - t0,
        }

    def train_step(self) -> tuple[bool, float]:
        """One attempt at the next step; returns (committed, loss)."""
        t0 = time.perf_counter()
        self._compute_s = 0.0
        with_quorum = self._quorum_next  # True for a trainer's first step
        self._quorum_next = True  # until this step commits and says otherwise
        joined: tuple[int, int | None, int, torch.Tensor] | None
        if not with_quorum:
            joined = self._pass()
        elif OVERLAP_QUORUM and self.layout.overlap_quorum and self._last_slot is not None:
            joined = self._quorum_overlapped()
        else:
            joined = self._quorum_then_pass()
        if joined is None:
            return False, float("nan")
        step, slot, pos, loss = joined

        # 3. Average gradients within the group, then across participating groups.
        flag = self._average_gradients(finite=bool(torch.isfinite(loss)))

        # 4. Commit only if every rank of the group saw a clean step (no collective failed,
        #    enough groups took part). Otherwise nothing changes and the step is retried, after
        #    a quorum that rebuilds the communicator (torchft reports the commit failure to it).
        if not self.manager.should_commit():
            err = self.manager.errored()
            # Close it now even when this rank's own collectives succeeded (another rank of the
            # group failed): a group that committed this step may already wait on us in its
            # next step's allreduce, on this communicator; this group goes to a quorum instead,
            # and left open, that peer would wait out the process-group timeout.
            close_communicator(self._pg, err.original_exception if err else None)
            self._emit(
                STEP_ABORT,
                {
                    "replica": self.replica_id,
                    "rank": self.rank,
                    "step": step + 1,
                    "reason": repr(err.original_exception) if err else "not enough replicas",
                },
            )
            return False, loss.item()

        self._wait_staged()  # a DCP checkpoint's copy of the state is taken before it changes
        self.optimizer.step()
        participants = self._participants = self.manager.num_participants()
        seqs = self.data.trained_ranges(slot, participants)
        due = self.data.due(participants)
        self.data.advance(participants)  # the position moves only with a committed step
        committed = self.manager.current_step()
        self._emit(
            STEP_COMMIT,
            {
                "replica": self.replica_id,
                "rank": self.rank,
                "step": committed,
                "loss": loss.item(),
                "checksum": self.checksum() if self._checksum_due(committed) else None,
                "step_time_s": time.perf_counter() - t0,
                "compute_s": self._compute_s,  # without waits for other groups (stragglers)
                "samples": self.cfg.data.batch_size,
                "tokens": self.cfg.data.batch_size * self.cfg.data.seq_len,
                "participants": participants,
                "data_pos": pos,
                # What this step trained and what was due by it (dashboards.data_coverage).
                "data_policy": self.cfg.data.policy,
                "seqs": seqs,
                "seq_due": due,
                "quorum": with_quorum,
            },
        )
        self._maybe_checkpoint(committed)
        self._maybe_eval(committed)
        self._quorum_next = self._quorum_every <= 1 or flag or committed % self._quorum_every == 0
        return True, loss.item()

    def _maybe_eval(self, step: int) -> None:
        """Held-out loss every ``data.eval_every`` committed steps (harness.rank.token_data),
        by one group (replica rank 0 of the quorum; all hold the same weights), on rank 0."""
        if self._heldout is None or step % self.cfg.data.eval_every:
            return
        if self.rank != 0 and not self.layout.eval_on_every_rank:
            return
        if step and self.manager.participating_rank() != 0:
            return
        with self._state_lock:  # sharded: every rank runs the forward pass, rank 0 reports it
            record = self._heldout.record(self.model, step=step, replica=self.replica_id, rank=0)
        if self.rank == 0:
            self._emit(EVAL, record)

    def _maybe_eval_initial(self) -> None:
        """The held-out loss of the initial weights, once per job: by the group that is replica
        rank 0 of the quorum that trains step 1, before it does. Not by a fixed group: one that
        starts late may find the others past step 0 already, and load a checkpoint past it."""
        if not self._initial_eval_due:
            return
        self._initial_eval_due = False  # decided at this trainer's first quorum either way
        # participating_rank() first: it waits for the quorum, and a heal moves current_step()
        if self.manager.participating_rank() == 0 and self.manager.current_step() == 0:
            self._maybe_eval(0)

    def _checksum_due(self, step: int) -> bool:
        """Every ``CHECKSUM_EVERY`` steps, at checkpoint steps, and at a step in which any
        participating group's loss was not finite (``Asks.nonfinite``)."""
        if self._group_asks.nonfinite:
            return True
        every = self.cfg.checkpoint.every_steps
        return step % CHECKSUM_EVERY == 0 or (every > 0 and step % every == 0)

    def _quorum_then_pass(self) -> tuple[int, int | None, int, torch.Tensor] | None:
        """1. Join this step's quorum. If we are behind (a replacement, or late), this loads a
        healthy peer's model, optimizer, data position and step before returning. 2. Forward
        and backward on our shard of the batch. Returns (steps committed so far, our slot in
        the quorum, data position, loss), or None if the quorum failed (an aborted step)."""
        if not self._join_quorum():
            return None
        self._maybe_eval_initial()
        return self._pass()

    def _quorum_overlapped(self) -> tuple[int, int | None, int, torch.Tensor] | None:
        """The same, with the forward/backward pass run *while* the quorum forms (the quorum
        is a barrier across groups: each waits there for the slowest, so the pass hides that
        wait). The pass is speculative: it uses the state and the quorum slot we had, and it is
        done again, after the quorum, if the quorum changed either (a heal loaded a peer's
        state, or the replay policy gave us another slot). A heal never lands mid-pass:
        ``load_state_dict`` waits for ``_state_lock``, which the pass holds. So the invariants
        of the synchronous quorum hold: the pass that is committed ran on the quorum's state.
        Used once this trainer has joined a quorum (a fresh one is the one likely to heal, and
        its pass would hold the heal up)."""
        self._state_changed = False  # before the quorum starts: a heal sets it from then on
        quorum = self._quorum_thread.submit(self._join_quorum)
        guess = self._last_slot if self.cfg.data.policy == "replay" else None
        with self._state_lock:
            pos = self.data.position
            loss = self._forward_backward(guess)
        if not quorum.result():  # its exception, if it raised, is raised here
            return None
        step = self.manager.current_step()
        slot = self._slot()
        if self._state_changed or slot != guess:
            pos = self.data.position
            loss = self._forward_backward(slot)  # the quorum changed our state or our share
        return step, slot, pos, loss

    def _pass(self) -> tuple[int, int | None, int, torch.Tensor]:
        """Forward and backward on the membership and slot of the last quorum: after it, or on a
        step between quorums (sparse quorum; nothing heals then, only a quorum does)."""
        step = self.manager.current_step()  # steps committed so far = the one we attempt
        slot = self._slot()
        pos = self.data.position
        return step, slot, pos, self._forward_backward(slot)

    def request_quorum(self, hold_s: float = 0.0, groups: int = 0) -> None:
        """Sparse quorum: raise the flag at the next allreduce, so that every group asks for a
        quorum at the step after it (the controller calls this when a new member waits).

        ``hold_s``, ``groups``: a replacement is starting (the controller calls this as it
        starts one). Raise the flag at every step from now on, for up to ``hold_s`` seconds,
        until a quorum of at least ``groups`` groups has committed a step: the groups then
        meet at every step, and the replacement's join is taken in at the next one. Without
        it, its join raises the flag only once it arrives, which rides the next allreduce,
        and the quorum it asks for comes a step later still: one or two steps of waiting
        for a replacement that is ready. A hold costs a quorum at every step while it lasts,
        so it is bounded in time: a replacement that never comes does not keep the job at a
        quorum per step."""
        if hold_s > 0:
            self._participants = 0  # a commit from now on ends the hold, not an older one
            self._quorum_hold = (time.monotonic() + hold_s, groups)
        self._quorum_asked.set()

    def _holding_quorum(self) -> bool:
        """Whether :meth:`request_quorum`'s hold still asks for a quorum at every step."""
        until, groups = self._quorum_hold
        if not until:
            return False
        if self._participants >= groups or time.monotonic() >= until:
            self._quorum_hold = (0.0, 0)
            return False
        return True

    def _slot(self) -> int | None:
        """Our place in this step's quorum (the replay policy hands out batches by it)."""
        if self.cfg.data.policy != "replay":
            self._last_slot = -1  # any non-None value: known after one quorum
            return None
        slot = self.manager.participating_rank()
        self._last_slot = slot
        return slot

    def _forward_backward(self, slot: int | None) -> torch.Tensor:
        t0 = time.perf_counter()
        inputs, targets = self._read(slot)
        self.optimizer.zero_grad(set_to_none=False)
        try:
            logits = self.model(inputs)
            logits = self.data.poisoned_logits(slot, logits)  # fault hook: poison_data, nonfinite
            if bool((targets == IGNORE).all()):  # every sequence quarantined: train nothing
                loss = logits.sum() * 0.0
            else:
                loss = loss_fn(logits, targets)
            finite = bool(torch.isfinite(loss))
            if not finite:
                self._suspect_nonfinite(slot, logits.detach(), targets)
            self.layout.backward(loss, self._asks(nonfinite=not finite))
        except Exception as exc:  # bad ids are masked by _read: blame the rows that raise alone
            rows = []
            if isinstance(self.layout, Replicated):  # a sharded pass is collective
                rows = [j for j in range(inputs.shape[0]) if self._raises(inputs[j : j + 1])]
            self._suspect_data(self.data.indices(slot), rows, exc)
            raise  # the group fails; the controller quarantines what two groups failed on
        if self._step_delay > 0:
            time.sleep(self._step_delay)  # fault hook: a straggler
        self._compute_s += time.perf_counter() - t0
        return loss

    def _read(self, slot: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch, screened (``harness.job.poison``). A sequence that cannot be read
        is journaled as the suspect (``data.suspect``) and fails the group; one with ids outside
        the vocabulary is bad data for certain: quarantined here and now (``data.quarantine``,
        the controller tells every group) and left out of this pass, the group unharmed."""
        try:
            inputs, targets = self.data.batch(slot)
        except Exception as exc:
            indices = self.data.indices(slot)
            rows = [j for j, index in enumerate(indices) if not self._readable(index)]
            self._suspect_data(indices, rows, exc)
            raise
        bad = self.data.outside_vocabulary(inputs, targets)
        if bad:
            indices = self.data.indices(slot)
            for j in bad:
                self._quarantine_found(indices[j], inputs[j], targets[j])
            inputs, targets = masked(inputs, targets, bad)
        return inputs, targets

    def _readable(self, index: int) -> bool:
        try:
            self.data.check_readable(index)
            self.data.sequence(index)
        except Exception:
            return False
        return True

    def _quarantine_found(self, index: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        key = self.data.key(index)
        self.data.quarantine([key])
        ids = torch.cat([inputs, targets[-1:]])
        self._emit(
            DATA_QUARANTINE,
            {
                "replica": self.replica_id,
                "rank": self.rank,
                "index": index,
                "key": key,
                **self.data.where(key),
                "groups": [self.replica_id],
                "steps": [self.manager.current_step() + 1],
                "found": "vocabulary",
                "what": f"token id {int(ids.max())} outside the vocabulary of "
                f"{self.cfg.data.vocab_size}",
            },
        )

    def _suspect_data(self, indices: list[int], rows: list[int], exc: Exception) -> None:
        """Journal the sequences (``rows`` of a batch of ``indices``) that a pass or a read
        failed on, if any are to blame (``data.suspect``), and raise :class:`BadData` from
        ``exc`` (the group fails: its failure says the data is to blame, so it is no crash
        loop of the trainer's, ``harness.job.trainer_deaths``); nothing if none is: the
        failure is the group's (``harness.job.poison``), and the caller re-raises ``exc``."""
        if not rows:
            return
        self._emit(
            DATA_SUSPECT,
            {
                "replica": self.replica_id,
                "rank": self.rank,
                "step": self.manager.current_step() + 1,
                "what": f"{type(exc).__name__}: {exc}"[:300],
                "sequences": self._sequences(indices, rows),
            },
        )
        raise BadData(
            f"{type(exc).__name__} on {len(rows)} sequence(s) of this batch, journaled as "
            "suspects (data.suspect)"
        ) from exc

    def _suspect_nonfinite(
        self, slot: int | None, logits: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Journal the sequences of this batch whose own loss is not finite (all of them if
        none is alone) as suspects, ``found = "nonfinite"``; the step goes on, this rank's
        gradients counting as zeros. Every group checksums the step (``Asks.nonfinite``): the
        controller quarantines them if this group's weights check equal to the others', and
        heals the group if not (``harness.job.divergence``)."""
        indices = self.data.indices(slot)
        with torch.no_grad():
            rows = [
                j for j in range(targets.shape[0])
                if bool((targets[j] != IGNORE).any())
                and not bool(torch.isfinite(loss_fn(logits[j : j + 1], targets[j : j + 1])))
            ]  # fmt: skip
        self._emit(
            DATA_SUSPECT,
            {
                "replica": self.replica_id,
                "rank": self.rank,
                "step": self.manager.current_step() + 1,
                "found": "nonfinite",
                "what": "non-finite loss",
                "sequences": self._sequences(indices, rows or range(len(indices))),
            },
        )

    def _sequences(self, indices: list[int], rows: Iterable[int]) -> list[dict[str, Any]]:
        """Rows ``rows`` of a batch of ``indices`` as a ``data.suspect`` record names them."""
        out = []
        for j in rows:
            key = self.data.key(indices[j])
            out.append({"index": indices[j], "key": key, **self.data.where(key)})
        return out

    def _raises(self, inputs: torch.Tensor) -> bool:
        try:
            with torch.no_grad():
                self.model(inputs)
        except Exception:
            return True
        return False

    def poison_data(self, key: int, effect: str = "unreadable") -> None:
        """Fault hook (``poison_data``): the data of ``key`` cannot be read from now on, or
        (``effect = "nonfinite"``) its loss is NaN."""
        self.data.poison(key, effect)

    def quarantine_data(self, keys: list[int]) -> None:
        """Skip the data of ``keys`` from the next pass on (``harness.job.poison``)."""
        self.data.quarantine(keys)

    def _join_quorum(self) -> bool:
        """``start_quorum``, surviving a quorum service that went away mid-request (its restart
        drops the request): the attempt counts as an aborted step and the next one asks again.

        The retry boundary: consecutive failures past ``MAX_QUORUM_FAILURES`` raise, so a quorum
        service that never comes back fails the group instead of spinning forever.

        A quorum service restarted under it (a controller taken over) is asked again by
        torchft's own retries (:func:`quorum_retries`), not here: a request that gives up on
        this side while the service counts it in a quorum would leave the other groups waiting
        for it in the rendezvous."""
        try:
            self.manager.start_quorum()
        except Exception as exc:
            self._quorum_failures += 1
            if self._quorum_failures > MAX_QUORUM_FAILURES:
                raise
            forget_failed_quorum(self.manager)
            step = self.manager.current_step() + 1
            self._emit(
                STEP_ABORT,
                {
                    "replica": self.replica_id,
                    "rank": self.rank,
                    "step": step,
                    "reason": f"quorum failed: {exc!r}"[:300],
                },
            )
            time.sleep(min(1.0, 0.05 * self._quorum_failures))
            return False
        self._quorum_failures = 0
        if self._awaiting_heal:
            self._check_healed()
        return True

    def _check_healed(self) -> None:
        """After a quorum of a trainer that skipped its checkpoint (``peers_hold_state``): it
        heals from a peer in that quorum, which the quorum service issues only with a live member
        at the highest step any live member reported (``harness.quorum.rule``). If the quorum
        still left it at step 0, every group holding committed state died since it started;
        training on would commit the job's steps again from the initial weights, so with a
        checkpoint on disk it fails instead (:class:`PeersGone`), and the group's restart, with
        no live group ahead of it, loads the checkpoint. A heal that failed (its source died
        mid-heal) aborts this step; the next quorum heals again and is checked then."""
        if self.manager.errored() is not None:
            return
        self._awaiting_heal = False
        if self.manager.current_step() > 0:
            return
        newest = self._newest_checkpoint_listed()
        if newest > 0:
            raise PeersGone(
                f"replica {self.replica_id} rank {self.rank} started without its checkpoint to "
                "heal from a live group, but its first quorum has no group with committed "
                f"state; step {newest} is on disk: restart the group to load it"
            )

    def _newest_checkpoint_listed(self) -> int:
        """The newest checkpoint step on disk for this rank (listed, not verified), or -1."""
        if self._ckpt_dir is None:
            return -1
        if self._dcp is not None:
            from harness.rank import dcp_checkpoint

            return max(dcp_checkpoint.steps(self._ckpt_dir), default=-1)
        folders = self._ckpt_dir.glob(f"replica_*_rank_{self.rank}")
        return max((s for f in folders for s in checkpoint.steps(f)), default=-1)

    def _average_gradients(self, finite: bool) -> bool:
        """Average this step's gradients over every rank of every participating group (the
        group's layout: ``harness.rank.group_layout``). With a sparse quorum the quorum flag
        rides along; returns whether any rank of any participating group raised it (the same
        answer everywhere the allreduce succeeded). ``finite``: this rank's loss was finite; a
        corrupted replica's NaN must not reach the other groups, so it contributes nothing,
        commits, and is healed (harness.job.divergence).

        torchft averages over participants; on a peer failure it records the error (so
        should_commit says no) instead of raising. Then close the communicator at once: a
        survivor blocked on this rank would otherwise wait out the process-group timeout."""
        agreed = self.layout.average(self.model, contribute=finite)
        if agreed.quorum:
            self._quorum_asked.clear()  # the quorum it asks for comes at the next step
        self._group_asks = agreed
        failed = self.manager.errored()
        if failed is not None:
            close_communicator(self._pg, failed.original_exception)
        return bool(agreed.quorum)

    def _asks(self, *, nonfinite: bool) -> Asks:
        """This rank's asks for its layout to agree on (:class:`Asks`), read before each
        backward pass and cleared only once honoured: an ask that a pass done again (an
        overlapped quorum that changed the state) or an uncommitted step read is not lost."""
        quorum = None
        if self._quorum_every > 1:  # a rank's hold rides the agreed flag: no group splits
            quorum = self._quorum_asked.is_set() or self._holding_quorum()
        checkpoint = None
        if self._dcp is not None and self._dcp.pg is not None:  # the group writes together
            checkpoint = self._checkpoint_asked.is_set()
        return Asks(quorum=quorum, checkpoint=checkpoint, nonfinite=nonfinite)

    def _across_groups(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over the participating groups (torchft)."""
        self.manager.allreduce(tensor).wait()

    # --- state: what heals and checkpoints -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's model, optimizer and data state (its own shards, when sharded)."""
        state = self.layout.state_dict(self.model, self.optimizer)
        return {**state, "data": self.data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._wait_staged()
        with self._state_lock:  # never in the middle of a (speculative) forward/backward
            self.layout.load_state_dict(self.model, self.optimizer, state)
            self.data.load_state_dict(state["data"])
            self._state_changed = True

    def checksum(self) -> str:
        """xxh3-64 over the parameters and the optimizer state, in a fixed order (hex): this
        rank's shards of them, when sharded (compared with the same rank of the other groups)."""
        h = xxhash.xxh3_64()
        local = self.layout.local
        for p in self.model.parameters():
            h.update(_bytes_of(local(p)))
        state = self.optimizer.state_dict()["state"]
        for idx in sorted(state):
            for key in sorted(state[idx]):
                v = state[idx][key]
                if isinstance(v, torch.Tensor):
                    h.update(_bytes_of(local(v)))
                else:
                    h.update(repr(v).encode())
        return h.hexdigest()

    # --- checkpoints -----------------------------------------------------------------------

    def _checkpoint_root(self, run_dir: str | None) -> Path | None:
        from harness.job.checkpoint_dir import checkpoint_root

        return checkpoint_root(self.cfg, run_dir)

    def _maybe_checkpoint(self, step: int) -> None:
        """At a checkpoint step, snapshot the state here and have the background writer make it
        durable. Only the snapshot (``torch.save`` to memory: the consistent copy, taken between
        steps) is on this thread; the writes and fsyncs are not, because the quorum is a barrier
        and a long step here would be a long step for every group. At most one write is in
        flight: a previous one still running is waited for first (bounded memory, in-order
        files), and one that failed raises here. The ``checkpoint.save`` record is emitted by
        the writer once the manifest is written, i.e. when the checkpoint is durable."""
        if self._dcp is not None:
            self._maybe_checkpoint_dcp(step)
            return
        # One writer per rank index per step: the group with replica rank 0 in this quorum.
        # Each group writes its own folder, so two writers never share (or prune) one.
        asked = self._checkpoint_asked.is_set()
        if self._ckpt_dir is None or (step % self.cfg.checkpoint.every_steps and not asked):
            return
        if self.manager.participating_rank() != 0:
            return
        self._checkpoint_asked.clear()
        t0 = time.perf_counter()
        self._writer.wait()  # the previous write first; raises if it failed
        t_snap = time.perf_counter()
        payload = checkpoint.snapshot({**self.state_dict(), "manager": self.manager.state_dict()})
        snap_s = time.perf_counter() - t_snap
        blocked_s = time.perf_counter() - t0  # this thread's share: serialize + waiting
        folder = self._ckpt_dir / f"replica_{self.replica_id}_rank_{self.rank}"
        keep = self.cfg.checkpoint.keep

        delay = self._checkpoint_delay
        if self.rank == 0:
            self._emit(CHECKPOINT_START, {"replica": self.replica_id, "rank": 0, "step": step})

        def write() -> None:  # on the writer thread
            time.sleep(delay)  # a slow disk (faults.inworker.set_checkpoint_delay)
            t_write = time.perf_counter()
            path = checkpoint.write(folder, step, payload, keep=keep)
            seconds = snap_s + time.perf_counter() - t_write
            self._emit_checkpoint_saved(step, path, seconds=seconds, blocked_s=blocked_s)

        self._writer.submit(write)

    def _resume(self) -> None:
        """Load the newest valid checkpoint that every rank of this group has, written by any
        group for this rank's index (all groups hold identical state at a given step). The
        group's ranks agree on the step (``checkpoint.common_step``): each rank writes its own
        files, and a crash can leave one rank a checkpoint newer than another's."""
        if self._ckpt_dir is None:
            return
        if self._dcp is not None:
            self._resume_dcp()
            return
        folders = sorted(self._ckpt_dir.glob(f"replica_*_rank_{self.rank}"))
        held = {folder: checkpoint.steps(folder) for folder in folders}
        bad: set[tuple[Path, int]] = set()  # failed verification: skipped from then on
        loaded: dict[str, Any] = {}  # the newest verified so far: {"step", "state", "folder"}

        def newest_at_most(bound: int) -> int:
            candidates = sorted(
                {(step, folder) for folder, ss in held.items() for step in ss if step <= bound},
                key=lambda c: (-c[0], str(c[1])),
            )
            for step, folder in candidates:
                if loaded.get("step") == step:
                    return step
                if (folder, step) in bad:
                    continue
                state = checkpoint.load(folder, step)
                if state is None:
                    bad.add((folder, step))
                    continue
                loaded.update(step=step, state=state, folder=folder)  # one state held at a time
                return step
            return -1

        step = checkpoint.common_step(newest_at_most, self.layout.group_min)
        if step < 0:
            return
        # common_step's last round asked every rank for the agreed step: loaded holds it.
        assert loaded["step"] == step, (loaded.get("step"), step)
        state, folder = loaded["state"], loaded["folder"]
        self.load_state_dict(state)
        self.manager.load_state_dict(state["manager"])
        self._emit(
            CHECKPOINT_LOAD,
            {"replica": self.replica_id, "rank": self.rank, "step": step, "path": str(folder)},
        )

    # --- DCP checkpoints (checkpoint.format = "dcp") -----------------------------------------

    def _ckpt_format(self) -> str:
        return self.cfg.checkpoint.resolved_format(self.cfg.parallel.group)

    def _dcp_init(self) -> None:
        """The writer of this rank (every rank of a sharded group writes its shards; rank 0 of a
        replicated group writes the whole state alone) and the group's checkpoint process
        group (a collective: every rank of the group builds it here)."""
        from harness.rank import dcp_checkpoint

        assert self._ckpt_dir is not None
        pg = self.layout.checkpoint_group()
        writer = None
        if pg is not None or self.rank == 0:
            writer = dcp_checkpoint.Writer(
                self._ckpt_dir, pg, rank=self.rank, keep=self.cfg.checkpoint.keep,
                on_durable=self._dcp_durable,
            )  # fmt: skip
        self._dcp = _DcpCheckpoints(writer, pg)

    def _wait_staged(self) -> None:
        """Wait for a background DCP checkpoint's staging copy, if one is being taken: the
        state must not change under it (the optimizer's step, a heal's load)."""
        if self._dcp is not None and self._dcp.writer is not None:
            self._dcp.writer.wait_staged()

    def _dcp_state(self, step: int) -> dict[str, Any]:
        """The checkpoint's state in torchtitan's layout, plus torchft's Manager state
        (``ft_manager``: its step and committed batches)."""
        from harness.rank import dcp_checkpoint

        d = self.cfg.data
        tokens = self.data.consumed * self.cfg.ranks * d.batch_size * d.seq_len
        state = dcp_checkpoint.app_state(
            self.model, self.optimizer, dataloader=self.data.state_dict(),
            train_state={"step": step, "ntokens_seen": tokens},
        )  # fmt: skip
        state["ft_manager"] = dict(self.manager.state_dict())
        return state

    def _maybe_checkpoint_dcp(self, step: int) -> None:
        """As :meth:`_maybe_checkpoint`, in DCP folders: the group with replica rank 0 in this
        quorum writes, every one of its ranks its own shards, together (DCP's collectives), so
        its ranks first agree whether one was asked for; the step waits for the staging copy
        only, the write goes on in the background."""
        assert self._dcp is not None
        if self.manager.participating_rank() != 0:
            return
        writer = self._dcp.writer
        asked = self._checkpoint_asked.is_set()
        if self._dcp.pg is not None:  # agreed by the group, with the step's gradients (_asks)
            asked = bool(self._group_asks.checkpoint)
        if writer is None or (step % self.cfg.checkpoint.every_steps and not asked):
            return
        self._checkpoint_asked.clear()
        t0 = time.perf_counter()
        self._dcp.started[step] = t0
        writer.commit_delay_s = self._checkpoint_delay
        if self.rank == 0:
            self._emit(CHECKPOINT_START, {"replica": self.replica_id, "rank": 0, "step": step})
        writer.save(step, self._dcp_state(step))  # waits for the previous write, then stages
        self._dcp.blocked_s = time.perf_counter() - t0

    def _dcp_durable(self, step: int, path: Path) -> None:
        """On the writer's thread of the writing group's rank 0, once checkpoint ``step`` is in
        place (every rank's shards written, the folder renamed)."""
        assert self._dcp is not None
        t0 = self._dcp.started.pop(step, None)
        self._emit_checkpoint_saved(
            step, path, format="dcp",
            seconds=time.perf_counter() - t0 if t0 is not None else None,
            blocked_s=self._dcp.blocked_s,
        )  # fmt: skip

    def _emit_checkpoint_saved(
        self, step: int, path: Path, *, seconds: float | None, blocked_s: float | None,
        format: str | None = None,
    ) -> None:  # fmt: skip
        """The ``checkpoint.save`` record: checkpoint ``step`` is durable at ``path``, having
        taken ``seconds`` from the snapshot on, ``blocked_s`` of them on the training thread."""
        record: dict[str, Any] = {
            "replica": self.replica_id, "rank": self.rank, "step": step, "path": str(path),
        }  # fmt: skip
        if format is not None:
            record["format"] = format
        record.update(seconds=seconds, blocked_s=blocked_s)
        self._emit(CHECKPOINT_SAVE, record)

    def _resume_dcp(self) -> None:
        """Load the newest complete DCP checkpoint, whatever shard count wrote it (DCP reshards
        on load); the group's ranks agree on the step (a folder may be renamed into place
        between two ranks' looks)."""
        from harness.rank import dcp_checkpoint

        assert self._ckpt_dir is not None
        held = dcp_checkpoint.steps(self._ckpt_dir)
        step = checkpoint.common_step(
            lambda bound: max((s for s in held if s <= bound), default=-1), self.layout.group_min
        )
        if step < 0:
            return
        state = self._dcp_state(0)
        assert self._dcp is not None
        dcp_checkpoint.load(self._ckpt_dir, step, state, self._dcp.pg)
        with self._state_lock:
            dcp_checkpoint.apply(self.model, self.optimizer, state)
            self.data.load_state_dict(state["dataloader"])
            self._state_changed = True
        self.manager.load_state_dict(state["ft_manager"])
        self._emit(
            CHECKPOINT_LOAD,
            {
                "replica": self.replica_id,
                "rank": self.rank,
                "step": step,
                "path": str(dcp_checkpoint.step_dir(self._ckpt_dir, step)),
                "format": "dcp",
            },
        )

    # --- hooks for the runtime and the fault injector ---------------------------------------

    def stop(self, after_step: int | None = None) -> None:
        """Return from :meth:`train` once ``after_step`` steps are committed; None: after the
        current step (then return once the pending checkpoint write, if any, is durable).
        Thread-safe.

        A job stops every group at one step (``harness.rank.actors.stop_training``): each quorum
        is a barrier, so a group that stops a step before the others leaves them waiting in the
        next quorum for it, until the join timeout (5 s by default), to commit one step more."""
        self._stop_after = self.manager.current_step() if after_step is None else after_step

    def checkpoint_next_step(self) -> None:
        """Write a checkpoint at the next committed step, whatever ``every_steps`` says (the
        group that is replica rank 0 in that quorum writes it; its ``checkpoint.save`` record
        comes once the checkpoint is durable). Thread-safe."""
        self._checkpoint_asked.set()

    def set_step_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` inside every step from now on (0 heals it). Thread-safe."""
        self._step_delay = max(0.0, float(seconds))

    def set_checkpoint_delay(self, seconds: float) -> None:
        """Hold each checkpoint this rank writes ``seconds`` before it is in place, from the
        next one on (0 heals it): a slow disk. DCP: the writing group's rank 0 waits with every
        shard and the metadata written, before the rename; ``torch``: each rank before its
        file. Thread-safe."""
        self._checkpoint_delay = max(0.0, float(seconds))

    def set_serve_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` before serving each heal from now on (0 heals it): a source behind
        a slow link (``harness.rank.healing.SlowServe``). Thread-safe."""
        slow_serve(self.manager).delay_s = max(0.0, float(seconds))

    def abort_collectives(self) -> None:
        """Abort this rank's cross-group communicator, as a NIC/NCCL failure would. The collective
        in flight (or the next one) fails, the step aborts, the process lives; the next quorum
        reconfigures a fresh communicator (torchft bumps the quorum id after a commit failure)
        and training goes on without a restart. Thread-safe."""
        self.manager.report_error(RuntimeError("collectives aborted by fault injection"))
        self._pg.abort()

    def close(self) -> None:
        """Wait for the pending checkpoint write (raising its error if :meth:`train` has not),
        then shut down the Manager (and the group store if this rank hosts it)."""
        try:
            self._writer.close()
            if self._dcp is not None and self._dcp.writer is not None:
                self._dcp.writer.close()
        finally:
            self._quorum_thread.shutdown(wait=False)
            self.manager.shutdown(wait=False)
            self._store = None

    # --- plumbing ---------------------------------------------------------------------------

    def _group_layout(self, store_addr: str) -> GroupLayout:
        """How this group holds the model (``parallel.group``), over the group's store."""
        ranks = self.cfg.ranks
        if ranks == 1:
            return Replicated(self._across_groups, None, 1)
        host, port = store_addr.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        t = self.cfg.timeouts
        timeout = intra_group_timeout(t.process_group_timeout, t.manager_timeout)
        if self.cfg.parallel.group == "fsdp":
            init_group_world(store, self.rank, ranks, timeout)
            return Sharded(self.model, model_blocks(self.model), self._across_groups, timeout)
        intra = intra_group_pg(store, self.rank, ranks, timeout)
        return Replicated(self._across_groups, intra, ranks)


class _Laps:
    """Seconds of each part of a trainer's construction, as ``lap(part)`` is called at each
    part's end (the ``trainer.start`` record)."""

    def __init__(self) -> None:
        self._t0 = self._t = time.perf_counter()
        self.parts: dict[str, float] = {}

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = round(now - self._t, 4)
        self._t = now

    def total(self) -> float:
        return round(self._t - self._t0, 4)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous (ndarray.data: numpy's
    stubs give ndarray the buffer protocol only from Python 3.12, so hashers reject the array
    itself for 3.11)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data


def threads_per_worker(cfg: JobConfig) -> int:
    """Intra-op threads for one rank: the host's cores shared by every rank of the job.

    Several trainers share a host's cores; torch's default (all cores each) oversubscribes them,
    and on 2 cores that made a tiny step 15-50x slower."""
    return max(1, (os.cpu_count() or 1) // (cfg.replicas * cfg.ranks))


def run_trainer(
    cfg_dict: dict[str, Any],
    replica_id: int,
    rank: int,
    store_addr: str | None,
    lighthouse_addr: str,
    journal_path: str,
) -> dict[str, Any]:
    """Entry point for a plain subprocess: build a Trainer from ``config_to_dict`` data, journal
    to ``journal_path`` (one JSONL file per process), train to the job's step count, and return
    the summary. Checkpoints (if enabled) go under the journal's folder."""

    from runtime.journal import Journal

    cfg = config_from_dict(cfg_dict)
    torch.set_num_threads(threads_per_worker(cfg))
    journal = Journal(journal_path, job=cfg.name, replica=replica_id, rank=rank)
    journal.emit(PROC_START, replica=replica_id, rank=rank, host=0, pid=os.getpid(), spare=False)
    trainer = Trainer(
        cfg,
        replica_id=replica_id,
        rank=rank,
        store_addr=store_addr,
        lighthouse_addr=lighthouse_addr,
        emit=lambda event, fields: journal.emit(event, **fields),
        run_dir=str(Path(journal_path).parent),
    )
    try:
        return trainer.train()
    finally:
        trainer.close()
        journal.close()
