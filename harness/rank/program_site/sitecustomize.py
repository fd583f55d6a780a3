"""ftharness's always-on start-up patch inside a program of the user's own: every address torchft
advertises to peers is the host's advertised address, never ``socket.gethostname()``.

Why a patch. An unmodified torchft program advertises the machine's hostname in three places:
its process group's rendezvous store (``torchft.process_group.ProcessGroup
.get_reconfigure_handle`` creates ``TCPStore(socket.gethostname(), 0)`` and hands peers
``f"{socket.gethostname()}:{port}"``), its ManagerServer (``Manager(hostname=
socket.gethostname())``, a default computed when ``torchft.manager`` is imported) and its HTTP
checkpoint server (``HTTPTransport.address()``). On a node whose hostname resolves to loopback
(Debian's ``127.0.1.1``) or to a management network, the other hosts' groups then dial
themselves or a network they cannot reach, and every step times out. No environment variable
of torchft's changes it, and the program is the user's: ftharness may not edit it.

Why here, and always on. The patch must be in place before the program creates its Manager,
in a process ftharness does not write: Python's start-up hook ``sitecustomize``, which
``harness.job.program.env.launcher_env`` puts first on every program's ``PYTHONPATH``. The fault
hooks (``harness/rank/program_hooks``) stay opt-in (``program.hooks``): they handle a signal and
run faults, which a program must agree to; this changes nothing but the address torchft names,
to the one the agent advertises (``$FTHARNESS_ADVERTISE``, ``runtime.netaddr``), and is what
torchft would do on a node whose hostname resolves to that address, so every program gets it.

What it does, and nothing else: it imports nothing at start-up (no torchft, no ftharness); when
``torchft.process_group``, ``torchft.manager`` or ``torchft.checkpointing.http_transport`` is
imported (or at once, if it was: a warm start forks an agent that imported torchft), that
module's ``socket.gethostname`` becomes the advertised address (the module's own name ``socket``
is rebound to a view of the real module; the real one, and everyone else's, is untouched), and
the Manager's ``hostname`` default becomes it too. The rendezvous store still listens on every
interface, as torchft's does. Then, started by the interpreter (a cold start), it runs the next
``sitecustomize`` on ``sys.path`` as the interpreter would have (ftharness's fault hook with
``program.hooks``, else the program's or the system's own), so it shadows none. A warm start
runs ftharness's hooks explicitly (``runtime.program_proc``) and no other.

Not guaranteed: a program that asks ``socket.gethostname()`` itself gets the machine's name; an
interpreter started with ``-S`` or ``-I`` (or a program that is no Python) runs no
``sitecustomize``; a torchft without the Manager's ``hostname`` default says so on stderr.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ADVERTISE_ENV = "FTHARNESS_ADVERTISE"  # runtime.netaddr.ADVERTISE_ENV


class _HostSocket:
    """A torchft module's view of ``socket``: the real module, except ``gethostname``."""

    def __init__(self, address: str) -> None:
        self._address = address

    def gethostname(self) -> str:
        return self._address

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)


def _rebind_socket(module: ModuleType, address: str) -> None:
    module.socket = _HostSocket(address)  # type: ignore[attr-defined]


def _patch_manager(module: ModuleType, address: str) -> None:
    _rebind_socket(module, address)
    init = module.Manager.__init__
    code = init.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = list(init.__defaults__ or ())
    first = len(names) - len(defaults)
    if "hostname" in names and names.index("hostname") >= first:
        defaults[names.index("hostname") - first] = address
        init.__defaults__ = tuple(defaults)
    elif "hostname" in (init.__kwdefaults__ or {}):
        init.__kwdefaults__ = {**init.__kwdefaults__, "hostname": address}
    else:
        print(
            "ftharness: torchft.manager.Manager has no hostname default to set; its "
            "ManagerServer advertises torchft's choice",
            file=sys.stderr,
        )


#: Module name -> what to do to it once it is imported.
PATCHES: dict[str, Callable[[ModuleType, str], None]] = {
    "torchft.process_group": _rebind_socket,
    "torchft.checkpointing.http_transport": _rebind_socket,
    "torchft.manager": _patch_manager,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], object]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as the other finders do, and patches each once it ran."""

    def __init__(self, pending: dict[str, Callable[[ModuleType, str], None]], address: str):
        self.pending = pending
        self.address = address

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, lambda m: patch(m, self.address))
                return spec
            if spec is not None:
                return spec
        return None


def install(address: str) -> None:
    """Patch the torchft modules imported already, and each of the others when it is."""
    pending = {}
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module, address)
        else:
            pending[name] = patch
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending, address))


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, as the interpreter would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get(ADVERTISE_ENV):
    install(os.environ[ADVERTISE_ENV])
if __name__ == "sitecustomize" and globals().get("FTHARNESS_CHAIN", True):
    _chain()
