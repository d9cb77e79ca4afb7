"""The token events of one streamed event's JSON, per API: an OpenAI completions or chat chunk, an
Anthropic Messages event (:class:`TokenEvent`: text, reasoning, token ids, logprobs, finish reason,
usage and the prompt tokens the server took from its prefix cache).

Cost: the streaming client (:meth:`bakeoff.loadgen.client.OpenAIClient.stream`) calls one of
:data:`TOKENS` for every event of hundreds of concurrent streams. The common OpenAI chunk (one
choice, no usage, no llama.cpp ``timings``) is read inline there, one call an event; any other goes
through :func:`openai_events` or :func:`parse_messages`.
"""

from __future__ import annotations

from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import TokenEvent, Usage
from bakeoff.loadgen.logprobs import ids_from_logprobs, parse_logprobs

STOP = object()  # what parse_messages gives for message_stop: the end of a Messages stream


def completion_tokens(obj: dict, name: str | None, t: int, resp):
    """The token events of one completions chunk (``resp`` unused: :data:`TOKENS`' signature)."""
    choices = obj.get("choices")
    if not (choices and len(choices) == 1 and not obj.get("usage") and "timings" not in obj):
        return openai_events(obj, t, False)
    # the common case, inline (chat_tokens reads its choice the same way)
    ch = choices[0]
    ids = ch.get("token_ids")
    fr = ch.get("finish_reason")
    lps = ch.get("logprobs")
    if lps:
        lps = parse_logprobs(lps)
        if ids is None:
            ids = ids_from_logprobs(lps)
    text = ch.get("text") or ""
    step = "text" in ch
    if text or ids or fr or lps or step:
        return (TokenEvent(t, text, ids, "text", fr, None, lps or None, step),)
    return ()


def chat_tokens(obj: dict, name: str | None, t: int, resp):
    """The token events of one chat chunk: its delta's reasoning (an event of its own, which carries the
    token ids), then its content (``resp`` unused: :data:`TOKENS`' signature)."""
    choices = obj.get("choices")
    if not (choices and len(choices) == 1 and not obj.get("usage") and "timings" not in obj):
        return openai_events(obj, t, True)
    # the common case, inline (completion_tokens reads its choice the same way)
    ch = choices[0]
    ids = ch.get("token_ids")
    fr = ch.get("finish_reason")
    lps = ch.get("logprobs")
    if lps:
        lps = parse_logprobs(lps)
        if ids is None:
            ids = ids_from_logprobs(lps)
    delta = ch.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    out: tuple = ()
    if reasoning:
        out = (TokenEvent(t, reasoning, ids, "reasoning"),)
        ids = None
    text = delta.get("content") or ""
    step = fr is not None or (not reasoning and delta.get("content") is not None and "role" not in delta)
    if text or ids or fr or lps or step:
        return out + (TokenEvent(t, text, ids, "text", fr, None, lps or None, step),)
    return out


def messages_tokens(obj: dict, name: str | None, t: int, resp):
    """The token events of one Messages event, :data:`STOP` at ``message_stop``; an OpenAI chunk there
    is a ``protocol-violation``, ``resp`` released (its connection closed) first."""
    if "choices" in obj and "type" not in obj:  # an OpenAI chunk on /v1/messages (client.PATHS["messages"])
        resp.release()
        raise EngineFailure("protocol-violation", "/v1/messages answered with OpenAI chat-completion "
                            "chunks (\"choices\"), not Messages events: the server speaks the OpenAI "
                            "API there; attach with api=chat or api=completions")
    return parse_messages(obj, name, t)


TOKENS = {"completions": completion_tokens, "chat": chat_tokens, "messages": messages_tokens}


def openai_events(obj: dict, t: int, chat: bool):
    """The token events of any completions or chat event: an error event raised as ``runtime-crash``,
    each choice's events, then the usage (with the cached prompt tokens) where the event tells."""
    if "error" in obj and not obj.get("choices"):
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
        raise EngineFailure("runtime-crash", f"server error event: {err.get('message')}")
    usage = obj.get("usage")
    for ch in obj.get("choices") or []:
        yield from choice_events(ch, chat, t)
    cached = cached_prompt_tokens(obj)
    if usage or cached is not None:
        usage = usage if isinstance(usage, dict) else {}
        yield TokenEvent(t_ns=t, usage=Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached))


def choice_events(ch: dict, chat: bool, t: int):
    """The token events of one choice of a completions or chat event: a chat delta's reasoning (its
    own event, which carries the ids), then its content or the completion's text, with token ids
    (from ``token_ids``, else from the logprobs' ``token_id:N`` names), logprobs and finish reason.
    ``step``: the event is one engine step (a text field, a content delta, or the end)."""
    ids = ch.get("token_ids")
    if chat:
        delta = ch.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            yield TokenEvent(t_ns=t, text=reasoning, kind="reasoning", token_ids=ids)
            ids = None
        text = delta.get("content") or ""
        step = ch.get("finish_reason") is not None or (not reasoning and delta.get("content") is not None
                                                       and "role" not in delta)
    else:
        text = ch.get("text") or ""
        step = "text" in ch
    lps = parse_logprobs(ch["logprobs"]) if ch.get("logprobs") else None
    ids = ids if ids is not None else ids_from_logprobs(lps)
    if text or ids or ch.get("finish_reason") or lps or step:
        yield TokenEvent(t_ns=t, text=text, token_ids=ids, finish_reason=ch.get("finish_reason"),
                         logprobs=lps or None, step=step)


def cached_prompt_tokens(obj: dict) -> int | None:
    """Prompt tokens an event says the server took from its prefix cache (:class:`Usage`), or None
    where it says nothing (or something that is not a count)."""
    details = (obj.get("usage") or {}).get("prompt_tokens_details") if isinstance(obj.get("usage"), dict) else None
    timings = obj.get("timings")
    for value in ((details or {}).get("cached_tokens") if isinstance(details, dict) else None,
                  timings.get("cache_n") if isinstance(timings, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def parse_messages(obj: dict, event_name: str | None, t: int):
    """The token events of one Anthropic Messages event (:data:`STOP` at ``message_stop``); an error
    event raised as ``runtime-crash``."""
    kind = obj.get("type") or event_name
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        if delta.get("type") == "thinking_delta":
            yield TokenEvent(t_ns=t, text=delta.get("thinking", ""), kind="reasoning")
        elif delta.get("type") == "text_delta":
            yield TokenEvent(t_ns=t, text=delta.get("text", ""))
    elif kind == "message_start":
        u = (obj.get("message") or {}).get("usage") or {}
        if u.get("input_tokens") is not None:
            yield TokenEvent(t_ns=t, usage=Usage(u.get("input_tokens"), None))
    elif kind == "message_delta":
        u = obj.get("usage") or {}
        fr = (obj.get("delta") or {}).get("stop_reason")
        yield TokenEvent(t_ns=t, finish_reason=fr, usage=Usage(u.get("input_tokens"), u.get("output_tokens")))
    elif kind == "message_stop":
        yield STOP
    elif kind == "error":
        err = obj.get("error") or {}
        raise EngineFailure("runtime-crash", f"server error event: {err.get('type')}: {err.get('message')}")
