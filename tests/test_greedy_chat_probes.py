"""Greedy means greedy, chat probes rendered once, ties from text logprobs (issue 37), against a FAKE
of llama-cpp-python's server (tests/fakes/llamacpp_python_server.py) and on the real tokenizers."""

from __future__ import annotations

import pytest

from backends.openai.backend import OpenAIBackend, greedy_fields
from bakeoff.analysis.generic_probes import generic_probes, render_chat
from bakeoff.analysis.sanity import compare_tie_aware, greedy_violated, non_greedy_steps
from bakeoff.api.errors import UserError
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.loadgen.client import NEUTRAL_ANY, NEUTRAL_LLAMACPP, NEUTRAL_VLLM, OpenAIClient
from bakeoff.models.resolve import Probe
from evaluations.probing import run_probes
from evaluations.reference import ProbeSet, for_api
from tests.fakes.llamacpp_python_server import FakeLlamaCppPython, render

RAW = [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."},
       {"role": "user", "content": "Capital of France?"}]
CHAT_PROBE = Probe(id="g-chat-capital-00", task="chat-capital", prompt=render(RAW), expected="Paris", match="contains",
                   max_tokens=4, messages=RAW)


def attach(tmp_path, url: str, **options) -> OpenAIBackend:
    backend = OpenAIBackend(BackendConfig(backend="openai", model="remote", workdir=str(tmp_path),
                                          options={"base_url": url, **options}, start_timeout_s=10))
    backend.start()
    return backend


def test_a_chat_api_is_sent_the_raw_messages_and_a_greedy_request_neutral_penalties(tmp_path):
    """The probe's raw messages go to a chat API (its server renders them once) with the penalties of
    every dialect neutral (the server's owner, ``me``, names none bakeoff knows): the FAKE answers
    Paris, its own top token."""
    with FakeLlamaCppPython() as srv:
        out = run_probes(attach(tmp_path, srv.url, api="chat"), [CHAT_PROBE], logprobs=5)
        body = srv.bodies[-1]
    assert body["messages"] == RAW and body["repeat_penalty"] == 1.0 and body["repetition_penalty"] == 1.0
    assert out[0]["status"] == "ok" and out[0]["text"] == " Paris", out[0]
    assert non_greedy_steps(out)["non_greedy"] == 0


def test_a_completions_api_is_sent_the_rendered_prompt(tmp_path):
    with FakeLlamaCppPython() as srv:
        out = run_probes(attach(tmp_path, srv.url), [CHAT_PROBE], logprobs=5)
        body = srv.bodies[-1]
    assert body["prompt"] == CHAT_PROBE.prompt and "messages" not in body and out[0]["text"] == " Paris"


def test_the_doubles_fail_as_the_issue_says(tmp_path):
    """The FAKE's two faults, reproduced the old way: text already rendered sent as a chat message (the
    template twice: a wrong answer), and a greedy request without neutral penalties (its default
    repeat_penalty: a chosen token below its own top logprob, which sanity.greedy names)."""
    rendered_only = Probe(**{**CHAT_PROBE.__dict__, "messages": None})
    with FakeLlamaCppPython() as srv:
        twice = run_probes(attach(tmp_path, srv.url, api="chat"), [rendered_only], logprobs=5)
        assert srv.bodies[-1]["messages"][0]["content"] == CHAT_PROBE.prompt
        penalised = run_probes(attach(tmp_path, srv.url, api="chat", greedy_body={}), [CHAT_PROBE] * 3, logprobs=5)
        assert "repeat_penalty" not in srv.bodies[-1]
    assert twice[0]["text"] == " Lyon"
    counts = non_greedy_steps(penalised)
    assert counts == {**counts, "verified": 3, "non_greedy": 3} and greedy_violated(counts)
    assert counts["examples"][0]["chosen"] == " Lyon" and counts["examples"][0]["top"] == " Paris"


def test_a_chat_api_leaves_completion_probes_out_of_both_sides_saying_so():
    completion = Probe(id="g-copy-00", task="copy", prompt="Repeat: a b c\n", expected="a b c", max_tokens=4)
    ps = ProbeSet([completion, CHAT_PROBE], [completion, CHAT_PROBE], "generic", {})
    assert for_api(ps, "completions") is ps
    chat = for_api(ps, "chat")
    assert [p.id for p in chat.backend] == [p.id for p in chat.reference] == [CHAT_PROBE.id]
    assert chat.rendering["left_out_for_api"].startswith("1 of 2 probes left out: the engine is sent api=chat")
    assert for_api(ProbeSet([completion], [completion], "model", {}), "messages").backend == []


def test_generic_chat_probes_carry_their_raw_messages_rendered_as_their_prompt():
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    probes = generic_probes(chat_template=template)
    chat = [p for p in probes if p["id"].startswith("g-chat-")]
    assert chat and all(render_chat(template, p["messages"], {}) == p["prompt"] for p in chat)
    assert all("messages" not in p for p in probes if not p["id"].startswith("g-chat-"))


