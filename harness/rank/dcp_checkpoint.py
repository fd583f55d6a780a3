"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) folders in torchtitan's layout,
written in the background by every rank of one group, loadable onto another shard count.

Layout under ``root`` (torchtitan's ``CheckpointManager``: ``{folder}/step-{N}``)::

    step-40/.metadata           DCP's global metadata (written last, by the coordinator)
    step-40/__0_0.distcp        rank 0's shards
    step-40/__1_0.distcp        rank 1's shards
    .step-50.tmp/               a checkpoint being written: never loaded

The state is torchtitan's: the model's entries flattened to the top level (FQN keys), then
``optimizer`` (flat, FQN-keyed: ``state.{fqn}.{name}``, ``param_groups.{fqn}.{key}``),
``lr_scheduler`` (``{"last_epoch"}``), ``dataloader`` and ``train_state`` (``{"step",
"ntokens_seen"}``); :func:`app_state` builds it. torchtitan's own ``CheckpointManager`` loads one
(``tests/integration/test_torchtitan_loads_dcp.py``), all but ``dataloader``: its dataloader's
state is its iterator's, ours a data position.

Atomicity: every rank writes into ``.step-N.tmp``; once DCP's coordinator (rank 0 of the writing
group) has every rank's write results and has written ``.metadata``, it renames the folder to
``step-N`` and fsyncs the parent. So a crash at any instant leaves the previous ``step-N`` the
newest one, and a ``step-N`` folder is complete.

Trust: a planted checkpoint must not run code. DCP itself unpickles ``.metadata`` with plain
``pickle`` and non-tensor values with ``torch.load(weights_only=False)``; loads here go through
:class:`TrustedReader` (``.metadata`` unpickled with an allowlist of DCP's metadata classes,
``torch.Size``, dtypes and paths) and :class:`DataOnlyLoadPlanner` (``weights_only=True``), and a
checkpoint that needs anything else fails to load with :class:`CheckpointRefused`.

Async writes (:class:`Writer`): ``dcp.async_save`` with a stager that copies the state on a
thread of its own while training goes on (the caller waits for the copy,
:meth:`Writer.wait_staged`, before it changes the state: before the optimizer's next step, before
a heal loads), then writes on a background thread over the group's own gloo process group. On CPU
the stager must not ask for pinned or shared memory or non-blocking copies (``DefaultStager``
raises or warns without an accelerator: ``../shared/HSDP.md`` section 3).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from harness.rank.checkpoint import fsync_dir

_STEP = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^\.step-(\d+)\.tmp$")
#: torchtitan's keys for the entries that are not the model's.
OPTIMIZER, LR_SCHEDULER = "optimizer", "lr_scheduler"
DATALOADER, TRAIN_STATE = "dataloader", "train_state"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointRefused(RuntimeError):
    """A checkpoint folder that would need code (or anything not in the allowlist) to load."""


# --- the state ------------------------------------------------------------------------------


