"""GGUF conversion: llama.cpp's own converter (``convert_hf_to_gguf``) on a Hugging Face
checkpoint, for the llamacpp backend; cached by source hash, options and pins.

Names load lazily, as the other adapters' do.
"""

import importlib

_WHERE = {"env_spec": "env", "convert": "build", "GgufOptions": "specs", "GgufResult": "specs"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"adapters.gguf_convert.{_WHERE[name]}"), name)
