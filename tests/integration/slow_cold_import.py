"""Preloaded by ``test_a_cold_worker_slow_to_import_is_not_hung``: in a cold worker (a fresh
``python -m runtime.worker``) its import holds the GIL in a C call for 2 s, as loading libtorch
does when three cold interpreters start at once on a loaded host. In the agent (which preloads
it too, before forking) it does nothing."""

import ctypes
import ctypes.util
import sys
from pathlib import Path

if Path(sys.argv[0]).parts[-2:] == ("runtime", "worker.py"):
    _libc = ctypes.PyDLL(ctypes.util.find_library("c") or None)  # PyDLL: the GIL stays held
    _libc.sleep.argtypes = [ctypes.c_uint]
    _libc.sleep(2)
