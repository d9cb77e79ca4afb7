"""Start the synthetic SSE server as a child process and read back what it sent.

Example::

    with SynthServer({"ttft": {"ms": 50}, "itl": {"ms": 10}}, workers=1) as srv:
        ...  # point a client at srv.url
        sent = srv.records()   # {request_id: {"recv_ns", "events": [(nominal, actual, n_tokens, kind)]}}
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bakeoff.loadgen.synth_config import SynthConfig
from bakeoff.host.procs import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


class SynthServer:
    """The synthetic server in a child process (``python -m bakeoff.loadgen.synth_server``).

    Args:
        config: a :class:`SynthConfig` or a dict of its fields.
        workers: server processes sharing the port through ``SO_REUSEPORT``.
        port: TCP port on 127.0.0.1 (default: a free one).
        start_timeout_s: deadline for every worker to print ``READY``.
    """

    def __init__(self, config: SynthConfig | dict[str, Any] | None = None, workers: int = 1, port: int | None = None,
                 start_timeout_s: float = 30.0):
        self.config = config if isinstance(config, SynthConfig) else SynthConfig.model_validate(config or {})
        self.workers = workers
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.log_dir = tempfile.mkdtemp(prefix="bakeoff-synth-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SynthServer":
        """Launch and wait until every worker listens.

        Raises:
            RuntimeError: with the child's output when it does not start in time.
        """
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "bakeoff.loadgen.synth_server", "--port", str(self.port), "--config",
               self.config.model_dump_json(), "--workers", str(self.workers), "--log-dir", self.log_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        ready, out, deadline = 0, b"", time.monotonic() + self.start_timeout_s
        while ready < self.workers:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"synthetic server did not start: {out.decode(errors='replace')[-2000:]}")
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                line = self.proc.stdout.readline()
                out += line
                ready += line.startswith(b"READY")
        return self

    def records(self, expect: int | None = None, wait_s: float = 2.0) -> dict[str, dict]:
        """Every request the server answered so far, by request id (from all workers' logs).

        Args:
            expect: wait (up to ``wait_s``) until at least this many records are logged.
        """
        deadline = time.monotonic() + wait_s
        while True:
            recs: dict[str, dict] = {}
            for p in Path(self.log_dir).glob("sent-*.jsonl"):
                for line in p.read_text().splitlines():
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue  # a line still being written
                    recs[r["request_id"]] = r
            if expect is None or len(recs) >= expect or time.monotonic() > deadline:
                return recs
            time.sleep(0.05)

    def reset(self) -> None:
        """Forget the records logged so far."""
        for p in Path(self.log_dir).glob("sent-*.jsonl"):
            p.write_text("")

    def stop(self) -> None:
        """Stop every worker; safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "SynthServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
