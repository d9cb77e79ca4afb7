"""GGUF -> Hugging Face checkpoint, in a form every engine environment bakeoff pins can read.

transformers reads GGUF with the ``gguf`` package (``from_pretrained(folder, gguf_file=NAME)``
dequantizes it); the loaded model keeps a GGUF quantizer that refuses ``save_pretrained`` until it
is dropped (docs/field-notes.md "A real pretrained model from the registry"). What transformers 5
then writes is not read alike by every environment: its ``tokenizer_config.json`` names the class
``TokenizersBackend``, which transformers 4.57 (the optimum-onnx environment) does not know (it falls
back to a slow-tokenizer conversion and fails with ``'NoneType' object has no attribute
'endswith'``), and its ``config.json`` holds the RoPE base only as ``rope_parameters``, which
transformers 4 ignores (it would run RoPE at its default base 10,000 instead of the model's
100,000: a silently different model). So the writer adds the keys both generations read
(:func:`portable_config`, :func:`portable_tokenizer_config`) and checks, in this environment, that
the written checkpoint reloads to the same tokens, chat template, RoPE base and logits as the
model read from the GGUF, and that it answers a known question (:func:`verify`). The engine
environments' reading of it is checked by ``tests/test_packaged_models.py`` (each pinned
environment) and, for any checkpoint, at run time by the backends' checkpoint-reading step.

Imports torch, transformers and gguf inside functions only (bakeoff's ``reference`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata as md
import json
import os
from pathlib import Path
from typing import Callable

from bakeoff.api.errors import UserError

# Texts whose token ids must come out the same from the GGUF's tokenizer and the written one.
SAMPLE_TEXTS = ("Hello world! The capital of France is Paris.", " 12 + 34 = 46, count: 7 8 9",
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "naïve café — 東京 🙂", "\tdef f(x):\n    return x\n")
KNOWN_QUESTION = ("What is the capital of France?", "Paris")
MAX_LOGIT_DIFF = 1e-3  # the same weights reloaded in the same dtype: equal up to kernel order


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("transformers", "gguf", "torch", "tokenizers", "safetensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def portable_config(cfg: dict, dtype: str) -> dict:
    """``config.json`` with the keys transformers 4 reads beside transformers 5's: ``torch_dtype``
    beside ``dtype``, and ``rope_theta`` (plus ``rope_scaling`` for a non-default RoPE) beside
    ``rope_parameters``."""
    out = dict(cfg)
    out["torch_dtype"] = out["dtype"] = dtype
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def portable_tokenizer_config(tok_cfg: dict, gguf_meta: dict, template: str | None, max_len: int | None) -> dict:
    """``tokenizer_config.json`` that transformers 4 and 5 read to the same tokenizer: a class both
    know for a byte-level BPE (``GPT2Tokenizer``, whose fast form reads ``tokenizer.json``), the
    GGUF's own BOS/EOS rules, the chat template inline as well as in ``chat_template.jinja``.

    Raises:
        UserError: a GGUF tokenizer model other than byte-level BPE (``gpt2``), which this writer
            has not been checked with.
    """
    model = gguf_meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UserError(f"GGUF tokenizer model {model!r}: bakeoff's converter writes byte-level BPE (gpt2) only")
    out = {k: v for k, v in tok_cfg.items() if k not in ("backend", "is_local", "local_files_only", "tokenizer_class")}
    out.update({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "clean_up_tokenization_spaces": False,
                "add_bos_token": bool(gguf_meta.get("tokenizer.ggml.add_bos_token", False)),
                "add_eos_token": bool(gguf_meta.get("tokenizer.ggml.add_eos_token", False))})
    if max_len:
        out["model_max_length"] = max_len
    if template:
        out["chat_template"] = template
    return out


def gguf_metadata(path: Path) -> dict:
    """The GGUF's scalar key-value metadata (token tables left out)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not needed here
            continue
    return out


@contextlib.contextmanager
def _name_map_built_once():
    """While it lasts, ``gguf.get_tensor_name_map(arch, n_blocks)`` builds each map once.

    transformers 5.19's GGUF loader (``modeling_gguf_pytorch_utils``) asks for the map once per
    submodule of the model, and gguf builds a fresh ``TensorNameMap`` each time: 397 of them, 5.6 s of
    SmolLM2-135M's 12 s load on 2 cores (2026-12-05). The loader only reads the map (``get_name``)."""
    import gguf as _gguf

    original = _gguf.get_tensor_name_map
    _gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        _gguf.get_tensor_name_map = original


