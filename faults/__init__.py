"""The fault catalogue: each fault is real, seeded, logged before it fires, and paired with a heal.

``faults.fault`` holds the protocol and registry, ``faults.targets`` target selection,
``faults.schedule`` the seeded plans and ``faults.injector`` the loop that fires them. One module
per family registers its kinds: process (segfault, kill, hang), gil (gil_deadlock), collective
(collective_abort), host (host_eviction), service (lighthouse_crash), straggler (slow_rank).
"""

from faults.fault import (
    Fault,
    FaultContext,
    Target,
    fault_class,
    fault_kinds,
    fault_options,
    make_fault,
    register,
)

__all__ = [
    "Fault",
    "FaultContext",
    "Target",
    "fault_class",
    "fault_kinds",
    "fault_options",
    "make_fault",
    "register",
]
