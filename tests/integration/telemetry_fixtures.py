"""Fixtures for the telemetry integration tests: a job that exports metrics, a real Prometheus
server scraping it, and a small OTLP/HTTP receiver. Import the fixtures into a test module.

``telemetry_job_command`` is the one place that says what "the running job" is. Today it is
``telemetry_stand_in_job.py`` (a real process driving a real Journal with the Telemetry sink).
Its contract:
given a journal path and an address file, it serves Prometheus metrics on 127.0.0.1 (port 0),
writes ``host:port`` to the address file, journals one injected ``kill`` of replica group 1 and
the recovery, and keeps serving until SIGTERM, then exits 0. Point it at ``ftharness run
--prometheus-port 0`` with a real fault once the runtime can write the chosen address.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE_JOB = HERE / "telemetry_stand_in_job.py"


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, every: float = 0.2):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def free_port() -> int:
    """A port that was free a moment ago (for servers that cannot report a port-0 choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@pytest.fixture
def telemetry_job_command() -> Callable[..., list[str]]:
    """argv of the running job (see the module docstring for its contract)."""

    def make(
        *,
        journal: Path,
        address_file: Path,
        job: str,
        hold: bool = True,
        otlp_endpoint: str | None = None,
        step_s: float = 0.05,
    ) -> list[str]:
        argv = [
            sys.executable,
            str(FAKE_JOB),
            "--journal",
            str(journal),
            "--job",
            job,
            "--prometheus-port",
            "0",
            "--address-file",
            str(address_file),
            "--step-s",
            str(step_s),
        ]
        if hold:
            argv.append("--hold")
        if otlp_endpoint:
            argv += ["--otlp-endpoint", otlp_endpoint]
        return argv

    return make


@pytest.fixture
def running_job(tmp_path, telemetry_job_command) -> Iterator[dict[str, Any]]:
    """Start the job; yield its journal, name, metrics address and process; stop it after."""
    job = f"prom-{os.getpid()}"
    address_file = tmp_path / "metrics.addr"
    journal = tmp_path / "journal.jsonl"
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        telemetry_job_command(journal=journal, address_file=address_file, job=job),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=job_env(),
        cwd=REPO,
    )
    try:
        addr = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(),
            timeout=60,
            what="the job's metrics address",
        )
        yield {
            "job": job,
            "journal": journal,
            "address": addr,
            "proc": proc,
            "log": tmp_path / "job.log",
        }
    finally:
        stop_process(proc)
        log.close()


class Prometheus:
    """A real Prometheus server (Debian's binary) on 127.0.0.1 with storage in a temp dir."""

    def __init__(self, workdir: Path, targets: list[str], scrape_interval: str = "1s") -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "ftharness",
                            "scrape_interval": scrape_interval,
                            "static_configs": [{"targets": targets}],
                        }
                    ],
                }
            )
        )
        self.proc: subprocess.Popen | None = None
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        for _ in range(5):  # a port picked free can be taken before Prometheus binds it
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=self.log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
            if self._wait_ready():
                return
            stop_process(self.proc)
        raise RuntimeError(f"prometheus did not start; see {workdir / 'prometheus.log'}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{self.port}/-/ready"
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    return True
            time.sleep(0.1)
        return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query through the HTTP API; the result vector."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The single value of a query, or None when it returns no series."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.log.close()


class OtlpReceiver:
    """An OTLP/HTTP endpoint on 127.0.0.1:0 decoding trace and metric export requests."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.traces: list[Any] = []
        self.metrics: list[Any] = []
        self.errors: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    receiver.errors.append(f"content type {self.headers.get('Content-Type')}")
                if self.path == "/v1/traces":
                    msg = ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    receiver.traces.append(msg)
                elif self.path == "/v1/metrics":
                    msg = ExportMetricsServiceRequest()
                    msg.ParseFromString(body)
                    receiver.metrics.append(msg)
                else:
                    receiver.errors.append(f"unexpected path {self.path}")
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[Any, Any]]:
        """(resource, span) for every span received."""
        return [
            (rs.resource, span)
            for req in self.traces
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def metric_names(self) -> set[str]:
        return {
            m.name
            for req in self.metrics
            for rm in req.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


def attrs(kvs) -> dict[str, Any]:
    """An OTLP KeyValue list as a dict of plain values."""
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out
