"""The crash-loop rule: which deaths are the program's own, and what the user is told."""

from __future__ import annotations

import json
from pathlib import Path

from harness.job.crash_loop import CrashLoop, Death, diagnosis, read_death

ADDR_IN_USE = """\
train_hsdp: starting
Traceback (most recent call last):
  File "/work/train_hsdp.py", line 140, in <module>
    sys.exit(main())
             ^^^^^^
  File "/work/train_hsdp.py", line 71, in main
    dist.init_process_group("gloo", timeout=pg_timeout)
  File "/venv/torch/distributed/rendezvous.py", line 189, in _create_c10d_store
    return TCPStore(
           ^^^^^^^^^
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use
"""  # noqa: E501


def lines(port: int = 4242) -> list[str]:
    return ADDR_IN_USE.format(port=port).splitlines()


def death(replica: int, t: float, *, port: int = 4242, inc: int = 0, **kw) -> Death:
    read = read_death(lines(port), signal=kw.pop("signal", None), exit_code=1)
    assert read is not None
    what, kind, frame, shown = read
    return Death(replica, 0, inc, what, kind, frame, "at start (before its first quorum)", t, shown)


def test_a_traceback_gives_the_exception_and_its_last_frame_not_the_message():
    what, kind, frame, shown = read_death(lines(), signal=None, exit_code=1)
    assert kind == "torch.distributed.DistNetworkError"
    assert frame == "rendezvous.py:189 in _create_c10d_store"
    assert what.startswith("torch.distributed.DistNetworkError: The server socket")
    assert shown[0].lstrip().startswith('File "/venv/torch/distributed/rendezvous.py"')
    assert shown[-1] == what
    # another incarnation's port: the same signature
    assert death(0, 0.0, port=1).signature == death(0, 0.0, port=2).signature


def test_no_traceback_the_signal_or_exit_code_and_a_stop_is_none():
    assert read_death(["x"], signal="SIGSEGV", exit_code=None)[:3] == (
        "killed by SIGSEGV", "SIGSEGV", "",
    )  # fmt: skip
    assert read_death([], signal=None, exit_code=3)[1] == "exit code 3"
    for stop in ("SIGKILL", "SIGTERM", "SIGINT"):
        assert read_death(lines(), signal=stop, exit_code=None) is None
    assert read_death(["ok"], signal=None, exit_code=0) is None


def test_torch_record_error_file_is_read_when_the_log_has_no_traceback(tmp_path: Path):
    f = tmp_path / "e.json"
    callstack = ADDR_IN_USE.format(port=1).split("\n", 1)[1]
    extra = {"py_callstack": callstack, "timestamp": "1"}
    f.write_text(json.dumps({"message": {"message": "x", "extraInfo": extra}}))
    read = read_death(["no traceback here"], signal=None, exit_code=1, error_file=f)
    assert read is not None and read[1] == "torch.distributed.DistNetworkError"


def test_three_in_a_row_is_a_loop_and_the_diagnosis_names_cause_and_fix():
    loop = CrashLoop()
    assert loop.died(death(0, 1.0)) is None
    assert loop.died(death(1, 1.1)) is None
    got = loop.died(death(0, 2.0, inc=1))
    assert got is not None and len(got) == 3
    assert loop.died(death(1, 2.1, inc=1)) is None  # the job is ending: said once
    text = diagnosis(got)
    assert "3 deaths in a row with torch.distributed.DistNetworkError" in text
    assert "last frame: rendezvous.py:189 in _create_c10d_store" in text
    assert "hint: a rank tried to host a server on a port already taken" in text
    assert "replica0-rank0 | torch.distributed.DistNetworkError" in text


def test_another_signature_or_a_long_gap_starts_the_count_again():
    loop = CrashLoop(window_s=10.0)
    loop.died(death(0, 0.0))
    loop.died(death(0, 1.0))
    segv = Death(1, 0, 0, "killed by SIGSEGV", "SIGSEGV", "", "at step 5", 2.0)
    assert loop.died(segv) is None
    assert loop.died(death(0, 3.0)) is None
    assert loop.died(death(0, 4.0)) is None
    assert loop.died(death(0, 100.0)) is None  # 96 s after the one before: a new run
    assert loop.died(death(0, 101.0)) is None
    assert loop.died(death(0, 102.0)) is not None


def test_an_injected_fault_is_never_the_programs_own():
    loop = CrashLoop(explained_s=5.0)
    # the incarnation a fault hit, even long after it
    loop.fault(0.0, 0, 0)
    for t in (100.0, 101.0, 102.0):
        assert loop.died(death(0, t, inc=0)) is None
    # any group's death shortly after a fault (a survivor its peer's death took down)
    loop = CrashLoop(explained_s=5.0)
    for i, t in enumerate((10.0, 12.0, 14.0)):
        loop.fault(t - 1.0, None, None)
        assert loop.died(death(1, t, inc=i)) is None
    # and a fault breaks a run: two before it and one after are not three in a row
    loop = CrashLoop(explained_s=5.0)
    loop.died(death(0, 0.0))
    loop.died(death(0, 1.0, inc=1))
    loop.fault(1.5, 1, 0)
    assert loop.died(death(0, 20.0, inc=2)) is None
