"""Test doubles: copies of a real checkpoint broken on purpose (``tests/test_real_model_doubles.py``).

Each is a FAKE checkpoint, named as such in the ``bakeoff-double.json`` written beside its files,
made from a real one without touching it (every file it does not change is a symlink to the
source's):

- :func:`wrong_chat_template`: the chat template replaced by another model family's (Llama-2's
  ``[INST] ... [/INST]``, no system turn and no assistant header), in both places a checkpoint
  carries it (``tokenizer_config.json`` ``chat_template`` and ``chat_template.jinja``); weights
  and tokenizer are the source's.
- :func:`truncated_weights`: ``model.safetensors`` cut off at a fraction of its length (a copy
  or download interrupted), its header intact.
"""

from __future__ import annotations

import json
from pathlib import Path

# Llama-2's chat template (meta-llama/Llama-2-7b-chat-hf, system turn dropped): ChatML models such
# as SmolLM2 are trained on ``<|im_start|>user ... <|im_end|><|im_start|>assistant``, not on this.
LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                   "{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}"
                   "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
                   "{% endif %}{% endfor %}")


def _linked_copy(src: Path, dst: Path, own: tuple[str, ...], why: str) -> Path:
    """``dst`` holding a symlink to each file of ``src`` except ``own`` (the double writes those)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in own:
            (dst / f.name).symlink_to(f.resolve())
    (dst / "bakeoff-double.json").write_text(json.dumps({"double": "FAKE checkpoint made broken on purpose (tests)",
                                                         "source": str(src), "why": why}, indent=2))
    return dst


def wrong_chat_template(src: Path, dst: Path, template: str = LLAMA2_TEMPLATE) -> Path:
    """A copy of ``src`` whose chat template is ``template`` (default: Llama-2's).

    Args:
        src: a checkpoint folder with a chat template (``tokenizer_config.json``).
        dst: the new folder (must not exist).
        template: the wrong template.

    Returns:
        ``dst``.
    """
    files = ("tokenizer_config.json", "chat_template.jinja")
    _linked_copy(src, dst, files, "the chat template of another model family (Llama-2's [INST])")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "chat_template.jinja").is_file():
        (dst / "chat_template.jinja").write_text(template)
    return dst


def truncated_weights(src: Path, dst: Path, keep: float = 0.6) -> tuple[Path, int, int]:
    """A copy of ``src`` whose ``model.safetensors`` holds only the first ``keep`` of its bytes.

    Returns:
        ``(dst, bytes of the whole file, bytes kept)``.
    """
    _linked_copy(src, dst, ("model.safetensors",), f"model.safetensors cut off at {keep:.0%} of its bytes")
    whole = (src / "model.safetensors").stat().st_size
    kept = int(whole * keep)
    with open(src / "model.safetensors", "rb") as fin, open(dst / "model.safetensors", "wb") as fout:
        fout.write(fin.read(kept))
    return dst, whole, kept

