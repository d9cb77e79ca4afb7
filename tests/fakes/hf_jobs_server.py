"""FAKE of the Hugging Face Hub's Jobs API (and the few repo-download routes ``fetch`` uses), for tests only.

No test may reach huggingface.co, so the REAL ``huggingface_hub`` client is pointed at this
loopback aiohttp server (``HfApi(endpoint=server.url)``). It records every request (method,
path, query, JSON body, Authorization header) in memory — never on disk, because bodies
carry secret values — and answers like the Hub (payload shapes from huggingface_hub 2.4.0
``_jobs_api.py`` / ``hf_api.py``):

- ``GET /api/whoami-v2``; ``GET /api/jobs/hardware``;
- ``POST /api/jobs/{ns}`` (create; answers a JobInfo), ``GET /api/jobs/{ns}`` (list),
  ``GET /api/jobs/{ns}/{id}`` (each call advances the job one stage through ``stages``),
  ``GET /api/jobs/{ns}/{id}/logs`` (SSE ``data: {"timestamp", "data"}``),
  ``POST /api/jobs/{ns}/{id}/cancel``;
- ``GET /api/{models|datasets}/{ns}/{name}/revision/{rev}``, ``.../tree/{rev}[/path]`` and
  ``HEAD|GET /[datasets/]{ns}/{name}/resolve/{rev}/{path}``, serving a local folder per repo.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

HARDWARE = [
    {"name": "cpu-basic", "prettyName": "CPU Basic", "cpu": "2 vCPU", "ram": "16 GB", "ephemeralStorage": "50 GB",
     "accelerator": None, "unitCostMicroUSD": 167, "unitCostUSD": 0.000167, "unitLabel": "minute"},
    {"name": "cpu-xl", "prettyName": "CPU XL", "cpu": "16 vCPU", "ram": "124 GB", "ephemeralStorage": "1000 GB",
     "accelerator": None, "unitCostMicroUSD": 16667, "unitCostUSD": 0.016667, "unitLabel": "minute"},
    {"name": "l40sx1", "prettyName": "1x Nvidia L40S", "cpu": "8 vCPU", "ram": "62 GB", "ephemeralStorage": "380 GB",
     "accelerator": {"type": "gpu", "model": "L40S", "quantity": "1", "vram": "48 GB", "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 30000, "unitCostUSD": 0.03, "unitLabel": "minute"},
]
SHA = "0123456789abcdef0123456789abcdef01234567"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class FakeHfJobsServer:
    """A recording fake of the Jobs API on 127.0.0.1 (run in a thread; use as a context manager).

    Args:
        user: the namespace whoami answers.
        stages: the stages a job walks through, one per status request.
        log_lines: what every job's log holds.
    """

    def __init__(self, user: str = "tester", stages: tuple[str, ...] = ("SCHEDULING", "RUNNING", "COMPLETED"),
                 log_lines: list[str] | None = None):
        self.user, self.stages = user, stages
        self.log_lines = log_lines or ["job started", "done"]
        self.requests: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.repos: dict[str, Path] = {}  # "models/ns/name" or "datasets/ns/name" -> folder
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> "FakeHfJobsServer":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)  # type: ignore[union-attr]
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)  # type: ignore[union-attr]

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._record])
        r = app.router
        r.add_get("/api/whoami-v2", self.whoami)
        r.add_get("/api/jobs/hardware", self.hardware)
        r.add_post("/api/jobs/{ns}", self.create)
        r.add_get("/api/jobs/{ns}", self.list_jobs)
        r.add_get("/api/jobs/{ns}/{id}", self.inspect)
        r.add_get("/api/jobs/{ns}/{id}/logs", self.logs)
        r.add_post("/api/jobs/{ns}/{id}/cancel", self.cancel)
        r.add_get("/api/{kind:models|datasets}/{ns}/{name}/revision/{rev}", self.repo_info)
        r.add_get("/api/{kind:models|datasets}/{ns}/{name}/tree/{rev}{path:.*}", self.tree)
        r.add_route("*", "/datasets/{ns}/{name}/resolve/{rev}/{path:.+}", self.resolve)
        r.add_route("*", "/{ns}/{name}/resolve/{rev}/{path:.+}", self.resolve)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    @web.middleware
    async def _record(self, request: web.Request, handler):
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        self.requests.append({"method": request.method, "path": request.path, "query": dict(request.query),
                              "json": body, "authorization": request.headers.get("authorization")})
        return await handler(request)

    # -- helpers ----------------------------------------------------------------------
    def of(self, method: str, path_prefix: str) -> list[dict[str, Any]]:
        """Recorded requests with this method whose path starts with ``path_prefix``."""
        return [r for r in self.requests if r["method"] == method and r["path"].startswith(path_prefix)]

    def _info(self, job: dict[str, Any]) -> dict[str, Any]:
        spec = job["spec"]
        return {"id": job["id"], "createdAt": job["created"], "dockerImage": spec.get("dockerImage"),
                "command": spec.get("command"), "arguments": spec.get("arguments"),
                "environment": spec.get("environment"), "secrets": {k: "***" for k in spec.get("secrets", {})},
                "flavor": spec.get("flavor"), "labels": spec.get("labels"),
                "status": {"stage": self.stages[job["step"]] if not job["canceled"] else "CANCELED", "message": None},
                "owner": {"id": "u1", "name": job["ns"], "type": "user"},
                "durations": {"schedulingSecs": 1, "runningSecs": job["step"], "totalSecs": job["step"] + 1}}

    # -- Jobs API ---------------------------------------------------------------------
    async def whoami(self, request: web.Request) -> web.Response:
        if not request.headers.get("authorization"):
            return web.json_response({"error": "Invalid credentials"}, status=401)
        return web.json_response({"type": "user", "name": self.user, "id": "u1", "orgs": [], "auth": {}})

    async def hardware(self, request: web.Request) -> web.Response:
        return web.json_response(HARDWARE)

    async def create(self, request: web.Request) -> web.Response:
        spec = self.requests[-1]["json"]
        job_id = hashlib.sha1(f"{len(self.jobs)}{_now()}".encode()).hexdigest()[:24]
        self.jobs[job_id] = {"id": job_id, "ns": request.match_info["ns"], "spec": spec, "step": 0,
                             "canceled": False, "created": _now()}
        return web.json_response(self._info(self.jobs[job_id]))

    async def list_jobs(self, request: web.Request) -> web.Response:
        return web.json_response([self._info(j) for j in self.jobs.values()])

    async def inspect(self, request: web.Request) -> web.Response:
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        info = self._info(job)
        job["step"] = min(job["step"] + 1, len(self.stages) - 1)
        return web.json_response(info)

    async def logs(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["id"] not in self.jobs:
            return web.json_response({"error": "Job not found"}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for line in ["===== Job started at " + _now() + " =====", *self.log_lines]:
            await resp.write(f"data: {json.dumps({'timestamp': _now(), 'data': line})}\n\n".encode())
        await resp.write_eof()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        job["canceled"] = True
        return web.json_response({})

    # -- repo download (fetch) ----------------------------------------------------------
    def _folder(self, request: web.Request, kind: str | None = None) -> Path | None:
        kind = kind or ("datasets" if request.path.startswith("/datasets/") else "models")
        return self.repos.get(f"{kind}/{request.match_info['ns']}/{request.match_info['name']}")

    async def repo_info(self, request: web.Request) -> web.Response:
        folder = self._folder(request, request.match_info["kind"])
        if folder is None:
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        files = [{"rfilename": str(p.relative_to(folder))} for p in sorted(folder.rglob("*")) if p.is_file()]
        return web.json_response({"id": f"{request.match_info['ns']}/{request.match_info['name']}", "sha": SHA,
                                  "private": True, "siblings": files})

    async def tree(self, request: web.Request) -> web.Response:
        folder = self._folder(request, request.match_info["kind"])
        if folder is None:
            return web.json_response({"error": "Repository not found"}, status=404)
        base = folder / request.match_info["path"].lstrip("/")
        items = base.rglob("*") if request.query.get("recursive") in ("true", "True", "1") else base.glob("*")
        out = []
        for p in sorted(items):
            rel = str(p.relative_to(folder))
            if p.is_dir():
                out.append({"type": "directory", "path": rel, "oid": SHA})
            else:
                out.append({"type": "file", "path": rel, "size": p.stat().st_size,
                            "oid": hashlib.sha1(p.read_bytes()).hexdigest()})
        return web.json_response(out)

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        folder = self._folder(request)
        path = folder / request.match_info["path"] if folder else None
        if path is None or not path.is_file():
            return web.json_response({"error": "Entry not found"}, status=404, headers={"X-Error-Code": "EntryNotFound"})
        data = path.read_bytes()
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                   "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return web.Response(status=200, headers=headers)
        return web.Response(body=data, headers=headers)
