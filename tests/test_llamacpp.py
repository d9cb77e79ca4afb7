"""The llamacpp backend: llama.cpp's own server (``xllamacpp``) on the real model's GGUF, for real.

The engine serves the GGUF Q4_1 file the registry package ships (``--model smollm2-135m-instruct``
keeps it beside the Hugging Face checkpoint it converts); the checks below ask the running server,
never a double: its tokenizer against the checkpoint's, its greedy answer, the token ids its
logprob entries name (llama.cpp streams no ``token_ids``), usage against them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from backends.llamacpp.backend import LlamaCppBackend, find_gguf
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig, GenerationRequest, RequestRecord
from bakeoff.loadgen.accounting import account


def test_find_gguf_takes_the_one_file_the_packaged_layout_or_says_what_to_pass(tmp_path):
    hf = tmp_path / "m" / "hf"
    hf.mkdir(parents=True)
    with pytest.raises(EngineFailure) as e:
        find_gguf(str(hf), None)
    assert e.value.failure_class == "unavailable" and "no GGUF file" in str(e.value) and "gguf=FILE" in str(e.value)
    (tmp_path / "m" / "packaged.json").write_text("{}")
    (tmp_path / "m" / "gguf").mkdir()
    shipped = tmp_path / "m" / "gguf" / "model.Q4_1.gguf"
    shipped.write_bytes(b"GGUF")
    assert find_gguf(str(hf), None) == shipped  # beside a packaged model's checkpoint
    (hf / "a.gguf").write_bytes(b"GGUF")
    (hf / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(EngineFailure) as e:
        find_gguf(str(hf), None)
    assert "2 GGUF files (a.gguf, b.gguf)" in str(e.value)
    assert find_gguf(str(hf), str(hf / "b.gguf")) == hf / "b.gguf"
    with pytest.raises(EngineFailure) as e:
        find_gguf(str(hf), str(tmp_path / "missing.gguf"))
    assert "is not a file" in str(e.value)


def test_unknown_option_is_a_one_line_user_error(tmp_path):
    from bakeoff.api.errors import UserError

    with pytest.raises(UserError) as e:
        LlamaCppBackend(BackendConfig(backend="llamacpp", model=str(tmp_path), workdir=str(tmp_path / "w"),
                                      options={"n_parallel": 4}))
    assert "n_parallel" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bakeoff.models import packaged

    model = str(packaged.build("smollm2-135m-instruct"))
    b = LlamaCppBackend(BackendConfig(backend="llamacpp", model=model, workdir=str(tmp_path_factory.mktemp("lc")),
                                      options={"parallel_slots": 4, "ctx_size": 8192}))
    b.start()
    yield b, model
    b.stop()


def _stream(b, **kw) -> tuple[list, RequestRecord]:
    req = GenerationRequest(request_id="r", max_tokens=kw.pop("max_tokens", 8), temperature=0.0, **kw)

    async def main():
        try:
            return [ev async for ev in b.stream(req)]
        finally:
            await b.aclose()
    evs = asyncio.run(main())
    usage = next((ev.usage for ev in evs if ev.usage), None)
    rec = RequestRecord(request_id="r")
    account(rec, [ev for ev in evs if ev.usage is None], usage.prompt_tokens if usage else None,
            usage.completion_tokens if usage else None, None, max_tokens=req.max_tokens)
    return evs, rec


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_the_real_server_states_its_configuration_and_tokenizes_as_the_checkpoint(server):
    from tokenizers import Tokenizer

    b, model = server
    notes = b.info.notes
    assert b.info.engine == "llama.cpp" and b.info.concurrent_requests == 4 and b.info.kv_cache_tokens == 8192
    assert notes["gguf"].endswith("...)") and "Q4_1.gguf" in notes["gguf"] and "AVX2 = 1" in notes["system_info"]
    assert b.info.max_model_len == 8192  # the model's trained context: the unified cache lets a slot use it all
    assert b.info.max_concurrency == 1.0  # 8,192 cells hold one request at the 8,192-token context
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    text = "The capital of France is"
    assert b.tokenize([text]) == [tok.encode(text, add_special_tokens=True).ids], b.tokenize_note
    chat = b.tokenize(["What is the capital of France?"], chat=True)
    assert chat is not None and chat[0][-4:] == tok.encode("<|im_start|>assistant\n").ids, b.tokenize_note
    ready = json.loads(b.ready_file.read_text())["info"]
    assert ready["sampling_defaults"]["top_k"] == 0 and ready["sampling_defaults"]["min_p"] == 0.0


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_greedy_answer_with_token_ids_from_the_logprob_entries(server):
    b, model = server
    evs, rec = _stream(b, prompt="<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                       logprobs=3, max_tokens=12)
    assert "Paris" in rec.output_text, rec.output_text
    steps = [ev for ev in evs if ev.token_ids]
    assert steps and all(len(ev.token_ids) == len(ev.logprobs) and ev.token_ids[0] == ev.logprobs[0][0] for ev in steps)
    # greedy: each sampled token is the engine's own top logprob (neutral sampling, no repeat penalty)
    assert all(lp[1] >= max(lp[2].values()) - 1e-6 for ev in steps for lp in ev.logprobs), [ev.logprobs for ev in steps]
    assert rec.accounting == "agree" and rec.output_tokens_source == "token-ids", rec.output_tokens_source


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_a_repeated_prompt_is_a_prefix_cache_hit_in_the_servers_own_words(server):
    """llama-server has no prefix-cache counters; each response's ``timings.cache_n`` says how many
    prompt tokens came from the slot's cache (evaluations/test_prefix_cache.py reads it as the proof)."""
    from bakeoff.loadgen.sweep import run_request

    b, _ = server
    prompt = " ".join(f"Item {i} of the cached list is the word number {i * 7}." for i in range(40))

    async def twice():
        try:
            return [await run_request(b, GenerationRequest(request_id=f"pc{i}", prompt=prompt, max_tokens=1,
                                                            temperature=0.0)) for i in range(2)]
        finally:
            await b.aclose()
    cold, warm = asyncio.run(twice())
    assert cold.status == warm.status == "ok" and cold.input_tokens == warm.input_tokens > 400, (cold, warm)
    assert cold.cached_prompt_tokens is not None and cold.cached_prompt_tokens < 0.1 * cold.input_tokens, cold
    assert warm.cached_prompt_tokens >= 0.9 * warm.input_tokens, warm


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_ignore_eos_runs_to_max_tokens_and_usage_agrees(server):
    b, _ = server
    _, rec = _stream(b, prompt="The capital of France is Paris.", ignore_eos=True, max_tokens=48, logprobs=1)
    assert rec.output_tokens == rec.usage_output_tokens == 48 and rec.accounting == "agree", rec


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_sanity_greedy_passes_the_neutral_server_and_fails_one_with_a_repeat_penalty(server):
    """The rule of ``sanity.greedy`` on the real server's own logprobs: neutral sampling (bakeoff's
    defaults) chooses the top token at every step; the same server asked for llama-cpp-python's
    default ``repeat_penalty`` (a broken configuration made on purpose, issue 37) does not."""
    from types import SimpleNamespace

    from bakeoff.analysis.sanity import greedy_violated, non_greedy_steps
    from evaluations.probing import run_probes

    b, _ = server
    texts = ["Once upon a time, in a small village by the sea,", "The three most important things to know about",
             "Here is a short summary of the history of the bicycle:", "def fibonacci(n):",
             "List the days of the week: Monday, Tuesday,", "The recipe for pancakes is as follows."]
    probes = [SimpleNamespace(id=f"p{i}", task="open", prompt=t, expected="", match="prefix", max_tokens=32)
              for i, t in enumerate(texts)]
    neutral = non_greedy_steps(run_probes(b, probes, max_tokens=32, logprobs=5))
    assert neutral["verified"] >= 150 and neutral["non_greedy"] == 0 and not greedy_violated(neutral), neutral
    original = b.extra_body
    try:
        b.extra_body = lambda: {**original(), "repeat_penalty": 1.5, "repeat_last_n": 64}
        b.make_client(b.served_model())
        penalized = non_greedy_steps(run_probes(b, probes, max_tokens=32, logprobs=5))
    finally:
        b.extra_body = original
        b.make_client(b.served_model())
    assert greedy_violated(penalized) and penalized["examples"][0]["chosen_logprob"] < penalized["examples"][0]["top_logprob"], penalized


