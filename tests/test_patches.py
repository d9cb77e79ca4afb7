"""Checkpoint patches: applied to a copy, recorded, part of the cache key."""

from __future__ import annotations

import json
import os

import pytest

from adapters.checkpoint_patches import RECORD, apply_patches, parse_patch, parse_patches, patch_key
from bakeoff.api.errors import UserError

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "ignore": ["lm_head"]},
}


@pytest.fixture()
def ckpt(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (src / "model.safetensors").write_bytes(b"\0" * 4096)
    (src / "tokenizer.json").write_text("{}")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return src


def test_append_to_ignore_list_in_a_copy(ckpt, tmp_path):
    before = (ckpt / "config.json").read_text()
    pc = apply_patches(ckpt, ["quantization_config.ignore+=re:.*mtp.*"], cache_dir=tmp_path / "cache")

    # original untouched
    assert (ckpt / "config.json").read_text() == before
    # the copy has the patch, weights linked (same inode or a symlink), small files copied
    out = json.loads(open(os.path.join(pc.path, "config.json")).read())
    assert out["quantization_config"]["ignore"] == ["lm_head", "re:.*mtp.*"]
    w = os.path.join(pc.path, "model.safetensors")
    assert os.path.islink(w) or os.stat(w).st_ino == os.stat(ckpt / "model.safetensors").st_ino
    assert not os.path.islink(os.path.join(pc.path, "tokenizer.json"))
    # recorded with before/after, in the copy and as evidence
    assert pc.diff[0].before == ["lm_head"] and pc.diff[0].after == ["lm_head", "re:.*mtp.*"] and pc.diff[0].changed
    rec = json.loads(open(os.path.join(pc.path, RECORD)).read())
    assert rec["key"] == pc.key and rec["patches"][0]["op"] == "append"
    assert rec["source"] == str(ckpt.resolve())
    ev = json.loads(pc.evidence()["checkpoint-patches.json"])
    assert ev["diff"][0]["patch"] == "quantization_config.ignore+=re:.*mtp.*"
    # the key (and so the folder name) changes with the patches
    assert pc.key[:16] in os.path.basename(pc.path)
    assert patch_key(ckpt, parse_patches(["quantization_config.ignore+=re:.*eh_proj.*"])) != pc.key
    assert patch_key(ckpt, parse_patches(["quantization_config.ignore+=re:.*mtp.*"])) == pc.key
    # same patches again: the copy is reused
    again = apply_patches(ckpt, ["quantization_config.ignore+=re:.*mtp.*"], cache_dir=tmp_path / "cache")
    assert again.reused and again.path == pc.path and again.diff == pc.diff


def test_set_remove_and_other_files(ckpt, tmp_path):
    pc = apply_patches(ckpt, ["torch_dtype=float16", "del:quantization_config",
                              "generation_config.json:eos_token_id=[1,2]"], cache_dir=tmp_path / "c")
    cfg = json.loads(open(os.path.join(pc.path, "config.json")).read())
    assert cfg["torch_dtype"] == "float16" and "quantization_config" not in cfg
    gen = json.loads(open(os.path.join(pc.path, "generation_config.json")).read())
    assert gen["eos_token_id"] == [1, 2]
    assert [d.after for d in pc.diff] == ["float16", "<absent>", [1, 2]]
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == 1


def test_source_change_changes_key(ckpt):
    patches = parse_patches(["torch_dtype=float16"])
    k1 = patch_key(ckpt, patches)
    (ckpt / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 10}))
    assert patch_key(ckpt, patches) != k1


@pytest.mark.parametrize("bad", ["no_operator", "=3", "del:", "a..b=1", "a+=", "x y=1"])
def test_bad_syntax_is_one_line_user_error(bad):
    with pytest.raises(UserError) as ei:
        parse_patch(bad)
    msg = str(ei.value)
    assert "\n" not in msg and ("PATH=VALUE" in msg or "need a value" in msg)


def test_patch_that_does_not_fit_is_user_error(ckpt, tmp_path):
    with pytest.raises(UserError, match="not a list"):
        apply_patches(ckpt, ["torch_dtype+=x"], cache_dir=tmp_path / "c")
    with pytest.raises(UserError, match="no key"):
        apply_patches(ckpt, ["del:rope_scaling"], cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").glob("*")) if (tmp_path / "c").exists() else True


def test_syntax_round_trips():
    for text in ["quantization_config.ignore+=re:.*mtp.*", "torch_dtype=bfloat16", "del:quantization_config",
                 "a.b-=lm_head", "generation_config.json:eos_token_id=2", 'name="3"']:
        assert parse_patch(parse_patch(text).describe()) == parse_patch(text)