def test_greedy_fields_follow_the_servers_dialect_and_reach_only_greedy_requests():
    assert greedy_fields("vllm")[0] == NEUTRAL_VLLM and greedy_fields("llamacpp")[0] == NEUTRAL_LLAMACPP
    assert greedy_fields("me")[0] == NEUTRAL_ANY and "names none bakeoff knows" in greedy_fields("me")[1]
    client = OpenAIClient("http://127.0.0.1:9", "m", greedy_body=NEUTRAL_VLLM, extra_body={"repetition_penalty": 1.05})
    greedy = client.body(GenerationRequest(request_id="a", prompt="p", max_tokens=2, temperature=0.0))
    sampled = client.body(GenerationRequest(request_id="b", prompt="p", max_tokens=2, temperature=0.7))
    assert greedy["frequency_penalty"] == 0.0 and greedy["repetition_penalty"] == 1.05  # the user's extra_body wins
    assert "frequency_penalty" not in sampled


def test_greedy_body_may_not_set_a_request_field(tmp_path):
    with pytest.raises(UserError, match="greedy_body may not set max_tokens"):
        OpenAIBackend(BackendConfig(backend="openai", model="remote", workdir=str(tmp_path),
                                    options={"base_url": "http://127.0.0.1:9", "greedy_body": {"max_tokens": 1}}))


def test_text_logprobs_map_to_the_reference_tokenizers_ids_so_the_tie_rule_runs():
    """An engine that streams token texts (llama-cpp-python): each text is the one id that decodes to it,
    the output is mapped only when the ids decode to its text, and the tie rule then judges it."""
    from bakeoff.models import fixtures
    from evaluations.tokenizing import map_text_logprobs, reference_tokenizer

    tok, _ = reference_tokenizer(str(fixtures.build("tiny-qwen3")))
    ids = tok("The capital of France is Paris", add_special_tokens=False)["input_ids"]
    alt = tok(" London", add_special_tokens=False)["input_ids"][0]
    texts = [tok.decode([i]) for i in ids]
    lps = [[t, -0.1, [[t, -0.1], [tok.decode([alt]), -0.3]]] for t in texts]
    out = {"id": "p", "text": "".join(texts), "token_ids": None, "logprobs": lps}
    broken = {"id": "q", "text": "not what the tokens say", "token_ids": None, "logprobs": [list(e) for e in lps]}
    summary = map_text_logprobs([out, broken], tok)
    assert summary["mapped"] == 1 and summary["unmapped"] == [{"id": "q", "why": "the mapped ids do not decode to the streamed text"}]
    assert out["token_ids"] == ids and out["logprobs"][0][2] == [[ids[0], -0.1], [alt, -0.3]]
    ref_ids = ids[:-1] + [alt]
    ref = {"id": "p", "text": "", "token_ids": ref_ids,
           "logprobs": [[i, -0.1, [[i, -0.1], [ids[-1], -0.3]]] for i in ref_ids]}
    assert compare_tie_aware(out, ref)["outcome"] == "tie"
    assert broken["token_ids"] is None  # left as streamed: undetermined, never guessed
    as_dict = {"id": "d", "text": texts[0], "token_ids": None, "logprobs": [[texts[0], -0.1, {texts[0]: -0.1, 7: -0.2}]]}
    odd = {"id": "e", "text": "x", "token_ids": None, "logprobs": [[], None]}
    assert map_text_logprobs([as_dict, odd], tok)["mapped"] == 1 and odd["token_ids"] is None
    assert as_dict["logprobs"] == [[ids[0], -0.1, [[ids[0], -0.1]]]]  # a dict of tops read as such; a non-text key dropped


def test_probe_streams_a_server_cut_under_concurrency_are_sent_again_alone(tmp_path):
    """llama-cpp-python's interrupt_requests (the FAKE's ``interrupt``): concurrent probe streams end with
    [DONE] and no finish_reason; each is sent again alone and answered, the cut kept as evidence. A lone
    request is never cut, so the answers are the engine's."""
    probes = [Probe(**{**CHAT_PROBE.__dict__, "id": f"g-chat-capital-{i:02d}"}) for i in range(4)]
    with FakeLlamaCppPython(interrupt=True) as srv:
        out = run_probes(attach(tmp_path, srv.url), probes, logprobs=5, concurrency=4)
    assert all(o["status"] == "ok" and o["text"] == " Paris" and o["finish_reason"] == "stop" for o in out), out
    cut = [o for o in out if o.get("cut_under_concurrency")]
    assert cut and all(o["cut_under_concurrency"].startswith("the stream ended without a finish_reason") for o in cut)