def app_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    dataloader: dict[str, Any],
    train_state: dict[str, Any],
    lr_scheduler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state a checkpoint holds, in torchtitan's layout: the model's entries (its own shards,
    as DTensors, when sharded) at the top level, then ``optimizer`` flattened by FQN,
    ``lr_scheduler`` (torchtitan's keeps ``{"last_epoch"}`` only: a constant learning rate has
    nothing else; default: ``train_state``'s step), ``dataloader`` and ``train_state``. The
    tensors are the live ones (no copy): a save stages them, a load writes into them (then
    :func:`apply`)."""
    # The module's own state_dict, as torchtitan's ModelWrapper takes it: its hooks name the
    # entries (torchtitan's fused QKV saves as wq/wk/wv, which DCP's get_model_state_dict cannot
    # map back to attributes).
    state: dict[str, Any] = model_state(model)
    optim = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    for key in [k for k in optim if k.startswith("param_groups.") and k.endswith(".lr")]:
        # torchtitan's scheduler (LambdaLR) puts initial_lr in every param group, and its
        # loader asks for it; with no scheduler, the learning rate is the initial one.
        optim.setdefault(key[: -len(".lr")] + ".initial_lr", optim[key])
    state[OPTIMIZER] = optim
    if lr_scheduler is None:
        lr_scheduler = {"last_epoch": int(train_state.get("step", 0))}
    state[LR_SCHEDULER] = dict(lr_scheduler)
    state[DATALOADER] = dict(dataloader)
    state[TRAIN_STATE] = dict(train_state)
    return state


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()``, with torchtitan's fused QKV split into ``wq``/``wk``/``wv`` shard
    by shard where it can be. torchtitan's own split (a state-dict hook of the attention module)
    gathers each layer's ``wqkv`` whole first, one collective per layer on the training thread
    (14 of the 15 ms ``state_dict()`` takes on llama3 debug sharded 2 ways on CPU): when
    ``wqkv`` is sharded on dim 0 over a 1-D mesh that divides its KV heads, each rank holds whole
    KV groups, so the split is local and gives the same ``wq``/``wk``/``wv`` (the same global
    tensors, keys and layout; DCP records them as shards, not replicated). Any other placement is
    left to torchtitan's hook."""
    handles = [
        cast(nn.Module, m.wqkv).register_state_dict_post_hook(_split_fused_qkv_locally(m))
        for m in model.modules()
        if hasattr(m, "wqkv") and hasattr(m, "_split_qkv_on_save")
    ]
    try:
        return dict(model.state_dict())
    finally:
        for h in handles:
            h.remove()


def _split_fused_qkv_locally(attn: nn.Module) -> Callable[..., None]:
    """A post hook for ``attn.wqkv``'s state dict: its ``weight`` and ``bias`` become the
    parent's ``wq``/``wk``/``wv`` entries, split on this rank's shard (torchtitan's
    ``_split_qkv_on_save`` then finds no ``wqkv`` entry to split); entries it cannot split
    locally are left as they are."""
    from torch.distributed.tensor import DTensor, Shard

    # torchtitan's attention keeps these as plain ints (nn.Module's typing says Tensor | Module)
    hd, hpk, r = (cast(int, getattr(attn, a)) for a in ("head_dim", "heads_per_kv", "r_dim"))

    def hook(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        parent = prefix[: -len("wqkv.")]
        for param in ("weight", "bias"):
            t = state.get(prefix + param)
            if not isinstance(t, DTensor) or t.device_mesh.ndim != 1:
                continue
            n_kv, shards = t.shape[0] // (r * hd), t.device_mesh.size()
            if tuple(t.placements) != (Shard(0),) or n_kv % shards:
                continue
            local, tail = t.to_local(), tuple(t.shape[1:])
            w = local.reshape(n_kv // shards, r, hd, *tail)
            for name, part in (("wq", w[:, :hpk]), ("wk", w[:, hpk]), ("wv", w[:, hpk + 1])):
                piece = part.reshape(-1, *tail).contiguous()
                rows = piece.shape[0] * shards
                state[f"{parent}{name}.{param}"] = DTensor.from_local(
                    piece, t.device_mesh, [Shard(0)], run_check=False,
                    shape=torch.Size((rows, *tail)), stride=piece.stride(),
                )  # fmt: skip
            del state[prefix + param]

    return hook


def apply(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded :func:`app_state` (and any entries added to it) into ``model`` and
    ``optimizer`` (the model's tensors were loaded in place; the optimizer's state is rebuilt
    from its flat form)."""
    # The model's entries are the top-level tensors; every other entry is a dict of its own.
    model.load_state_dict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER], options=_OPTIM_OPTIONS)


# --- where checkpoints are ------------------------------------------------------------------


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step}"


def _tmp_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f".step-{step}.tmp"


def steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps with a complete checkpoint under ``root`` (a ``step-N`` folder holding
    ``.metadata``, as torchtitan's ``_find_load_step`` asks), newest first."""
    d = Path(root)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP.match(p.name)
        if m and (p / ".metadata").is_file():
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


def _commit(root: Path, step: int, keep: int) -> Path:
    """Rename a finished ``.step-N.tmp`` into place (replacing an older ``step-N``: a step
    written again after the job went back to an older checkpoint), make the rename durable,
    and prune to the newest ``keep``. Run by the writing group's rank 0 once every rank's
    write is in."""
    tmp, final = _tmp_dir(root, step), step_dir(root, step)
    for f in tmp.iterdir():  # DCP fsyncs its data files; the metadata's rename needs its folder's
        if f.is_file():
            os.chmod(f, 0o600)
    os.chmod(tmp, 0o700)  # the weights are the run's, not every local user's
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    kept = steps(root)
    for old in kept[keep:]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    # A write that died with its group leaves its .step-M.tmp behind; one older than every
    # checkpoint kept is past finishing (its writer is gone, or would have finished long
    # since): removed. Younger ones may be another group's write still under way.
    oldest = min(kept[:keep], default=step)
    for p in root.glob(".step-*.tmp"):
        m = _TMP.match(p.name)
        if m and int(m.group(1)) < oldest:
            shutil.rmtree(p, ignore_errors=True)
    return final


# --- writing --------------------------------------------------------------------------------


class Writer:
    """Writes checkpoints from one rank of a group; every rank of the writing group calls
    :meth:`save` with the same step, in the same order. Used from one thread (the training
    thread), at most one checkpoint in flight.

    ``pg``: the process group over the group's ranks that DCP's collectives run on (torchtitan
    gives its checkpointer a gloo group of its own, so the background write never shares a
    communicator with the training's collectives); None: this process writes alone.
    ``on_durable(step, path)`` runs on rank 0, on the writing thread, once a checkpoint is in
    place.

    An error in a background write is not lost: the next :meth:`save` or :meth:`wait` raises
    it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        pg: Any,
        *,
        rank: int,
        keep: int = 2,
        asynchronous: bool = True,
        on_durable: Callable[[int, Path], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self._pg = pg
        self._rank = rank
        self._keep = keep
        self._async = asynchronous
        self._on_durable = on_durable
        #: Seconds rank 0 waits, every shard and the metadata written, before the rename.
        self.commit_delay_s = 0.0
        self._pending: threading.Event | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._stager: Any = None
        if asynchronous:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Staging on a thread of its own (use_async_staging), as torchtitan's async modes
            # do: the copy overlaps the next forward and backward passes, which read the state
            # and do not change it; the caller waits for it (wait_staged) before it does. No
            # pinned or shared memory and no non-blocking copy: they need an accelerator.
            self._stager = DefaultStager(StagingOptions(False, False, True, False))
        self._staged: Future[Any] | None = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` (:func:`app_state`) as ``step``. An asynchronous writer returns
        at once: the staging copy and then the write go on in the background, and the caller
        must not change the state before :meth:`wait_staged` returns. A synchronous one returns
        once the checkpoint is in place. Waits for the previous write first and raises its
        error."""
        self.wait()
        if self._rank == 0:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = _tmp_dir(self.root, step)
        if not self._async:
            dcp.save(state, checkpoint_id=tmp, process_group=self._pg, no_dist=self._pg is None)
            if self._rank == 0:
                self._done(step)
            return
        response = dcp.async_save(
            state,
            checkpoint_id=tmp,
            process_group=self._pg,
            async_stager=self._stager,
            no_dist=self._pg is None,
        )
        # An AsyncSaveResponse with a stager that stages asynchronously (ours), else a Future.
        if isinstance(response, Future):
            upload = response
        else:
            upload, self._staged = response.upload_completion, response.staging_completion
        settled = threading.Event()  # the write is in place (or failed): after the commit
        self._pending = settled

        def finished(f: Future[Any]) -> None:  # on DCP's writer thread
            try:
                f.result()
                if self._rank == 0:
                    self._done(step)
            except BaseException as e:  # raised on the training thread by the next save/wait
                with self._lock:
                    self._error = e
            finally:
                settled.set()

        upload.add_done_callback(finished)

    def _done(self, step: int) -> None:
        if self.commit_delay_s > 0:  # a slow disk (fault injection): written, not yet in place
            time.sleep(self.commit_delay_s)
        path = _commit(self.root, step, self._keep)
        if self._on_durable is not None:
            self._on_durable(step, path)

    def wait_staged(self) -> bool:
        """Block until the last checkpoint's staging copy is taken (the state may change from
        then on); whether there was one to wait for (quick when nothing is being staged). A
        staging error is raised by :meth:`wait`, with the write's."""
        staged, self._staged = self._staged, None
        if staged is not None:
            futures_wait([staged])  # an error here fails the upload too: wait() raises it
        return staged is not None

    def busy(self) -> bool:
        """A write is handed over and not in place yet."""
        return self._pending is not None and not self._pending.is_set()

    def wait(self) -> None:
        """Block until no write is in flight; raise the error of one that failed (once)."""
        self.wait_staged()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()


# --- loading --------------------------------------------------------------------------------

#: What a DCP ``.metadata`` pickle may name: DCP's own metadata classes, and plain values.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointRefused(
            f"checkpoint metadata names {module}.{name}, which a checkpoint has no need of "
            "(refused rather than unpickled: it could run code)"
        )


class TrustedReader(FileSystemReader):
    """DCP's file reader, unpickling ``.metadata`` with an allowlist. ``refused``: why it refused
    (DCP wraps the error in its own)."""

    refused: CheckpointRefused | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        data = Path(self.path, name).read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            if not isinstance(metadata, Metadata):
                raise CheckpointRefused(f"metadata is a {type(metadata).__name__}")
        except CheckpointRefused as e:
            self.refused = CheckpointRefused(f"{self.path}: {e}")
            raise self.refused from None
        except Exception as e:
            self.refused = CheckpointRefused(f"{self.path}: unreadable metadata ({e})")
            raise self.refused from e
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as DCP's own read_metadata does
        metadata.storage_meta = storage_meta
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values as data only. ``refused``: why it
    refused (DCP wraps the error in its own)."""

    refused: CheckpointRefused | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            fqn = read_item.dest_index.fqn
            self.refused = CheckpointRefused(f"{fqn}: not plain data (it would need code to load)")
            raise self.refused from e
        super().load_bytes(read_item, _as_bytes(loaded))


def _as_bytes(value: Any) -> io.BytesIO:
    """``value`` serialized again, for DCP's own ``load_bytes`` to place (it knows where the
    value goes in a flattened state dict); it reads it with ``weights_only=False``, but this is
    our own serialization of data that loaded with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def load(root: str | os.PathLike[str], step: int, state: dict[str, Any], pg: Any = None) -> None:
    """Load checkpoint ``step`` under ``root`` into ``state`` in place (:func:`app_state` of the
    model to load into: any shard count, or none; every rank of ``pg`` calls it; None: this
    process alone). Then :func:`apply` it. A checkpoint that needs code to load raises
    :class:`CheckpointRefused`."""
    from torch.distributed.checkpoint.api import CheckpointException

    path = step_dir(root, step)
    reader, planner = TrustedReader(path), DataOnlyLoadPlanner()
    try:
        dcp.load(
            state,
            checkpoint_id=path,
            storage_reader=reader,
            planner=planner,
            process_group=pg,
            no_dist=pg is None,
        )
    except CheckpointException as e:
        refused = reader.refused or planner.refused
        if refused is not None:
            raise refused from e
        raise
