"""What one Python environment's transformers reads from a checkpoint's config and tokenizer files.

Run inside an engine's environment (``python -m backends._hosting.read_checkpoint MODEL``) and in
bakeoff's own (the reference's); :mod:`backends._checkpoint_read` compares the two. Prints one
JSON object: the transformers version, the config's facts that change the model silently when
misread (the RoPE base the modeling code will use, vocabulary and layer sizes, EOS), the
tokenizer's class, EOS and the token ids of :data:`SAMPLE_TEXTS`; a file that cannot be read is an
``error`` with the exception's type and message, never a crash.

Imports transformers inside :func:`read` only (this module is imported by the parent too).
"""

from __future__ import annotations

import json
import sys

SAMPLE_TEXTS = ("Hello world! The capital of France is Paris.", " 12 + 34 = 46, count: 7 8 9",
                "naïve café — 東京 🙂", "\tdef f(x):\n    return x\n")
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def rope_base(config) -> float | None:
    """The RoPE base the modeling code of this transformers uses: the ``rope_theta`` attribute
    where the config class has one (transformers 4), else ``rope_parameters["rope_theta"]`` (5)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict):
            theta = params.get("rope_theta")
    return float(theta) if isinstance(theta, (int, float)) else None


def read(model: str) -> dict:
    """Returns what this environment's transformers reads from ``model`` (see module docstring)."""
    out: dict = {"python": sys.version.split()[0]}
    try:
        import transformers
        from transformers import AutoConfig, AutoTokenizer
    except Exception as exc:  # noqa: BLE001 - an environment without transformers reads nothing
        out["error"] = _error(exc)
        return out
    out["transformers"] = transformers.__version__
    try:
        cfg = AutoConfig.from_pretrained(model)
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        facts = {k: getattr(text, k, None) for k in CONFIG_KEYS}
        facts["rope_theta"] = rope_base(text)
        facts["eos_token_id"] = getattr(text, "eos_token_id", None)
        out["config"] = facts
    except Exception as exc:  # noqa: BLE001
        out["config_error"] = _error(exc)
    try:
        tok = AutoTokenizer.from_pretrained(model)
        out["tokenizer"] = {"class": type(tok).__name__, "eos_token_id": tok.eos_token_id,
                            "chat_template": bool(getattr(tok, "chat_template", None)),
                            "ids": [list(tok(t, add_special_tokens=True)["input_ids"]) for t in SAMPLE_TEXTS]}
    except Exception as exc:  # noqa: BLE001
        out["tokenizer_error"] = _error(exc)
    return out


if __name__ == "__main__":
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(json.dumps(read(sys.argv[1])))