def gguf_to_hf(gguf: Path, out: Path, dtype: str, log: Callable[[str], None] = print) -> dict:
    """Writes the Hugging Face checkpoint of ``gguf`` into ``out`` and verifies it.

    Args:
        gguf: the GGUF file.
        out: the checkpoint folder to write (created).
        dtype: ``bfloat16`` / ``float16`` / ``float32``.
        log: progress sink.

    Returns:
        The converter's record: package versions, dtype, the verification's figures.

    Raises:
        UserError: torch, transformers or gguf missing (install ``bakeoff[reference]``); the
            written checkpoint fails :func:`verify`.
    """
    try:
        import torch
        import transformers  # noqa: F401  (the message below names what is missing)
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise UserError(f"converting a GGUF needs torch, transformers and gguf ({exc}); "
                        "install bakeoff with its reference extra: pip install 'bakeoff[reference]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    meta = gguf_metadata(gguf)
    torch_dtype = getattr(torch, dtype)
    quiet, os.environ["TQDM_DISABLE"] = os.environ.get("TQDM_DISABLE"), "1"  # the GGUF reader's own tqdm bar
    try:
        with _name_map_built_once():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    finally:
        if quiet is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with QuantizationMethod.GGUF"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    cfg = portable_config(json.loads((out / "config.json").read_text()), dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    jinja = out / "chat_template.jinja"
    if template and not jinja.is_file():
        jinja.write_text(template)
    tcfg = portable_tokenizer_config(json.loads((out / "tokenizer_config.json").read_text()), meta, template,
                                     cfg.get("max_position_embeddings"))
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    special = {k: tcfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(tcfg.get(k), str)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    log(f"{gguf.name}: written; checking that it reloads to the same model")
    checked = verify(out, model, tok, cfg, template)
    return {"versions": _versions(), "dtype": dtype, "gguf_metadata": {k: meta[k] for k in (
        "general.name", "general.architecture", "general.file_type", "general.license", "tokenizer.ggml.pre") if k in meta},
        "verified": checked}


def verify(folder: Path, model, tok, cfg: dict, template: str | None) -> dict:
    """Checks the written checkpoint against the model and tokenizer read from the GGUF: the same
    token ids for :data:`SAMPLE_TEXTS`, the same chat template, the RoPE base in both config
    forms, logits within :data:`MAX_LOGIT_DIFF`, and a greedy answer containing the known fact.

    Returns:
        What was checked, with the figures.

    Raises:
        UserError: naming the first difference.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(str(folder))
    for text in SAMPLE_TEXTS:
        a, b = tok(text)["input_ids"], tok2(text)["input_ids"]
        if a != b:
            raise UserError(f"converted tokenizer differs from the GGUF's on {text!r}: {b[:12]} vs {a[:12]}")
    if template and tok2.chat_template != template:
        raise UserError("converted tokenizer lost the GGUF's chat template")
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if rope is not None and cfg.get("rope_theta") != rope:
        raise UserError(f"config.json's rope_theta {cfg.get('rope_theta')} is not the model's {rope}")
    model2 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=model.dtype)
    ids = torch.tensor([tok(SAMPLE_TEXTS[0])["input_ids"]])
    with torch.inference_mode():
        diff = float((model(ids).logits.float() - model2(ids).logits.float()).abs().max())
    if diff > MAX_LOGIT_DIFF:
        raise UserError(f"converted checkpoint's logits differ from the GGUF model's by {diff:.3g} (> {MAX_LOGIT_DIFF})")
    question, fact = KNOWN_QUESTION
    answer = ""
    if template:
        prompt = tok2.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        enc = tok2(prompt, return_tensors="pt")
        with torch.inference_mode():
            gen = model2.generate(**enc, max_new_tokens=16, do_sample=False)
        answer = tok2.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        if fact not in answer:
            raise UserError(f"converted checkpoint answers {question!r} with {answer!r}, not {fact!r}")
    return {"sample_texts": len(SAMPLE_TEXTS), "max_logit_diff": diff, "rope_theta": rope,
            "known_question": question, "answer": answer.strip()}
