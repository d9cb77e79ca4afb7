"""A FAKE multi-rank engine: a server and two rank processes (``tests/test_ranks.py``).

Shaped like vLLM with ``tensor_parallel_size=2``: the server (aiohttp, completions API) starts
one process per rank whose command line carries its title (``FAKE::Worker_TP0``,
``FAKE::Worker_TP1``), and every request is worked by both ranks: the server writes a command to
each rank's control file and the rank obeys it. Not a backend of bakeoff, and not vLLM. What a
request does is written in its prompt:

- ``work``: both ranks burn 0.2 s, then the server streams ``max_tokens`` tokens;
- ``spin``: rank 1 spins on one core for good while rank 0 waits (a wedged collective), and the
  server sends the head and nothing more: the hang of a rank spinning while the API answers
  nothing;
- ``kill``: the server SIGKILLs rank 1 and never answers; with ``--monitor`` (vLLM's way) it
  notices the rank's death within 0.3 s, logs it and exits 1;
- anything else: answered at once.

``--lose`` kills rank 1 before the server listens (a rank lost while the engine starts).
``--drop VAR`` starts rank 1 with ``VAR`` removed from its environment (a launcher that does not
pass the server's variables on); ``--no-site`` starts the ranks with ``python -S`` (no
``sitecustomize``: nothing reports their environment, so it is read from ``/proc``).

Run as ``python -m tests.fakes.ranked_servers --port P [--drop VAR] [--monitor] [--no-site]``, or
``--rank N --control FILE`` for one rank (the server does that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TITLE = "FAKE::Worker_TP{}"


def rank_main(control: str) -> None:
    """One rank: obey the control file (``idle``, ``work S``, ``spin``) every 20 ms."""
    done = ""
    while True:
        try:
            with open(control) as fh:
                cmd = fh.read().strip()
        except OSError:
            cmd = "idle"
        if cmd == "spin":
            while True:
                pass
        if cmd.startswith("work") and cmd != done:
            end = time.monotonic() + float(cmd.split()[2])
            while time.monotonic() < end:
                pass
            done = cmd
            with open(control + ".done", "w") as fh:
                fh.write(cmd)
        time.sleep(0.02)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def ranked_app(ranks: list[subprocess.Popen], controls: list[str], monitor: bool):
    from aiohttp import web

    seq = {"n": 0}

    def order(rank: int, cmd: str) -> None:
        with open(controls[rank], "w") as fh:
            fh.write(cmd)

    async def health(_):
        return web.json_response({"status": "ok"})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "ranked-double", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        what = str(body.get("prompt") or "").strip()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if what == "work":
            seq["n"] += 1
            cmd = f"work {seq['n']} 0.2"
            for r in range(len(ranks)):
                order(r, cmd)
            while not all(os.path.exists(c + ".done") and open(c + ".done").read() == cmd for c in controls):
                await asyncio.sleep(0.02)
        elif what == "spin":
            order(1, "spin")
            await asyncio.sleep(3600)
        elif what == "kill":
            ranks[1].send_signal(signal.SIGKILL)
            await asyncio.sleep(3600)
        n = int(body.get("max_tokens") or 4)
        for k in range(n):
            await resp.write(_sse({"choices": [{"index": 0, "text": f" t{k}", "token_ids": [k],
                                                "finish_reason": "length" if k == n - 1 else None}]}))
        await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def watch_ranks(app):
        async def loop():
            while True:
                await asyncio.sleep(0.1)
                for i, p in enumerate(ranks):
                    if p.poll() is not None:
                        print(f"ERROR rank {i} (pid {p.pid}) died with code {p.returncode}; shutting down", flush=True)
                        await asyncio.sleep(0.2)
                        os._exit(1)
        if monitor:
            app["monitor"] = asyncio.ensure_future(loop())

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.on_startup.append(watch_ranks)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--control")
    ap.add_argument("--title")
    ap.add_argument("--drop", action="append", default=[])
    ap.add_argument("--monitor", action="store_true")
    ap.add_argument("--no-site", action="store_true")
    ap.add_argument("--lose", action="store_true")
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.control)
        return
    from aiohttp import web

    folder = tempfile.mkdtemp(prefix="ranked-double-")
    ranks, controls = [], []
    for r in range(2):
        control = os.path.join(folder, f"rank{r}")
        env = dict(os.environ)
        if r == 1:
            for var in args.drop:
                env.pop(var, None)
        py = [sys.executable, "-S"] if args.no_site else [sys.executable]  # -S: no sitecustomize (PYTHONPATH still read)
        ranks.append(subprocess.Popen([*py, "-m", "tests.fakes.ranked_servers", "--rank", str(r), "--control", control,
                                       "--title", TITLE.format(r)], env=env))
        controls.append(control)
    print(f"ranks {[p.pid for p in ranks]}", flush=True)
    if args.lose:
        ranks[1].kill()
        ranks[1].wait()
    web.run_app(ranked_app(ranks, controls, args.monitor), host="127.0.0.1", port=args.port, access_log=None,
                print=None, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
