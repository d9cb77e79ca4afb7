"""llama.cpp's converter (:mod:`adapters.gguf_convert`), for real, through the llamacpp backend.

The real model's checkpoint (the one bakeoff writes from the shipped GGUF) converts to ``q8_0``
and the server answers from it; the fixture's own tokenizer is refused by the converter (its
pre-tokenizer table is keyed by a hash of known tokenizers' output), and that refusal is the start
failure, in the converter's words. The first run creates the ``gguf-convert`` environment.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.gguf_convert import GgufOptions, convert
from backends.llamacpp.backend import LlamaCppBackend
from bakeoff.api.errors import EngineFailure
from bakeoff.api.specs import BackendConfig, GenerationRequest
from bakeoff.loadgen.sweep import run_request


def _backend(model: str, workdir: Path, **options) -> LlamaCppBackend:
    return LlamaCppBackend(BackendConfig(backend="llamacpp", model=model, workdir=str(workdir),
                                         options={"parallel_slots": 2, "ctx_size": 2048, **options}))


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_the_real_checkpoint_converts_to_q8_0_and_serves_its_answer(tmp_path):
    from bakeoff.models import packaged

    model = str(packaged.build("smollm2-135m-instruct"))
    b = _backend(model, tmp_path / "w", convert_outtype="q8_0")
    try:
        info = b.start()

        async def ask():
            try:
                return await run_request(b, GenerationRequest(
                    request_id="paris", max_tokens=12, temperature=0.0,
                    prompt="<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"))
            finally:
                await b.aclose()
        rec = asyncio.run(ask())
    finally:
        b.stop()
    notes = info.notes
    assert notes["gguf_outtype"] == "q8_0" and "convert_hf_to_gguf" in notes["gguf_convert_command"], notes
    assert "convert-hf-to-gguf==" in notes["gguf_convert_versions"] and b.converted.gguf_sha256[:16] in notes["gguf"]
    assert rec.status == "ok" and "Paris" in rec.output_text, (rec.error, rec.output_text)
    again = convert(model, GgufOptions(outtype="q8_0"), log=lambda s: None)
    assert again.cached and again.gguf_sha256 == b.converted.gguf_sha256  # the cache serves the second start


@pytest.mark.slow
@pytest.mark.engine("llamacpp")
def test_the_fixtures_tokenizer_is_refused_in_the_converters_words(tmp_path):
    from bakeoff.models.resolve import resolve

    model = resolve("fixture:tiny-qwen3", log=lambda s: None).path
    b = _backend(str(model), tmp_path / "w")  # no GGUF in the folder: the checkpoint is converted
    try:
        with pytest.raises(EngineFailure) as e:
            b.start()
    finally:
        b.stop()
    assert e.value.failure_class == "unsupported-architecture", (e.value.failure_class, e.value.message)
    assert "BPE pre-tokenizer was not recognized" in e.value.message, e.value.message
    assert "convert_hf_to_gguf" in e.value.evidence["command.txt"] and e.value.evidence["convert.log.tail"]
