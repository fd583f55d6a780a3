"""The keeper: the small process a run's controller runs under, which replaces it when it dies.

The controller (``harness.job.controller_proc``) is a process that can die: a bug, an OOM kill, a
SIGKILL. Its agents and workers keep training for ``recovery.controller_grace_s`` without it
(docs/controller.md), so something must start a new one at once. That is the keeper:

* ``ftharness run`` writes what the controller needs to run the job to ``RUN/job.json``
  (:func:`write_job_file`: a controller that takes over reads the same), then is the keeper
  (or, with ``--detach``, starts one in a session of its own that writes to
  ``RUN/console.log``). It records itself in ``RUN/keeper.json`` and starts the
  controller as its child: ``python -m harness.job.controller_proc RUN`` with the keeper's
  stdout and stderr (the progress lines print as before) and ``FTHARNESS_KEEPER_PID``.
* It is a child subreaper (``runtime.proctree.become_subreaper``): the agents of a dead
  controller become its children, not init's, so it reaps them, and kills any still left when
  the run ends without a clean end (no orphan outlives the run).
* When the controller exits, the journal says how: a ``job.end`` record is a run that ended, and
  the keeper ends with the controller's status. No ``job.end`` and a signal or a status other
  than 0, 1 or 2 is a controller that died: the keeper starts ``... controller_proc RUN
  --takeover`` at once and says so in one line, at most ``recovery.controller_max_restarts``
  times within ``recovery.controller_within_s`` (:class:`RestartIntensity`); past that the run
  ends, status 1, and the keeper writes its ``job.end`` with the reason.
* SIGINT (Ctrl-C, sent to the whole foreground group) is the controller's to act on: the keeper
  waits for it. SIGTERM (``ftharness stop``) and SIGUSR1 (SLURM's time-limit warning) are passed
  on to the controller; after a SIGTERM a controller that dies is not replaced.

``ftharness attach | stop | status`` (``harness.runctl``) find the keeper through
``keeper.json``.

A controller beats into a pipe the keeper gave it (``FTHARNESS_KEEPER_BEAT_FD``, every
``BEAT_INTERVAL_S``, from a thread of its own); one silent for ``timeouts.controller_silence``
while alive (SIGSTOPped, its interpreter wedged) is killed and replaced like one that died.

The beat needs the controller's control-plane lock once the job runs
(``Controller.responsive``), so a controller deadlocked on it stops beating too. Not
guaranteed: a controller stuck elsewhere with that lock free (its main thread in a loop, say) is
not detected; a keeper that is itself killed takes its run down (the controller gets SIGTERM and
stops cleanly).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import JobConfig
from harness.rundir import (
    CONSOLE_FILE,
    KEEPER_FILE,
    end_failed,
    find_job_end,
    job_from_argv,
    read_json,
    this_host,
    write_json_atomic,
)
from runtime.proctree import reap_within

#: A controller exit status that means it ended by itself (ok, failed, bad input): not replaced.
_OWN_ENDS = (0, 1, 2)
#: The environment variable that carries the keeper's pid to the controller.
KEEPER_ENV = "FTHARNESS_KEEPER_PID"
#: How long after a controller starts (or takes over) its standby is started.
STANDBY_DELAY_S = 3.0
#: The environment variable naming the pipe a controller beats into, and how often it does.
BEAT_ENV = "FTHARNESS_KEEPER_BEAT_FD"
BEAT_INTERVAL_S = 0.5


def controller_command() -> list[str]:
    """The controller's command, to which the keeper adds the run directory (and --takeover)."""
    return [sys.executable, "-m", "harness.job.controller_proc"]


@dataclass
class RestartIntensity:
    """At most ``max_restarts`` restarts within any ``within_s`` seconds (as a supervisor's
    restart intensity): a controller that dies again at once, over and over, is a bug or a
    broken machine that another restart will not fix, and the run should end with that said."""

    max_restarts: int
    within_s: float
    _times: collections.deque[float] = field(default_factory=collections.deque)

    def allow(self, now: float) -> bool:
        """Whether a restart at ``now`` (monotonic seconds) is allowed; an allowed one counts."""
        while self._times and now - self._times[0] > self.within_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def recent(self) -> int:
        """Restarts counted in the current window."""
        return len(self._times)


