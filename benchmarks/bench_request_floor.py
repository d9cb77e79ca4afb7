"""What one request costs bakeoff's serving path, whatever the engine: the floor under a fidelity ratio.

An engine's own bare loop (``benchmarks/bench_fidelity.py``'s tool side) starts its next request in
the same process for free; bakeoff's sweep sends each request over HTTP through its client, the
backend's HTTP worker and (ORT GenAI, OpenVINO) the engine process. At 1 session that cost is paid
once per request, in series with the engine's work, so a request the engine serves in ``T`` ms can
measure at most ``T / (T + floor)`` of the bare loop's tokens/s however cheap each token is.

This prints, for requests of ``--max-tokens`` tokens sent one at a time (``--requests``, after
``--warmup``):

- ``raw``: bakeoff's client (:class:`bakeoff.loadgen.client.OpenAIClient`) against a minimal asyncio
  HTTP server in another process that answers every request at once with one SSE event (the HTTP
  round trip alone: one client, one server, loopback TCP);
- ``BACKEND``: the same client against each ``--backends`` backend started on ``--model`` (its
  defaults, as bakeoff's sweep runs it), with the CPU milliseconds per request of the client and of
  each of the backend's processes (``/proc``), and the engine's own step counters where its
  ``/metrics`` has them.

Each latency is given as p50 and mean with a 95% interval of the mean (percentile bootstrap,
:func:`bakeoff.analysis.noise.bootstrap_mean`), in ms.

Usage::

    .venv/bin/python benchmarks/bench_request_floor.py [--backends ort-genai,openvino] [--model fixture:tiny-qwen3]
        [--max-tokens 1] [--requests 300] [--warmup 30] [--out F.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bakeoff.analysis.noise import bootstrap_mean  # noqa: E402
from fidelity_tools import engine_cpu_s  # noqa: E402

RAW_SERVER = r"""
import asyncio, sys
BODY = (b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\ndata: [DONE]\n\n')
RESP = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
class Answer(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")), 0)
            if len(rest) < n:
                return
            self.buf = rest[n:]
            self.transport.write(RESP)
async def main():
    server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def _stats(ms: list[float]) -> dict:
    ci = bootstrap_mean(ms)
    return {"p50_ms": round(statistics.median(ms), 3), "mean_ms": round(ci.mean, 3),
            "mean_low_ms": round(ci.low, 3), "mean_high_ms": round(ci.high, 3), "n": ci.n}


async def _sequential(client, prompt_of, n: int, max_tokens: int, tag: str) -> list[float]:
    from bakeoff.api.specs import GenerationRequest

    out = []
    for i in range(n):
        t = time.perf_counter()
        req = GenerationRequest(request_id=f"{tag}-{i}", prompt=prompt_of(i), max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True)
        async for _ in client.stream(req):
            pass
        out.append((time.perf_counter() - t) * 1e3)
    return out


def measure_raw(args) -> dict:
    from bakeoff.loadgen.client import OpenAIClient

    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = OpenAIClient(f"http://127.0.0.1:{port}", "raw")
        asyncio.run(_sequential(client, lambda i: "hi", args.warmup, 1, "w"))
        c0 = time.process_time()
        ms = asyncio.run(_sequential(client, lambda i: "hi", args.requests, 1, "r"))
        return {**_stats(ms), "cpu_ms_per_request": {"client": round((time.process_time() - c0) / args.requests * 1e3, 3)}}
    finally:
        proc.kill()
        proc.wait()


def measure_backend(name: str, model_path: str, fixture: bool, args) -> dict:
    from backends import resolve
    from bakeoff.api.specs import BackendConfig
    from evaluations.probing import throughput_prompt

    with tempfile.TemporaryDirectory(prefix=f"floor-{name}-") as work:
        engine = resolve(name)(BackendConfig(backend=name, model=model_path, workdir=work, options={}))
        try:
            engine.start()
            prompt_of = lambda i: throughput_prompt(0, i, fixture)  # noqa: E731
            asyncio.run(_sequential(engine.client, prompt_of, args.warmup, args.max_tokens, "w"))
            before, c0 = engine_cpu_s(engine), time.process_time()
            ms = asyncio.run(_sequential(engine.client, prompt_of, args.requests, args.max_tokens, "r"))
            client_s, after = time.process_time() - c0, engine_cpu_s(engine)
        finally:
            engine.stop()
    cpu = {"client": round(client_s / args.requests * 1e3, 3),
           **{k: round((v - before.get(k, 0.0)) / args.requests * 1e3, 3) for k, v in after.items()}}
    return {**_stats(ms), "cpu_ms_per_request": cpu}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="ort-genai", help="comma-separated backends to measure ('' for the raw server only)")
    ap.add_argument("--model", default="fixture:tiny-qwen3")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for flag, value, least in (("--requests", args.requests, 1), ("--warmup", args.warmup, 0),
                               ("--max-tokens", args.max_tokens, 1)):
        if value < least:
            ap.error(f"{flag} must be at least {least}, got {value}")
    from backends import names
    from bakeoff.api.errors import UserError
    from bakeoff.models.resolve import resolve as resolve_model

    unknown = [b for b in args.backends.split(",") if b and b not in names()]
    if unknown:
        ap.error(f"unknown backend {unknown[0]!r}; choose from {', '.join(names())}")
    try:
        model = resolve_model(args.model)
    except UserError as exc:
        ap.error(str(exc))
    rows = {"raw": measure_raw(args)}
    for name in [b for b in args.backends.split(",") if b]:
        rows[name] = measure_backend(name, str(model.path), model.fixture is not None, args)
    for name, r in rows.items():
        print(f"{name:12s} latency p50 {r['p50_ms']:.3f} ms, mean {r['mean_ms']:.3f} [{r['mean_low_ms']:.3f}, "
              f"{r['mean_high_ms']:.3f}] ms over {r['n']} requests; CPU ms per request {r['cpu_ms_per_request']}")
    out = {"command": [sys.executable, *sys.argv], "model": args.model, "max_tokens": args.max_tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
