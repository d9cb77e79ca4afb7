"""Load generation: streaming clients, load shapes, per-request timing, statistics, self-calibration.

Modules:
    http: asyncio-protocol HTTP/1.1 client; bytes are stamped (``time.monotonic_ns()``) in the
        socket callback, before any parsing or task switch.
    client: ``OpenAIClient`` (completions, chat, Anthropic messages) over ``http``.
    sweep: ``run_request``, ``closed_loop``, ``open_loop`` (Poisson), ``run_sweep``.
    multiproc: ``closed_loop_mp`` / ``open_loop_mp``: one event loop per process, records merged.
    stats: ``per_request``, ``summarize`` (numpy percentiles).
    synth_server / synth_protocol / synth_launch: the synthetic SSE server with a known schedule
        and a record of what it really sent; ``SynthServer`` runs it as a child process.
    calibrate: ``calibrate``, ``calibrate_sweep``, ``cli_calibrate``: the generator's own error.
"""
