"""How one replica group holds its model: whole in every rank (``parallel.group = "replicate"``)
or sharded over its ranks with FSDP2 (``"fsdp"``, HSDP with the groups).

The trainer (``harness.rank.trainer``) calls a layout for the three things that differ:

* **averaging the gradients** of a step over every rank of every participating group. Replicated:
  one flat allreduce within the group (when it has several ranks), then torchft's across the
  groups. Sharded: FSDP2 reduce-scatters each block's gradients within the group during the
  backward pass; after it, each rank averages its gradient shards with the same shards of the
  other groups through torchft's Manager, in one flat allreduce as a replicated rank does (one
  call per step, not one per block: on gloo a call per block, each waited for in FSDP2's hook,
  overlapped nothing and cost more). The step's :class:`Asks` (a sparse quorum's flag, a
  checkpoint asked for, a non-finite loss) ride on those collectives rather than on collectives
  of their own: floats more in the flat allreduce; sharded, one tiny allreduce within the group
  before the backward pass first agrees on them;
* **the state** a heal and a checkpoint carry: each rank's own tensors. Sharded, these are the
  local shards of the DTensors the model trains (rank r of a group heals from rank r of a peer,
  torchft pairs the ranks so), plain tensors that every transport carries and
  ``torch.load(weights_only=True)`` reads, named as the parameters are
  (:func:`trained_tensors`: not ``model.state_dict()``, whose hooks may rename and copy);
* **whether the quorum may overlap the pass** (``harness.rank.trainer.OVERLAP_QUORUM``): not when
  sharded. A heal must never land while FSDP2 has the parameters unsharded (torchft RFC 343,
  torchtitan issue 4753; the trainer's ``_state_lock`` would keep it out), and the pass is
  collective within the group: the speculative pass is run again after a quorum that changed a
  rank's state or slot, and a rank that ran it again alone would pair its collectives with the
  next pass of its group's other ranks. (Overlapping would need the group to agree first on
  running it again: not built.)

Sharded wiring (torch 2.13; ``../shared/HSDP.md``): each group is its own ``torch.distributed``
world, initialised on the group's store (the default process group of the rank's process, gloo
on CPU), with a 1-D device mesh over it; ``fully_shard`` wraps every transformer block and then
the root. FSDP2's reduce-scatter is forced to SUM (gloo's AVG under FSDP2 is reported to sum,
pytorch#162338) and FSDP2 divides by the group's ranks, then the flat allreduce averages over the
groups: the mean over every rank of every participating group
(``tests/integration/test_fsdp_group.py`` checks it numerically).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import nn

#: Where a sharded group's process group rendezvouses on the group's store.
FSDP_PREFIX = "harness/fsdp"
#: Where a replicated group's intra-group process group rendezvouses on the group's store.
INTRA_PREFIX = "harness/intra"

#: ``allreduce(tensor)``: average ``tensor`` in place over the participating groups (torchft's
#: ``Manager.allreduce`` and wait); a failure is recorded for ``should_commit``, not raised.
CrossGroup = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Asks:
    """What a rank was asked to do once this step commits, for its layout to agree on.

    Going in (:meth:`GroupLayout.backward`): this rank's own flags, None where nothing is to be
    agreed (every rank of every group passes None alike: it is the job's config). Coming out
    (:meth:`GroupLayout.average`), each False where it went in None:

    * ``quorum``: whether any rank of any participating group asked for a quorum at the next
      step (a sparse quorum's flag: a new member waits);
    * ``checkpoint``: whether any rank of this group was asked for a checkpoint (a group whose
      ranks write their shards together must agree to);
    * ``nonfinite``: whether any rank of any participating group had a non-finite loss in this
      step: every group then checksums the step, so that the controller can tell corrupted
      weights from data that gives a non-finite loss (``harness.job.divergence``)."""

    quorum: bool | None = None
    checkpoint: bool | None = None
    nonfinite: bool | None = None

    def crossing(self) -> list[bool]:
        """The flags that cross the groups, in order, where they are to be agreed."""
        return [bool(a) for a in (self.quorum, self.nonfinite) if a is not None]

    def crossed(self, values: list[bool], checkpoint: bool = False) -> Asks:
        """The agreed asks, from what :meth:`crossing` became across the groups."""
        got = iter(values)
        quorum = bool(next(got)) if self.quorum is not None else False
        nonfinite = bool(next(got)) if self.nonfinite is not None else False
        return Asks(quorum=quorum, checkpoint=checkpoint, nonfinite=nonfinite)


class GroupLayout(Protocol):
    """What the trainer asks of the way its group holds the model."""

    #: Whether the quorum may form while the pass runs (no collective across groups in it).
    overlap_quorum: bool
    #: Every rank runs the model's forward pass for a held-out evaluation (its parameters are
    #: spread over the ranks), not only rank 0.
    eval_on_every_rank: bool

    def backward(self, loss: torch.Tensor, asks: Asks) -> None:
        """The step's backward pass, with this rank's ``asks`` to agree on (see :class:`Asks`).
        Every rank of every group calls it once per pass, then :meth:`average`."""
        ...

    def average(self, model: nn.Module, *, contribute: bool) -> Asks:
        """After the backward pass: finish averaging the gradients over every rank of every
        participating group, and return the asks agreed (:class:`Asks`; False where none was
        to be agreed). ``contribute``: False when this rank's loss was not finite (its gradients
        count as zeros: a corrupted replica's NaN must not reach the other groups)."""
        ...

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` this rank holds (``t`` itself unless sharded), sharing storage."""
        ...

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model's and the optimizer's state as this rank's own plain tensors."""
        ...

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load what :meth:`state_dict` of the same rank of an identical group returned."""
        ...

    def group_min(self, value: int) -> int:
        """The smallest ``value`` over this group's ranks (a collective: every rank of the group
        calls it, in the same order)."""
        ...

    def checkpoint_group(self) -> Any:
        """The process group a DCP checkpoint of this group is written and loaded on (a
        collective to create, on every rank), or None: one rank writes the whole state alone,
        and each rank loads it alone (``harness.rank.dcp_checkpoint``)."""
        ...


class Replicated:
    """The whole model in every rank; ranks of a group average through a plain gloo group."""

    overlap_quorum = True
    eval_on_every_rank = False

    def __init__(
        self, across: CrossGroup, intra: torch.distributed.ProcessGroupGloo | None, ranks: int
    ) -> None:
        self._across = across
        self._intra = intra
        self._ranks = ranks
        self._asks = Asks()

    def backward(self, loss: torch.Tensor, asks: Asks) -> None:
        self._asks = asks
        loss.backward()

    def average(self, model: nn.Module, *, contribute: bool) -> Asks:
        """One flat allreduce per step (fewer, larger messages than one per tensor); the
        flags that cross the groups ride along as floats more. Rank 0 writes a checkpoint
        alone: its own ask is the group's."""
        if not contribute:
            model.zero_grad(set_to_none=False)
        grads = [p.grad for p in model.parameters() if p.grad is not None]

        def across(flat: torch.Tensor, n: int) -> None:
            if self._intra is not None:
                # A dead group peer raises: the group restarts. (torch's stub of
                # ProcessGroupGloo leaves out the collectives its pybind11 class has, allreduce
                # among them.)
                self._intra.allreduce([flat]).wait()  # type: ignore[attr-defined]
                flat /= self._ranks
            self._across(flat)

        agreed = _average_flat(grads, self._asks.crossing(), across)
        return self._asks.crossed(agreed, checkpoint=bool(self._asks.checkpoint))

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def checkpoint_group(self) -> Any:
        return None  # every rank holds the whole state: rank 0 writes it alone

    def group_min(self, value: int) -> int:
        if self._intra is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp(torch.distributed.ReduceOp.MIN)
        self._intra.allreduce([t], opts).wait()  # type: ignore[attr-defined]
        return int(t.item())


def _average_flat(
    grads: list[torch.Tensor],
    crossing: list[bool],
    reduce: Callable[[torch.Tensor, int], None],
) -> list[bool]:
    """Average ``grads`` in place as one flat tensor with the ``crossing`` flags as floats
    after them: ``reduce(flat, n)`` averages ``flat`` (its first ``n`` elements the
    gradients). Returns the flags agreed: each True where any participant raised it."""
    parts = [g.reshape(-1) for g in grads]
    dtype = parts[0].dtype if parts else torch.float32
    n = sum(p.numel() for p in parts)
    flat = torch.cat([*parts, torch.tensor([float(a) for a in crossing], dtype=dtype)])
    reduce(flat, n)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return (flat[n:] > 0).tolist()


def intra_group_timeout(process_group_timeout: float, manager_timeout: float) -> timedelta:
    """How long a collective within a group waits for the group's other ranks.

    Longer than a collective across groups: after a quorum the ranks of a group start the pass
    at different times when one of them is held up joining, each on its own, the quorum's new
    communicator (torchft retries a dead member's store: up to about two process-group
    timeouts) and then a heal (the source's metadata, then its state: up to a manager timeout
    each). Seen when a heal source died mid-heal: one rank's heal failed at once, it started the
    pass, and FSDP2's all-gather gave up on its peer, still connecting, after one process-group
    timeout; the group crashed instead of retrying the heal. A rank that hangs for good is the
    supervision tree's to find (heartbeats), not this timeout's."""
    return timedelta(seconds=2 * process_group_timeout + 2 * manager_timeout)


def intra_group_pg(
    store: Any, rank: int, ranks: int, timeout: timedelta
) -> torch.distributed.ProcessGroupGloo:
    """A plain gloo group over a replicated group's ranks, on the group's store."""
    from torch.distributed import PrefixStore

    prefixed = PrefixStore(INTRA_PREFIX, store)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, ranks, timeout)


class Sharded:
    """FSDP2 over the group's ranks (see the module doc). Build it before the optimizer: it
    replaces the model's parameters with sharded DTensors."""

    overlap_quorum = False
    eval_on_every_rank = True

    def __init__(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        across: CrossGroup,
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        self._across = across
        self._timeout = timeout
        # The group's asks that cross the groups (Asks.crossing), agreed in the group before
        # the backward pass; the asks themselves and the group's checkpoint ask.
        self._carry: list[bool] = []
        self._asks = Asks()
        self._checkpoint = False

    def backward(self, loss: torch.Tensor, asks: Asks) -> None:
        """Agree on the asks within the group first (one allreduce of three floats: a rank that
        asked is enough, asks reach the ranks apart), so that every rank of the group carries
        the same flags across the groups (:meth:`average`). Then the pass: FSDP2
        reduce-scatters each block's gradients within the group as it goes."""
        import torch.distributed as dist

        self._carry = []
        self._asks, self._checkpoint = asks, False
        flags = [asks.quorum, asks.checkpoint, asks.nonfinite]
        if any(a is not None for a in flags):
            summed = torch.tensor([float(bool(a)) for a in flags])
            dist.all_reduce(summed)
            self._checkpoint = bool(summed[1].item() > 0)
            self._carry = [bool(summed[i].item() > 0) for i in (0, 2) if flags[i] is not None]
        loss.backward()

    def average(self, model: nn.Module, *, contribute: bool) -> Asks:
        """Average this rank's gradient shards (the group's mean already: FSDP2 summed them
        over the group and divided) with the same shards of the other groups: one flat
        allreduce for every block, the crossing flags riding along. A rank whose shards are not
        finite contributes zeros (its NaN must not reach the other groups); ``contribute`` is
        moot, since a rank's non-finite loss reached its group's shards in the reduce-scatter."""
        grads = [self.local(p.grad) for p in model.parameters() if p.grad is not None]

        def across(flat: torch.Tensor, n: int) -> None:
            if not bool(torch.isfinite(flat[:n]).all()):
                flat[:n].zero_()
            self._across(flat)

        agreed = _average_flat(grads, self._carry, across)
        return self._asks.crossed(agreed, checkpoint=self._checkpoint)

    def checkpoint_group(self) -> Any:
        """A gloo group of its own over the group's ranks, as torchtitan's checkpointer has: a
        write in the background never shares a communicator with the training's collectives."""
        import torch.distributed as dist

        return dist.new_group(backend="gloo", timeout=self._timeout)

    def group_min(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def local(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optim = optimizer.state_dict()
        state = {
            i: {k: self._local_any(v) for k, v in s.items()} for i, s in optim["state"].items()
        }
        return {
            "model": {k: self.local(v) for k, v in trained_tensors(model).items()},
            "optim": {"state": state, "param_groups": optim["param_groups"]},
        }

    def _local_any(self, v: Any) -> Any:
        return self.local(v) if isinstance(v, torch.Tensor) else v

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Copy each shard in place into the tensors the model trains (:func:`trained_tensors`),
        and give the optimizer's shards their parameter's sharding (a fresh optimizer has no
        state to copy into: AdamW makes its moments on its first step)."""
        from torch.distributed.tensor import DTensor

        current = trained_tensors(model)
        if set(current) != set(state["model"]):
            missing = sorted(set(current) - set(state["model"]))
            extra = sorted(set(state["model"]) - set(current))
            raise ValueError(f"model shards do not match: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, value in state["model"].items():
                _copy_shard(name, self.local(current[name]), value)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        rebuilt: dict[Any, dict[str, Any]] = {}
        for idx, entry in state["optim"]["state"].items():
            p = params[int(idx)]
            rebuilt[idx] = {}
            for key, v in entry.items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0:
                    _check_shape(f"optim.{idx}.{key}", p.to_local(), v)
                    v = DTensor.from_local(
                        v, p.device_mesh, p.placements, run_check=False,
                        shape=p.shape, stride=p.stride(),
                    )  # fmt: skip
                rebuilt[idx][key] = v
        optimizer.load_state_dict(
            {"state": rebuilt, "param_groups": state["optim"]["param_groups"]}
        )


def trained_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``model`` trains and keeps, by attribute name: its parameters and persistent
    buffers, the live tensors themselves (a sharded one as its DTensor). Not
    ``model.state_dict()``: a model's state-dict hooks may hand out tensors made for the state
    dict (torchtitan's llama3 splits each fused ``wqkv`` into new ``wq``/``wk``/``wv``), which
    a heal that copies in place would write into and lose."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def _check_shape(name: str, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        raise ValueError(
            f"{name}: shard {tuple(theirs.shape)} {theirs.dtype} does not fit this rank's "
            f"{tuple(mine.shape)} {mine.dtype} (another model, or another shard count)"
        )


def _copy_shard(name: str, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    _check_shape(name, mine, theirs)
    if mine.data_ptr() != theirs.data_ptr():  # a transport may have read into ours already
        mine.copy_(theirs)


def init_group_world(store: Any, rank: int, ranks: int, timeout: timedelta) -> None:
    """Make this process's default process group the replica group's own world (gloo, on the
    group's store, under its own prefix): FSDP2's device mesh is built over it. One group per
    process: a trainer process trains one rank of one group for its whole life."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    if dist.is_initialized():
        raise RuntimeError(
            "parallel.group = 'fsdp': this process has a default process group already; a "
            "sharded rank must be the only trainer of its process"
        )
    dist.init_process_group(
        "gloo", store=PrefixStore(FSDP_PREFIX, store), rank=rank, world_size=ranks,
        timeout=timeout,
    )  # fmt: skip
