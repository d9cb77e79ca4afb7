"""Load generation: streaming clients, load shapes, per-request timing, statistics, self-calibration.

Modules:
    http: asyncio-protocol HTTP/1.1 client; bytes are stamped (``time.monotonic_ns()``) in the
        socket callback (its connection: ``http_conn``), before any parsing or task switch.
    client: ``OpenAIClient`` (completions, chat, Anthropic messages) over ``http``.
    sweep: ``run_request``, ``closed_loop``, ``open_loop`` (Poisson), ``run_sweep``.
    multiproc: ``closed_loop_mp`` / ``open_loop_mp``: one event loop per process, records merged.
    stats: ``per_request``, ``summarize`` (numpy percentiles).
    synth_server / synth_protocol / synth_launch: the synthetic SSE server with a known schedule
        and a record of what it really sent; ``SynthServer`` runs it as a child process.
    calibrate: ``calibrate``, ``calibrate_sweep``: the generator's own error.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's event loop when uvloop is installed, else asyncio's own.

    The load generator and the synthetic server run hundreds of streams on one loop; uvloop's
    libuv loop costs less CPU per I/O callback, which on a small host is CPU the other side
    of the measurement gets back (``benchmarks/bench_loadgen.py`` measures both loops).
    ``BAKEOFF_LOOP=asyncio`` forces asyncio's loop.
    """
    if os.environ.get("BAKEOFF_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
    return asyncio.run(coro)
