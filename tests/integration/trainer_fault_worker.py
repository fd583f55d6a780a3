"""A trainer process that fires one of the Trainer's fault hooks on itself mid-run.

``python trainer_fault_worker.py ARGS_JSON`` where ARGS_JSON holds run_trainer's arguments plus
``hook`` ("abort" | "delay") and ``at_step``: when the trainer has committed ``at_step`` steps a
side thread calls ``abort_collectives()`` (during the next step's collective window) or
``set_step_delay(0.5)`` for the rest of the run. The journal records a ``fault.inject`` first.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from harness.config import config_from_dict
from harness.rank.trainer import Trainer
from runtime.journal import Journal


def main() -> int:
    a = json.loads(sys.argv[1])
    cfg = config_from_dict(a["cfg_dict"])
    journal = Journal(a["journal_path"], job=cfg.name, replica=a["replica_id"], rank=a["rank"])
    journal.emit(
        "proc.start", replica=a["replica_id"], rank=a["rank"], host=0, pid=os.getpid(), spare=False
    )
    trainer = Trainer(
        cfg,
        replica_id=a["replica_id"],
        rank=a["rank"],
        store_addr=a["store_addr"],
        lighthouse_addr=a["lighthouse_addr"],
        emit=lambda event, fields: journal.emit(event, **fields),
    )

    def fire() -> None:
        while trainer.manager.current_step() < a["at_step"]:
            time.sleep(0.005)
        journal.emit("fault.inject", fault_id="f1", kind=a["hook"], target={}, seed=0)
        if a["hook"] == "abort":
            trainer.abort_collectives()
        else:
            trainer.set_step_delay(0.5)

    threading.Thread(target=fire, daemon=True).start()
    try:
        print(json.dumps(trainer.train()), flush=True)
    finally:
        trainer.close()
        journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