def describe_exit(status: int) -> str:
    """How a process ended, from its wait status, for the console."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(sig).name}"
        return f"was killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _say(text: str) -> None:
    print(f"[ftharness] {text}", file=sys.stderr, flush=True)


class Keeper:
    """Runs a run's controller and replaces it when it dies (module docstring). Construct and
    :meth:`run` it on the main thread of a process that is the keeper for good: it becomes a
    child subreaper and reaps every child it has."""

    def __init__(
        self,
        run_dir: Path,
        *,
        max_restarts: int,
        within_s: float,
        controller: Sequence[str] | None = None,
        detached: bool = False,
        standby: bool = False,
        silence_s: float | None = None,
        say: Callable[[str], None] = _say,
        remote: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.intensity = RestartIntensity(max_restarts, within_s)
        self.controller = list(controller) if controller is not None else controller_command()
        self.detached = detached
        self.say = say
        self.restarts = 0
        self._child: int | None = None
        self._stopping = False
        # A standby controller (``controller_proc RUN --standby``): started with its imports
        # done, it takes over the moment it is told to (about a second sooner than a fresh one).
        self.standby = standby
        self._standby: subprocess.Popen | None = None
        self._standby_beats: int | None = None  # the read end of the standby's beat pipe
        self._standby_lock = threading.Lock()
        # A controller silent this long on its beat pipe (stopped, wedged) is killed and
        # replaced; None: not watched (a stand-in controller that does not beat).
        self.silence_s = silence_s
        # What the keeper had to stop when the run ended (``ftharness chaos`` counts them as
        # orphans: a run should not need it): pid, name, cmdline, create_time of each.
        self.left_behind: list[dict[str, Any]] = []
        # Beats to a standby on another node, which takes the run over if this node is lost
        # (``harness.keeper.beats.Remote``, ``harness.keeper.standby_node``; SLURM only).
        self.remote = remote
        self._started_at = time.time()
        self._watched = False  # a standby on another node is connected to the beats
        if remote is not None:
            remote.on_watched = self._on_watched

    @classmethod
    def for_job(
        cls, run_dir: Path, cfg: JobConfig, *, detached: bool = False, avoid: tuple[str, ...] = ()
    ) -> Keeper:
        """The keeper of ``cfg``'s run: its restart intensity and silence from the config, a
        standby controller when a new controller could take the job over."""
        from harness.job.takeover import supported
        from harness.keeper.beats import for_job

        r, standby = cfg.recovery, supported(cfg) is None
        return cls(
            run_dir,
            max_restarts=r.controller_max_restarts,
            within_s=r.controller_within_s,
            detached=detached,
            standby=standby,
            silence_s=cfg.timeouts.controller_silence,
            remote=for_job(run_dir, cfg, BEAT_INTERVAL_S, avoid) if standby else None,
        )

    def run(self, takeover_first: bool = False) -> int:
        """Keep a controller running until the run ends; returns the run's exit status.
        ``takeover_first``: the run's keeper elsewhere is lost (``harness.keeper.standby_node``)."""
        from runtime.proctree import become_subreaper

        become_subreaper()
        previous = {
            sig: signal.signal(sig, handler)
            for sig, handler in (
                (signal.SIGINT, self._on_sigint),
                (signal.SIGTERM, self._on_forward),
                (signal.SIGUSR1, self._on_forward),
            )
        }
        try:
            self._write_keeper_file()  # after the handlers: `ftharness stop` may signal us now
            if self.remote is not None:
                self.remote.start()
            return self._keep(takeover_first)
        finally:
            if self.remote is not None:
                self.remote.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.standby = False
            self._drop_standby()
            self._stop_leftovers()

    def _keep(self, takeover: bool) -> int:
        while True:
            pid = self._start(takeover)
            status = self._wait(pid)
            self._child = None
            code = os.waitstatus_to_exitcode(status)
            end = find_job_end(self.run_dir / "journal.jsonl")
            if end is not None:  # the run ended; a status set by a signal after it: the record's
                if code >= 0:
                    return code
                return 0 if end.get("status") == "ok" else 1
            if code in _OWN_ENDS:
                return code
            if not still_keeper(self.run_dir):  # fenced by a controller a standby started
                return wait_for_end(self.run_dir, self.say)
            how = f"the controller (pid {pid}) {describe_exit(status)} before the run ended"
            if self._stopping:
                self._give_up(f"{how}, while stopping: the run ends here")
                return 1
            r = self.intensity
            if not self.intensity.allow(time.monotonic()):
                self._give_up(
                    f"{how}; it was replaced {r.recent} times within {r.within_s:g} s "
                    f"(recovery.controller_max_restarts = {r.max_restarts}): the run ends here"
                )
                return 1
            self.restarts += 1
            self.say(
                f"{how}; starting a new controller to take over ({r.recent} of at most "
                f"{r.max_restarts} within {r.within_s:g} s)"
            )
            takeover = True

    def _give_up(self, why: str) -> None:
        """No controller will end the run: say why, and write its ``job.end`` with the reason
        (``rundir.end_failed``), as a refused takeover does."""
        self.say(why)
        try:
            end_failed(self.run_dir, f"no controller could be kept running: {why}")
        except OSError as exc:  # the journal's disk: said, and the run still ends
            self.say(f"cannot write job.end to {self.run_dir / 'journal.jsonl'}: {exc}")

    def _start(self, takeover: bool) -> int:
        promoted = self._promote_standby() if takeover else None
        if promoted is not None:
            pid, beats = promoted
            self._child = pid
            if self._stopping:
                self._forward(signal.SIGTERM)
            self._watch(pid, beats)
            self._arm_standby()
            return pid
        argv = [*self.controller, str(self.run_dir), *(["--takeover"] if takeover else [])]
        beats, env = self._beat_pipe()
        # Popen only to start it: the keeper reaps it itself (_wait), with every orphan.
        proc = subprocess.Popen(argv, env=env, pass_fds=self._pass(env))
        self._close_write_end(env)
        self._watch(proc.pid, beats)
        self._child = proc.pid
        if self._stopping:  # a SIGTERM came between two controllers: this one stops too
            self._forward(signal.SIGTERM)
        proc.returncode = 0  # reaped by _wait; Popen must not wait for it or warn about it
        self._arm_standby()
        return proc.pid

    # -- the standby controller ------------------------------------------------------------
    def _arm_standby(self) -> None:
        """Start a standby once the controller just started has had the machine to itself for
        ``STANDBY_DELAY_S`` (its imports would compete with a start or a takeover)."""
        if self.standby:
            timer = threading.Timer(STANDBY_DELAY_S, self._start_standby)
            timer.daemon = True
            timer.start()

    def _start_standby(self) -> None:
        with self._standby_lock:
            if not self.standby or self._stopping or self._standby is not None:
                return
            argv = [*self.controller, str(self.run_dir), "--standby"]
            beats, env = self._beat_pipe()
            self._standby = subprocess.Popen(
                argv, env=env, stdin=subprocess.PIPE, pass_fds=self._pass(env)
            )
            self._close_write_end(env)
            self._standby_beats = beats
            self._standby.returncode = 0  # reaped by _wait, as the controller is

    def _promote_standby(self) -> tuple[int, int | None] | None:
        """Tell the standby to take over; its pid and beat pipe, or None if there is none (or
        it is gone)."""
        with self._standby_lock:
            proc, self._standby = self._standby, None
            beats, self._standby_beats = self._standby_beats, None
        if proc is None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(b"takeover\n")
            proc.stdin.close()
        except OSError:  # it died while waiting: a fresh controller takes over instead
            if beats is not None:
                os.close(beats)
            return None
        return proc.pid, beats

    # -- the controller's beats -------------------------------------------------------------
    def _beat_pipe(self) -> tuple[int | None, dict[str, str]]:
        """A pipe for the next controller's beats (when watched) and its environment."""
        env = {**os.environ, KEEPER_ENV: str(os.getpid())}
        if self.silence_s is None:
            env.pop(BEAT_ENV, None)
            return None, env
        r, w = os.pipe()
        env[BEAT_ENV] = str(w)
        return r, env

    @staticmethod
    def _pass(env: dict[str, str]) -> tuple[int, ...]:
        return (int(env[BEAT_ENV]),) if BEAT_ENV in env else ()

    @staticmethod
    def _close_write_end(env: dict[str, str]) -> None:
        if BEAT_ENV in env:
            os.close(int(env[BEAT_ENV]))

    def _watch(self, pid: int, beats: int | None) -> None:
        """Kill controller ``pid`` if it stops beating for ``silence_s`` while alive (SIGSTOP,
        a wedged interpreter): it is then replaced like one that died. Its epoch is fenced by
        the next, so even one that comes back later commands nothing."""
        if beats is None or self.silence_s is None:
            return
        silence = self.silence_s

        def watch() -> None:
            try:
                while True:
                    ready, _, _ = select.select([beats], [], [], silence)
                    if not ready:
                        self.say(
                            f"the controller (pid {pid}) has not been heard from for "
                            f"{silence:g} s (stopped or hung): killing it"
                        )
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        return
                    if not os.read(beats, 4096):
                        return  # it exited: the keeper's wait takes it from here
            finally:
                os.close(beats)

        threading.Thread(target=watch, daemon=True, name=f"keeper-watch-{pid}").start()

    def _drop_standby(self) -> None:
        """The run ends: the standby reads end-of-file and exits (a last resort: SIGKILL)."""
        with self._standby_lock:
            proc, self._standby = self._standby, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        if reap_within(proc.pid, 5.0):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)

    def _wait(self, pid: int) -> int:
        """Reap children until ``pid`` exits (orphans of a dead controller are ours too, and a
        standby that died while waiting is forgotten: a fresh controller would take over)."""
        while True:
            got, status = os.waitpid(-1, 0)  # EINTR is retried (PEP 475) after a handler runs
            if got == pid:
                return status
            with self._standby_lock:
                if self._standby is not None and got == self._standby.pid:
                    self._standby = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """Ctrl-C: the controller got it too (same process group) and stops the job itself."""

    def _on_forward(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            self._stopping = True
        self._forward(signum)

    def _forward(self, sig: int) -> None:
        if self._child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._child, sig)

    def _write_keeper_file(self) -> None:
        import psutil

        write_json_atomic(
            self.run_dir / KEEPER_FILE,
            {
                "pid": os.getpid(),
                "host": this_host(),
                "beat": self.remote.address if self.remote is not None else None,
                "beat_key": self.remote.key.hex() if self.remote is not None else None,
                "watched": self._watched,
                "uid": os.getuid(),
                "started": self._started_at,
                "create_time": psutil.Process().create_time(),
                "detached": self.detached,
                "console": CONSOLE_FILE if self.detached else None,
            },
        )

    def _on_watched(self) -> None:
        """The standby on another node connected (a beats thread): ``keeper.json`` says so, so
        that a fault that fails this node waits for it (``harness.job.fault_context``)."""
        self._watched = True
        if still_keeper(self.run_dir):
            self._write_keeper_file()

    def _stop_leftovers(self) -> None:
        """Whatever is still running under the keeper when the run ends: the agents and workers
        of a controller that died and was not replaced. They would stop by themselves after the
        grace window; a run that has ended should leave nothing behind that long."""
        import psutil

        from runtime.proctree import signal_all

        left = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):  # gone, or a zombie: nothing left running
                if p.status() != psutil.STATUS_ZOMBIE:
                    self.left_behind.append(
                        {"pid": p.pid, "name": p.name(), "cmdline": " ".join(p.cmdline())[:200],
                         "create_time": p.create_time()}
                    )  # fmt: skip
                    left.append(p)
        if left:
            self.say(f"stopping {len(left)} process(es) the run left behind")
            signal_all(left, signal.SIGTERM)
            _, alive = psutil.wait_procs(left, timeout=5.0)
            signal_all(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5.0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # zombies, grandchildren re-parented to us
                pass


def still_keeper(run_dir: Path) -> bool:
    """Whether ``keeper.json`` still names this process (a standby elsewhere may take over)."""
    info = read_json(run_dir / KEEPER_FILE) or {}
    return info.get("pid") == os.getpid() and info.get("host", this_host()) == this_host()


def wait_for_end(run_dir: Path, say: Any) -> int:
    """A superseded keeper: wait for the run's end (its exit would end a batch job), then exit
    as the run did."""
    info = read_json(run_dir / KEEPER_FILE) or {}
    say(
        f"the run's keeper is now on {info.get('host', '?')} (pid {info.get('pid', '?')}): this "
        "one replaces no controller and waits for the run's end"
    )
    while (end := find_job_end(run_dir / "journal.jsonl")) is None:
        time.sleep(1.0)
    return 0 if end.get("status") == "ok" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.keeper.keeper RUN``: the detached keeper of a run ``ftharness run
    --detach`` prepared (its restart intensity from ``RUN/job.json``)."""
    job = job_from_argv("python -m harness.keeper.keeper", list(argv) if argv is not None else None)
    if job is None:
        return 2
    run_dir, cfg = job
    return Keeper.for_job(run_dir, cfg, detached=True).run()


if __name__ == "__main__":
    sys.exit(main())
