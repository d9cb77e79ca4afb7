"""How the ORT GenAI engine process tokenizes and detokenizes: whether ``og.Tokenizer`` can be
trusted (it must encode like the checkpoint's ``tokenizer.json``), and whether the worker process
may detokenize for it. Runs inside the ort-genai environment (imports ``tokenizers`` lazily)."""

from __future__ import annotations

import os

from backends.ort_genai.frames import Decoder

PROBE_TEXTS = ("count: 15 16 17 18", "copy: hgd hcd =>", "Hello, world! 123", "a=1; b=2\nc")


def tokenizer_disagreement(tokenizer, hf_path: str) -> str | None:
    """Why og.Tokenizer cannot be trusted, or None: it must encode like the checkpoint's tokenizer.json.

    Seen on 0.18.0: a character-level BPE ``tokenizer.json`` without pre-tokenizer encodes
    " " to id -1 in og.Tokenizer while ``tokenizers`` gives its vocabulary id.
    """
    if not os.path.isfile(hf_path):
        return None
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(hf_path)
    for text in PROBE_TEXTS:
        a = [int(t) for t in tokenizer.encode(text)]
        b = list(hf.encode(text).ids)
        if a != b:
            return f"og.Tokenizer encodes {text!r} as {a[:16]} but tokenizer.json as {b[:16]}"
    return None


def worker_detokenizer(engine, model_dir: str, src: str) -> str | None:
    """The ``tokenizer.json`` the worker process may detokenize with, or None (this process does).

    Detokenizing is Python work per token; done between two og steps it runs on cold
    caches and cost the decode thread several us per token, so the worker process does
    it (as vLLM's frontend does for its engine core) with ``tokenizers.DecodeStream``,
    when that gives the same text as this process's decoder on the probe texts (each
    followed by an EOS id).
    """
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    for path in (os.path.join(model_dir, "tokenizer.json"), os.path.join(src, "tokenizer.json")):
        if not os.path.isfile(path):
            continue
        hf = Tokenizer.from_file(path)
        for text in PROBE_TEXTS:
            ids = engine.encode(text) + sorted(engine.eos_ids)[:1]
            dec, ds = Decoder(engine), DecodeStream(skip_special_tokens=True)
            mine = "".join(dec.push(t) for t in ids)
            theirs = "".join(ds.step(hf, t) or "" for t in ids)
            if mine != theirs:
                engine.notes["detokenizer"] = (f"the engine process detokenizes: tokenizers.DecodeStream on {path} "
                                             f"gives {theirs!r} where {engine.tokenizer_source} gives {mine!r}")
                return None
        return path
    return None
