"""``runtime.actor.wire_name``: the name a function travels by to a worker, built from the
function itself so that callers can be found by a reader; and the program hooks' copies of
``faults.inworker`` keyed by those names.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest

from faults import inworker
from harness.rank.program_hooks import sitecustomize as program_hooks
from runtime.actor import Actor, resolve, wire_name


class _Holder:
    @staticmethod
    def static() -> int:
        return 1

    def method(self) -> int:
        return 2


def _wrapped_without_wraps(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@_wrapped_without_wraps
def _decorated() -> None:
    return None


@functools.wraps(inworker.segfault)
def _impostor() -> None:  # claims segfault's name: that name leads to another object
    return None


def test_a_module_function_travels_by_module_and_qualname() -> None:
    assert wire_name(inworker.segfault) == "faults.inworker:segfault"
    assert resolve(wire_name(inworker.hold_gil)) is inworker.hold_gil


def test_builtins_and_static_methods_travel_too() -> None:
    assert resolve(wire_name(os.getpid)) is os.getpid
    assert wire_name(gc.get_freeze_count) == "gc:get_freeze_count"
    assert wire_name(_Holder.static) == f"{__name__}:_Holder.static"


@pytest.mark.parametrize(
    ("fn", "error", "says"),
    [
        (lambda: None, ValueError, "lambda"),
        (_Holder().method, TypeError, "bound method"),
        (Actor().emit, TypeError, "bound method"),
        (_decorated, ValueError, "nested"),  # the wrapper's qualname names its <locals>
        (_impostor, ValueError, "rebound"),
        ("faults.inworker:segfault", TypeError, "not its name"),
        (42, TypeError, "not a function"),
    ],
)
def test_what_a_worker_cannot_import_is_refused_with_a_reason(fn, error, says) -> None:
    with pytest.raises(error, match=says):
        wire_name(fn)


def test_resolve_refuses_what_is_not_a_wire_name() -> None:
    with pytest.raises(ValueError, match="not a wire name"):
        resolve("faults.inworker")
    with pytest.raises(AttributeError):
        resolve("faults.inworker:no_such_fault")


def test_program_hooks_are_keyed_by_the_wire_names_of_the_real_faults() -> None:
    """sitecustomize runs inside a user's program and imports nothing of ftharness, so it keys
    its copies by strings; each must be the wire name of the ``faults.inworker`` function a
    fault passes, or a hooked program would refuse that fault."""
    real = [inworker.segfault, inworker.hold_gil, inworker.abort_collectives]
    real.append(inworker.set_step_delay)
    assert sorted(program_hooks.FAULTS) == sorted(wire_name(fn) for fn in real)
    for key, copy in program_hooks.FAULTS.items():
        assert copy.__name__ == "_" + resolve(key).__name__, key
