"""Worker process: llama.cpp's ``llama-server`` serving a GGUF file, through ``xllamacpp``.

Runs in the ``llamacpp`` environment (:mod:`backends.llamacpp.env`) as ``python -m
backends.llamacpp.worker --gguf FILE --port P --ready-file F --options JSON``. The server is
llama.cpp's own C++ HTTP server (``xllamacpp.Server`` starts it on its threads); this process
only configures it, waits until ``/health`` answers 200, writes what the server states
(``/props``: slots, context per slot, the GGUF's file type, chat template; the build) to the
ready file, and sleeps until it is stopped.

Sampling defaults are made neutral (``top_k`` 0, ``top_p`` 1, ``min_p`` 0, no repeat, presence,
frequency or DRY penalty, no XTC): llama-server applies its own defaults (top_k 40, top_p 0.95,
min_p 0.05) to every field a request leaves out, so a request bakeoff sends at a temperature
would otherwise be sampled from a truncated distribution it did not ask for. At temperature 0
llama.cpp samples greedily either way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

NEUTRAL_SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typ_p": 1.0, "penalty_repeat": 1.0,
                    "penalty_freq": 0.0, "penalty_present": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0}


def configure(x, gguf: str, port: int, opts: dict):
    """``xllamacpp.CommonParams`` for the options (:class:`backends.llamacpp.backend.LlamaCppOptions`)."""
    p = x.CommonParams()
    p.model.path = gguf
    p.port = port
    p.n_parallel = int(opts["parallel_slots"])
    p.n_ctx = int(opts["ctx_size"])
    p.kv_unified = bool(opts["kv_unified"])
    p.cont_batching = True
    p.cache_prompt = bool(opts["cache_prompt"])
    p.endpoint_metrics = True
    p.endpoint_props = True
    p.n_batch, p.n_ubatch = int(opts["batch_size"]), int(opts["ubatch_size"])
    if opts.get("threads"):
        p.cpuparams.n_threads = int(opts["threads"])
        p.cpuparams_batch.n_threads = int(opts["threads"])
    for key, value in NEUTRAL_SAMPLING.items():
        setattr(p.sampling, key, value)
    if opts.get("draft_gguf"):  # speculative decoding with a draft model (llama-server's --model-draft)
        p.speculative.draft.mparams.path = opts["draft_gguf"]
        p.speculative.types = [x.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        if opts.get("draft_max"):
            p.speculative.draft.n_max = int(opts["draft_max"])
        if opts.get("threads"):
            p.speculative.draft.cpuparams.n_threads = int(opts["threads"])
            p.speculative.draft.cpuparams_batch.n_threads = int(opts["threads"])
    return p


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback, our own server
        return json.loads(r.read(1 << 20))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--options", default="{}")
    args = ap.parse_args()
    opts = json.loads(args.options)
    import xllamacpp as x

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = x.Server(configure(x, args.gguf, args.port, opts))
    base = f"http://127.0.0.1:{args.port}"
    while not stop.is_set():
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.1)
    props = get_json(base + "/props")
    gen = props.get("default_generation_settings") or {}
    info = {"engine_version": x.__version__ if hasattr(x, "__version__") else None,
            "build_info": str(getattr(x, "BUILD_INFO", "")), "system_info": str(x.get_system_info()).strip(),
            "total_slots": props.get("total_slots"), "n_ctx_slot": gen.get("n_ctx"),
            "model_path": props.get("model_path"), "chat_template": bool(props.get("chat_template")),
            "props": {k: v for k, v in props.items() if k not in ("default_generation_settings", "chat_template")},
            "options": opts, "sampling_defaults": NEUTRAL_SAMPLING}
    with open(args.ready_file + ".tmp", "w") as fh:
        json.dump({"info": info}, fh, default=str)
    os.replace(args.ready_file + ".tmp", args.ready_file)
    print(f"llamacpp worker: serving {args.gguf} on {base}", file=sys.stderr, flush=True)
    stop.wait()
    del server


if __name__ == "__main__":
    main()
