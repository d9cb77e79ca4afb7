"""A test server in a child process (a FAKE engine, a proxy double), ready when its route answers 200,
stopped by :meth:`ChildServer.close`. Used by the test files that run the suite against doubles."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import backends
from bakeoff.api.specs import BackendConfig

REPO = Path(__file__).resolve().parent.parent.parent


class ChildServer:
    """``cmd`` serving HTTP on ``port`` (its output in ``log``) until :meth:`close`.

    Raises:
        AssertionError: the child exited, or ``ready_path`` did not answer 200 within ``timeout_s``
            (the log's tail in the message).
    """

    def __init__(self, cmd: list[str], port: int, log: Path, ready_path: str = "/health", timeout_s: float = 180):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
            assert self.proc.poll() is None, log.read_text()[-2000:]
        self.close()
        raise AssertionError(f"{cmd[:4]} not ready: {log.read_text()[-2000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@contextmanager
def transformers_worker(model: Path, workdir: Path) -> Iterator[str]:
    """The real transformers worker serving ``model`` in float32 (the reference's dtype): its URL, the engine
    stopped at the end. The engine behind the proxy doubles."""
    engine = backends.resolve("transformers")(BackendConfig(backend="transformers", model=str(model),
                                                            options={"dtype": "float32"}, workdir=str(workdir)))
    try:
        engine.start()
        yield engine.base_url
    finally:
        engine.stop()
