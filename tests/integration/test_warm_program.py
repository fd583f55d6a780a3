"""What a warm-started program sees (runtime/program_proc.py, fork_program; the list is in
docs/own-program.md, "Warm and cold starts"): the same as a cold start where it matters, and the
documented differences."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import pytest

from runtime.controller import Controller
from runtime.messages import SpawnProgram
from runtime.spec import ControllerSpec, HeartbeatSpec

pytestmark = pytest.mark.timeout(90)

FAST = ControllerSpec(
    heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=0.6),
    agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=2.0),
    preload=("torch",),
)

REPORT = """
import json, os, signal, sys
report = {
    "torch_preloaded": "torch" in sys.modules,
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "stdin_is_null": os.path.samestat(os.fstat(0), os.stat(os.devnull)),
    "path0": sys.path[0],
    "env": os.environ.get("GREETING"),
    "name": __name__,
}
print("REPORT " + json.dumps(report))  # no flush: PYTHONUNBUFFERED must carry it
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler flushes anything
"""


def run(tmp_path, argv: tuple[str, ...], warm: bool) -> dict:
    c = Controller(FAST, on_failure=lambda f: True)
    try:
        host = c.spawn_host("h0")
        log = tmp_path / f"{'warm' if warm else 'cold'}.log"
        env = {"GREETING": "hi", "PYTHONUNBUFFERED": "1"}
        msg = SpawnProgram("", {"replica": 0, "rank": 0}, argv, env, str(tmp_path), str(log))
        c.spawn_program(host, replace(msg, warm=warm))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not c.failures:
            time.sleep(0.02)
        assert c.failures, "the program never died"
        lines = [x for x in log.read_text().splitlines() if x.startswith("REPORT ")]
        assert lines, log.read_text()
        return json.loads(lines[0][len("REPORT ") :])
    finally:
        c.shutdown(grace_s=0.5)


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_warm_program_sees_what_a_cold_one_does_but_the_preloaded_modules(tmp_path, how):
    (tmp_path / "report_prog.py").write_text(REPORT)
    script = str(tmp_path / "report_prog.py")
    argv = ("python", script, "a1") if how == "script" else ("python", "-m", "report_prog", "a1")
    cold = run(tmp_path, argv, warm=False)
    warm = run(tmp_path, argv, warm=True)
    # the documented difference: what the agent imported is already there
    assert (cold["torch_preloaded"], warm["torch_preloaded"]) == (False, True)
    # the same argv (argv[0]: the script, or the module's file), environment, stdin, __main__,
    # and the script's directory (-m: the working directory) first on sys.path
    for key in ("argv", "stdin_is_null", "env", "name"):
        assert warm[key] == cold[key], (key, warm[key], cold[key])
    assert warm["argv"] == [script, "a1"]
    assert warm["path0"] == cold["path0"] == str(tmp_path)
    # sys.orig_argv: the command with ftharness's interpreter, as a cold start's
    assert warm["orig_argv"] == [sys.executable, *argv[1:]]
    assert cold["orig_argv"] == [sys.executable, *argv[1:]]
