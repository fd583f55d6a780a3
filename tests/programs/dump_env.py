"""Write this process's whole environment, as JSON, to ``DIR/replica<G>-rank<RANK>-restart<N>.json``
(G: ``REPLICA_GROUP_ID``, 0 when unset; N: ``TORCHELASTIC_RESTART_COUNT``), then exit 0. Run
under torchrun and under ftharness, it shows what each launcher gives a rank
(tests/e2e/test_program_hsdp.py compares the two). Usage: ``python dump_env.py DIR``."""

from __future__ import annotations

import json
import os
import sys


def dump(directory: str) -> str:
    e = os.environ
    name = (
        f"replica{e.get('REPLICA_GROUP_ID', '0')}-rank{e.get('RANK')}"
        f"-restart{e.get('TORCHELASTIC_RESTART_COUNT')}.json"
    )
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(e), f)
    os.replace(path + ".tmp", path)
    return path


if __name__ == "__main__":
    dump(sys.argv[1])