def test_greedy_rule_counts_only_steps_with_alternatives_and_tolerates_rounding():
    from bakeoff.analysis.sanity import greedy_violated, non_greedy_steps

    ok = {"status": "ok", "id": "a", "logprobs": [[5, -0.1, [[5, -0.1], [6, -2.0]]], [7, -0.693147, [[7, -0.693147], [8, -0.693152]]],
                                                  [9, -0.5, [[9, -0.5]]], None]}
    counts = non_greedy_steps([ok])
    assert counts == {"verified": 2, "non_greedy": 0, "examples": []} and not greedy_violated(counts)
    bad = {"status": "ok", "id": "b", "logprobs": [[6, -2.0, [[5, -0.1], [6, -2.0]]]] * 3}
    assert greedy_violated(non_greedy_steps([ok, bad]))
    assert not greedy_violated(non_greedy_steps([ok] * 200 + [bad]))  # 3 of 403 steps: within the 1% noise rule
    assert non_greedy_steps([{**bad, "status": "error"}])["verified"] == 0


def test_cached_prompt_tokens_from_openai_usage_or_llama_timings_never_from_junk():
    from bakeoff.loadgen.client import OpenAIClient
    from bakeoff.loadgen.stream_events import cached_prompt_tokens

    assert cached_prompt_tokens({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}}) == 8
    assert cached_prompt_tokens({"choices": [], "timings": {"cache_n": 511, "prompt_n": 2}}) == 511
    assert cached_prompt_tokens({"usage": {"prompt_tokens": 9}}) is None
    for junk in (True, -1, "8", 1.5, None):
        assert cached_prompt_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": junk}},
                                     "timings": {"cache_n": junk}}) is None, junk
    assert cached_prompt_tokens({"usage": [1], "timings": "x"}) is None
    # llama-server's last event: the finish, its timings and usage in one chunk
    client = OpenAIClient("http://127.0.0.1:1", "m")
    evs = list(client._parse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 600, "completion_tokens": 1},
                              "timings": {"cache_n": 599, "prompt_n": 1}}, None, 5))
    assert evs[-1].usage.cached_prompt_tokens == 599 and evs[-1].usage.prompt_tokens == 600


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_a_truncated_gguf_is_a_load_failure_in_llama_cpps_words(tmp_path):
    """A damaged GGUF (half the shipped file: a broken download) fails the start as ``load-failure``
    with llama.cpp's own words from its log; nothing is served."""
    from bakeoff.models import packaged

    model = str(packaged.build("smollm2-135m-instruct"))
    whole = find_gguf(model, None)
    cut = tmp_path / "half.gguf"
    with open(whole, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(whole.stat().st_size // 2))
    b = LlamaCppBackend(BackendConfig(backend="llamacpp", model=model, workdir=str(tmp_path / "w"),
                                      options={"gguf": str(cut), "parallel_slots": 1, "ctx_size": 1024}))
    try:
        with pytest.raises(EngineFailure) as e:
            b.start()
    finally:
        b.stop()
    assert e.value.failure_class == "load-failure", (e.value.failure_class, str(e.value))
    words = str(e.value) + json.dumps(getattr(e.value, "evidence", None) or {}, default=str)
    assert "gguf" in words.lower() and ("failed to load" in words or "data is not within the file bounds" in words), words[-2000:]
