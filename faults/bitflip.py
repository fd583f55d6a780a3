"""Silent data corruption: one bit flipped in one replica's state, between two steps.

The fault is seeded like every other: the injector's ``rng`` draws a seed, and the seed alone
decides which tensor, which element and which bit (uniform over every element of the chosen
state, so a large tensor is hit more often, as a flipped memory cell would be). The flip itself
runs in the worker, on the training thread between two steps (the trainer's ``between_steps``
hook: never in the middle of an optimizer step, where the update could overwrite it), and is
journaled there as ``fault.bitflip`` with where it hit and the value before and after.

What it models and what it does not: a bit flipped in weights or optimizer state held in memory.
A bit flipped in a *gradient* before the cross-group allreduce is averaged into every replica
identically; the replicas stay equal to one another and comparing them cannot catch it (docs,
"Silent failures"). A flip in a high exponent bit can make a weight huge or NaN: the group's loss
turns non-finite, which the trainer keeps out of the allreduce and the controller treats as a
divergence of that group (``harness.job.divergence``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from faults import inworker
from faults.fault import FaultContext, Target, TargetKind, register

#: Journal event written by the worker (runtime.journal.BITFLIP; faults do not import harness).
EVENT = "fault.bitflip"


@register("bitflip")
@dataclass(frozen=True, kw_only=True)
class BitFlip:
    """Flip one bit of the target rank's weights (``where = "weights"``), optimizer state
    (``"optimizer"``) or either (``"any"``) before its next step. ``bit``: which bit of the
    element (0 = least significant; -1: drawn from the seed). A target with no rank flips the
    same place in every rank of the group. Heal: nothing (the controller's divergence check
    heals the group)."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 0.0
    where: Literal["weights", "optimizer", "any"] = "any"
    bit: int = -1

    def __post_init__(self) -> None:
        if not -1 <= self.bit <= 63:
            raise ValueError(
                f"bitflip: bit must be -1 (drawn from the seed) or 0-63 (an element is at "
                f"most 64 bits), got {self.bit!r}"
            )

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        seed = rng.getrandbits(62)
        ctx.run_in_worker(target, flip_between_steps, seed, self.where, self.bit)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None


def flip_between_steps(seed: int, where: str = "any", bit: int = -1) -> None:
    """In a worker: have the trainer flip the bit :func:`choose` picks before its next step."""

    def flip(
        tensors: dict[str, Any], step: int, emit: Callable[[str, dict[str, Any]], Any]
    ) -> None:
        hit = flip_bit(tensors, seed, where, bit)
        emit(EVENT, {**hit, "step": step, "seed": seed})

    inworker.between_steps(flip)


def choose(sizes: list[tuple[str, int, int]], seed: int, bit: int = -1) -> tuple[str, int, int]:
    """Pure: ``sizes`` is (name, elements, bytes per element) per tensor, in a fixed order;
    return (name, element index, bit), uniform over every element, from ``seed`` alone."""
    rng = random.Random(seed)
    total = sum(n for _, n, _ in sizes)
    if total == 0:
        raise ValueError("no state to flip a bit in")
    at = rng.randrange(total)
    for name, n, width in sizes:
        if at < n:
            b = bit if bit >= 0 else rng.randrange(8 * width)
            if b >= 8 * width:
                raise ValueError(f"bit {b} is past a {8 * width}-bit element of {name}")
            return name, at, b
        at -= n
    raise AssertionError("unreachable")


def flip_bit(tensors: dict[str, Any], seed: int, where: str = "any", bit: int = -1) -> dict:
    """Flip one bit in one of ``tensors`` (name -> torch tensor; names starting ``model.`` are
    weights, ``optim.`` optimizer state), in place; return where it hit and the values."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    picked = {
        k: t
        for k, t in sorted(tensors.items())
        if t.numel() > 0
        and (where == "any" or k.startswith("model." if where == "weights" else "optim."))
    }
    name, index, b = choose(
        [(k, t.numel(), t.element_size()) for k, t in picked.items()], seed, bit
    )
    t = picked[name]
    flat = t.detach().view(-1)
    before = flat[index].item()
    raw = flat.view(ints[t.element_size()])
    width = 8 * t.element_size()
    v = (int(raw[index].item()) & ((1 << width) - 1)) ^ (1 << b)
    if t.element_size() > 1 and v >= 1 << (width - 1):
        v -= 1 << width  # back to the signed integer view
    raw[index] = v
    return {"tensor": name, "index": index, "bit": b, "before": before, "after": flat[index].item()}
