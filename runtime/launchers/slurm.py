"""Hosts from a SLURM allocation: one host agent per allocated node, each its own job step.

The controller runs where the command runs, inside an allocation (``salloc``, or the batch
script of ``sbatch``). :func:`allocation_from_env` is the one place SLURM's environment is read
(``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` expanded by ``scontrol show hostnames``,
``SLURM_NNODES``, ``SLURMD_NODENAME``). Host names are node names.

:class:`SlurmLauncher` starts each host's agent as its own step::

    srun --nodes=1 --ntasks=1 -w NODE --kill-on-bad-exit=0 --overlap -J ftharness-agent-NODE \\
         python -m harness agent --controller ADDR:PORT --secret-file RUN/agent.secret --name NODE

so that losing a node ends that node's step, not the job (the allocation itself must be made with
``--no-kill``: without it SLURM ends the whole job when one of its nodes fails). The secret is a
0600 file in the run directory, which every node sees (a shared filesystem, as SLURM sites
have). ``kill`` is ``scancel --signal=KILL`` of that step.

SLURM's view of the nodes is part of supervision: a monitor thread polls ``sinfo`` and the job's
node list, and a node that is down, drained or draining, not responding, or no longer in the
job (SLURM drops a failed node from a ``--no-kill`` job) is *gone*: never chosen for a group,
never started again (:attr:`SlurmLauncher.gone`).

The allocation itself is watched the same way: once SLURM says the job has ended (``squeue``
shows it cancelled, timed out, completing..., or no longer knows it) or an agent's ``srun`` says
the job expired or is invalid, :attr:`SlurmLauncher.ended` says why, every node is gone, and no
step is started again: the run stops instead of retrying ``srun`` in a job that no longer exists.
A step's ``srun`` exiting wakes the watch at once (``scancel`` of the allocation kills every step
first); otherwise it polls every ``poll_s``.

The last ``spare_nodes`` nodes of the allocation are spares: they run an agent (with its warm
spare processes) but no group until a node is lost (``harness.job.placement``).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.launchers import ChildAgents
from runtime.launchers.slurm_text import (
    SRUN_JOB_GONE,
    SlurmError,
    allocation_end,
    expand_nodelist,
    parse_node_states,
    unusable,
)

STEP_PREFIX = "ftharness-agent-"


def _run(cmd: list[str], timeout: float = 20.0) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]} not found: SLURM's client commands are not installed") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd)}: no answer within {timeout:g} s") from None
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def available() -> tuple[bool, str]:
    """Whether SLURM's commands are here, and if not, why."""
    import shutil

    for tool in ("srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not installed (apt-get install slurm-wlm munge)"
    return True, ""


# -- the allocation: SLURM's environment, read in one place --------------------------------------


@dataclass(frozen=True, kw_only=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]  # in SLURM's order
    this_node: str | None  # the node this process runs on (in a batch script), else None


def allocation_from_env(
    env: Mapping[str, str] | None = None, hostnames: Callable[[str], list[str]] | None = None
) -> Allocation:
    """The allocation this process runs in. ``hostnames`` expands a node list (default:
    ``scontrol show hostnames``). SlurmError with what to do when there is none."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise SlurmError(
            "launcher = 'slurm' runs inside a SLURM allocation, but SLURM_JOB_ID is not set: run "
            "it under salloc (salloc -N3 --no-kill ftharness run ...), in an sbatch script, or "
            "let `ftharness slurm submit` write and submit one"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError(f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST is not")
    nodes = (hostnames or scontrol_hostnames)(nodelist)
    n = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if n is not None and (not n.isdigit() or int(n) != len(nodes)):
        raise SlurmError(
            f"SLURM_NNODES={n} but SLURM_JOB_NODELIST={nodelist} names {len(nodes)} node(s)"
        )
    return Allocation(job_id=job_id, nodes=tuple(nodes), this_node=env.get("SLURMD_NODENAME"))


def scontrol_hostnames(nodelist: str) -> list[str]:
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


# -- SLURM's view of the nodes --------------------------------------------------------------------


def node_states(nodes: list[str] | tuple[str, ...]) -> dict[str, str]:
    return parse_node_states(_run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"]))


def job_nodes(job_id: str) -> list[str]:
    """The nodes the job holds now (a ``--no-kill`` job loses a failed node)."""
    text = _run(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip()
    return expand_nodelist(text) if text else []


def job_state(job_id: str) -> str | None:
    """The job's state (``RUNNING``, ``CANCELLED``...), None when SLURM no longer knows it (a
    finished job is purged after ``MinJobAge``). SlurmError when SLURM cannot be asked."""
    try:
        text = _run(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T"])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    parts = text.split()
    return parts[0].upper() if parts else None


def node_address(node: str) -> str:
    text = _run(["scontrol", "show", "node", node])
    m = re.search(r"NodeAddr=(\S+)", text)
    if m is None:
        raise SlurmError(f"scontrol show node {node}: no NodeAddr")
    return m.group(1)


def controller_address(alloc: Allocation) -> str:
    """The address of this machine that the allocated nodes reach: the source address of the
    route to the last node (the bridge's gateway on the test cluster's host; the node's own
    address when the controller runs on a node, as in a batch script)."""
    target = node_address(alloc.nodes[-1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(target), 9))  # UDP: no packet is sent
        return s.getsockname()[0]


# -- the launcher ----------------------------------------------------------------------------------


def project_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def agent_command(
    node: str,
    controller: str,
    secret_file: str,
    dial_timeout_s: float,
    job_id: str | None = None,
    output: str | None = None,
    survival: Sequence[str] = (),
) -> list[str]:
    """The step that runs ``node``'s agent (see the module docstring); ``job_id``: a job other
    than the one this process runs in (a replacement node's). ``output``: the file the agent's
    stdout and stderr go to (:func:`to_file`)."""
    return [
        "srun", *([f"--jobid={job_id}"] if job_id else []),
        "--nodes=1", "--ntasks=1", "-w", node, "--kill-on-bad-exit=0", "--overlap",
        f"--job-name={STEP_PREFIX}{node}", f"--chdir={os.getcwd()}", "--input=none",
        *(to_file(output) if output else []),
        sys.executable, "-m", "harness", "agent", "--controller", controller,
        "--secret-file", secret_file, "--name", node, "--dial-timeout", f"{dial_timeout_s:g}",
        *(survival or ()),
    ]  # fmt: skip


def to_file(path: str) -> list[str]:
    """The prefix of a step's command that sends its stdout and stderr to ``path``, opened on the
    node by the step itself. Not ``srun --output``: ``srun`` writes that file, so a step whose
    ``srun`` died with the controller's node writes nothing more (measured on the test cluster)."""
    return ["/bin/sh", "-c", 'exec "$@" >>"$0" 2>&1', path]


def survival_args(boot: Mapping[str, Any]) -> list[str]:
    """The agent's options to outlive its controller, when the boot settings ask for it
    (``runtime.takeover.Succession.boot_settings``)."""
    if not boot.get("control_file") or float(boot.get("grace_s", 0.0)) <= 0:
        return []
    return ["--control-file", str(boot["control_file"]), "--grace", f"{float(boot['grace_s']):g}"]


def agent_nodes(alloc: Allocation, spare_nodes: int, reserved: str | None) -> list[str]:
    """The allocation's nodes that run an agent (all but ``reserved``, the controller's own),
    the last ``spare_nodes`` of them spares; SlurmError if none would train."""
    nodes = [n for n in alloc.nodes if n != reserved]
    if spare_nodes >= len(nodes):
        raise SlurmError(
            f"slurm.spare_nodes = {spare_nodes} but job {alloc.job_id} has {len(nodes)} node(s) "
            f"for agents ({', '.join(nodes) or 'none'}"
            + (f"; {reserved} runs only the controller" if reserved else "")
            + "): at least one must train"
        )
    return nodes


class SlurmLauncher(ChildAgents):
    """Each host's agent as a job step on its node (see the module docstring); the ``srun`` of
    each step is a child process of the controller."""

    def __init__(
        self,
        alloc: Allocation,
        run_dir: str | Path,
        *,
        spare_nodes: int = 0,
        poll_s: float = 2.0,
        on_gone: Callable[[str, str], None] | None = None,
        reserved: str | None = None,
    ) -> None:
        nodes = agent_nodes(alloc, spare_nodes, reserved)
        self.alloc = alloc
        self.run_dir = Path(run_dir)
        self.reserved = reserved  # the controller's own node: no agent there
        self.nodes = nodes
        self.spares = set(self.nodes[len(self.nodes) - spare_nodes :])
        self.active = [n for n in self.nodes if n not in self.spares]
        self.gone: dict[str, str] = {}  # node -> why
        self.ended: str | None = None  # why the allocation is over (None: it is not)
        self.node_job: dict[str, str] = {}  # replacement node -> its own single-node job
        super().__init__()
        self._on_gone = on_gone
        self._poll_s = poll_s
        self._closed = threading.Event()
        self._wake = threading.Event()  # a step's srun exited: look at the job now
        self._extra_jobs: list[str] = []  # replacement jobs (request_node), cancelled on close
        self.adopted: set[str] = set()  # nodes whose agent step a previous controller started
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="ftharness-sinfo")
        self._monitor.start()

    # -- SLURM's view ----------------------------------------------------------------------
    def refresh(self) -> None:
        """Mark nodes SLURM says are unusable, or that left the job, as gone."""
        with self._lock:
            nodes, node_job = list(self.nodes), dict(self.node_job)
        try:
            why = allocation_end(self.alloc.job_id, job_state(self.alloc.job_id))
        except SlurmError:
            return  # slurmctld busy or restarting: keep the last view
        if why is not None:
            self._end(why)
            return
        try:
            states = node_states(nodes)
            held = set(job_nodes(self.alloc.job_id))
            held_by = {job: set(job_nodes(job)) for job in set(node_job.values())}
        except SlurmError:
            return  # slurmctld busy or restarting: keep the last view
        for node in nodes:
            state = states.get(node, "unknown")
            job = node_job.get(node, self.alloc.job_id)
            mine = held_by[job] if node in node_job else held
            if unusable(state):
                self._mark_gone(node, f"SLURM shows node {node} {state}")
            elif mine and node not in mine:
                self._mark_gone(node, f"node {node} is no longer part of job {job}")

    def _mark_gone(self, node: str, why: str) -> None:
        with self._lock:
            if node in self.gone:
                return
            self.gone[node] = why
        if self._on_gone is not None:
            self._on_gone(node, why)

    def _end(self, why: str) -> None:
        """The allocation is over: say why once, and every node is gone (with that reason)."""
        with self._lock:
            if self.ended is not None:
                return
            self.ended = why
            nodes = list(self.nodes)
        for node in nodes:
            self._mark_gone(node, f"{why}: node {node} is gone with it")

    def _watch(self) -> None:
        while not self._closed.is_set() and self.ended is None:
            self._wake.wait(self._poll_s)
            self._wake.clear()
            if not self._closed.is_set():
                self.refresh()

    def _on_step_exit(self, name: str, popen: subprocess.Popen, log: Path, offset: int) -> None:
        """``name``'s ``srun`` exited: if what it wrote (``log`` from ``offset``) says its job is
        gone, the allocation is over (a replacement node's job: that node is gone); either way
        SLURM is asked now rather than at the next poll."""
        popen.wait()
        if self._closed.is_set():
            return
        with contextlib.suppress(OSError), open(log, "rb") as f:
            f.seek(max(offset, os.fstat(f.fileno()).st_size - 4096))
            said = SRUN_JOB_GONE.findall(f.read().decode("utf-8", "replace"))
        if said and name in self.node_job:
            self._mark_gone(name, f"job {self.node_job[name]} of node {name} is gone ({said[-1]})")
        elif said:
            why = f"SLURM job {self.alloc.job_id} is gone"
            with contextlib.suppress(SlurmError):  # what SLURM says of it, if it can
                why = allocation_end(self.alloc.job_id, job_state(self.alloc.job_id)) or why
            self._end(f"{why} (srun for {name}: {said[-1].strip()})")
        self._wake.set()

    # -- Launcher ----------------------------------------------------------------------------
    def secret_file(self, boot: Mapping[str, Any]) -> Path:
        path = self.run_dir / "agent.secret"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(str(boot["secret"]) + "\n")
        return path

    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        with self._lock:
            why = self.ended or self.gone.get(name)
        if why is not None:
            raise SlurmError(f"not starting an agent on {name}: {why}")
        controller = f"{boot['controller_host']}:{boot['controller_port']}"
        cmd = agent_command(
            name,
            controller,
            str(self.secret_file(boot)),
            float(boot.get("dial_timeout_s", 60)),
            self.node_job.get(name),
            output=str(self.run_dir / "logs" / f"agent-{name}.out"),
            survival=survival_args(boot),
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (project_root(), env.get("PYTHONPATH", "")) if p
        )
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / "logs" / f"srun-{name}.log"  # what srun itself says
        with open(log_path, "ab") as log:
            offset = os.fstat(log.fileno()).st_size  # what this step's srun writes starts here
            popen = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        with self._lock:
            self.adopted.discard(name)
        self._track(name, popen)
        threading.Thread(
            target=self._on_step_exit, args=(name, popen, log_path, offset), daemon=True,
            name=f"ftharness-srun-{name}",
        ).start()  # fmt: skip

    def step_ids(self, name: str | None = None) -> list[str]:
        """Our agent steps (``JOB.STEP``), of node ``name`` or all."""
        jobs = ",".join([self.alloc.job_id, *sorted(set(self.node_job.values()))])
        try:
            text = _run(["squeue", "-h", "-s", "-j", jobs, "-o", "%i %j"])
        except SlurmError:
            return []
        want = STEP_PREFIX + name if name else None
        out = []
        for line in text.splitlines():
            parts = line.split()
            named = len(parts) == 2 and parts[1].startswith(STEP_PREFIX)
            if named and (want is None or parts[1] == want):
                out.append(parts[0])
        return out

    def request_node(self, timeout_s: float = 600.0) -> str:
        """A replacement node (``slurm.replace = "new_job"``): a new single-node job that holds
        a node none of ours is on (``sbatch --wrap 'sleep infinity'``); once it runs, its node
        joins :attr:`nodes` as a spare and agents are started in that job. Cancelled by
        :meth:`close`. SlurmError if SLURM does not start it within ``timeout_s``."""
        import time

        with self._lock:
            exclude = ",".join(self.nodes)
        job = _run(
            ["sbatch", "--parsable", "--nodes=1", "--no-kill", f"--exclude={exclude}",
             f"--job-name=ftharness-replacement-{self.alloc.job_id}", "--output=/dev/null",
             "--wrap", "exec sleep infinity"]
        ).strip().split(";")[0]  # fmt: skip
        with self._lock:
            self._extra_jobs.append(job)
        deadline = time.monotonic() + timeout_s
        while not self._closed.is_set() and time.monotonic() < deadline:
            parts = _run(["squeue", "-h", "-j", job, "-o", "%T %N"]).split()
            if len(parts) == 2 and parts[0] == "RUNNING":
                node = parts[1]
                with self._lock:
                    self.node_job[node] = job
                    self.nodes.append(node)
                    self.spares.add(node)
                return node
            time.sleep(0.5)
        raise SlurmError(f"replacement job {job} did not start within {timeout_s:g} s")

    def cancel_step(self, name: str, signal: str | None = None) -> bool:
        """``scancel`` node ``name``'s agent step (SIGTERM then KILL, as torchft's punisher
        does), or send it ``signal``."""
        steps = self.step_ids(name)
        if not steps:
            return False
        extra = [f"--signal={signal}"] if signal else []
        with contextlib.suppress(SlurmError):
            _run(["scancel", *extra, *steps])
        return True

    def adopt(self, name: str, pid: int) -> None:
        """Node ``name``'s agent step was started by a controller this one took over from (its
        ``srun`` may have died with that controller's node): reached by its step's name."""
        with self._lock:
            self.adopted.add(name)
            self.procs.pop(name, None)

    def _is_adopted(self, name: str) -> bool:
        with self._lock:
            return name in self.adopted

    def kill(self, name: str) -> bool:
        """``scancel --signal=KILL`` of the node's step, in the background: the controller calls
        this on the path that declares a host lost, and scancel waits for slurmctld, which
        waits for an unresponsive node's slurmd (seconds: a failed node's groups would wait)."""
        if self._proc(name) is None and not self._is_adopted(name):
            return False
        threading.Thread(
            target=self.cancel_step, args=(name, "KILL"), daemon=True, name=f"scancel-{name}"
        ).start()
        return True

    def stop(self, name: str, timeout_s: float) -> None:
        if not self._is_adopted(name) or self._proc(name) is not None:
            super().stop(name, timeout_s)
            return
        import time

        deadline = time.monotonic() + timeout_s  # no srun of ours to wait for: ask SLURM
        while self.step_ids(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.cancel_step(name, "KILL")

    def _force_stop(self, name: str, popen: subprocess.Popen) -> None:
        self.cancel_step(name, "KILL")
        popen.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=10.0)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            procs, adopted = dict(self.procs), bool(self.adopted)
        if adopted or any(p.poll() is None for p in procs.values()):
            with contextlib.suppress(SlurmError):
                steps = self.step_ids()
                if steps:
                    _run(["scancel", "--signal=KILL", *steps])
        for popen in procs.values():
            if popen.poll() is None:
                popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=10.0)
        if self._extra_jobs:
            with contextlib.suppress(SlurmError):
                _run(["scancel", *self._extra_jobs])
