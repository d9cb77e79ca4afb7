"""Fixture builder: real builds (shared cache), real loads, real greedy decoding.

``tiny-qwen3`` and its untrained twin ship trained (tests/test_fixtures_shipped.py): the first
run copies them into the cache under ``$BAKEOFF_CACHE`` (or ``~/.cache/bakeoff``) after checking
their hashes; the MoE fixtures (opt-in) are trained here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bakeoff.models import fixtures
from bakeoff.api.errors import UserError
from bakeoff.analysis.sanity import probe_correct


@pytest.fixture(scope="module")
def trained():
    return fixtures.build("tiny-qwen3")


@pytest.fixture(scope="module")
def untrained():
    return fixtures.build("tiny-qwen3-untrained")


def _greedy_accuracy(folder) -> float:
    """Greedy-decodes every probe with transformers; returns the fraction whose output starts
    with the expected continuation (the rule of the evaluations' known-answer check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16
    probes = [json.loads(line) for line in (folder / "probes.jsonl").read_text().splitlines()]
    good = 0
    with torch.no_grad():
        for p in probes:
            ids = tok(p["prompt"], return_tensors="pt")
            n = len(tok(p["expected"])["input_ids"]) + 2
            out = model.generate(**ids, max_new_tokens=n, do_sample=False)
            text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            good += probe_correct(text, p["expected"])
    return good / len(probes)


def test_import_is_light():
    code = "import sys, bakeoff.models.fixtures; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_names_and_hash():
    names = fixtures.names()
    assert {"tiny-qwen3", "tiny-qwen3-untrained"} <= set(names)
    h = fixtures.recipe_hash("tiny-qwen3")
    assert h == fixtures.recipe_hash("tiny-qwen3") and len(h) == 64
    assert h != fixtures.recipe_hash("tiny-qwen3-untrained")


def test_unknown_name_lists_valid_names():
    with pytest.raises(UserError) as e:
        fixtures.build("no-such-fixture")
    msg = str(e.value)
    assert "\n" not in msg and "no-such-fixture" in msg
    assert all(n in msg for n in fixtures.names())
    with pytest.raises(UserError):
        fixtures.is_built("no-such-fixture")


def test_folder_has_every_file(trained):
    for f in fixtures.REQUIRED_FILES:
        assert (trained / f).is_file(), f
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["max_position_embeddings"] == 512
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        assert isinstance(cfg[key], int)
    tcfg = json.loads((trained / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] and tcfg["pad_token"] and tcfg["bos_token"] and tcfg["chat_template"]
    meta = json.loads((trained / "fixture.json").read_text())
    assert meta["name"] == "tiny-qwen3" and meta["recipe_hash"] == fixtures.recipe_hash("tiny-qwen3")
    assert meta["steps"] > 0 and set(meta["versions"]) == {"torch", "transformers", "tokenizers"}
    assert len(meta["weights_sha256"]) == 64
    probes = [json.loads(line) for line in (trained / "probes.jsonl").read_text().splitlines()]
    assert len(probes) >= 240
    assert {p["task"] for p in probes} == set(meta["recipe"]["corpus"]["tasks"])
    assert all(sum(p["task"] == t for p in probes) >= 60 for t in meta["recipe"]["corpus"]["tasks"])
    assert all(set(p) == {"id", "task", "prompt", "expected"} for p in probes)
    res = meta["probe_results"]
    assert set(res["per_probe"]) == {p["id"] for p in probes}  # the record backends are paired with


def test_fixture_knows_its_answers(trained):
    """The builder's own measurement on these weights (the host that trained them): every family
    at the recipe's floor, answer margins wide enough that bf16 vs fp32 flips at most a probe or
    two, needles found."""
    meta = json.loads((trained / "fixture.json").read_text())
    res, floor = meta["probe_results"], meta["known_answers_floor"]
    assert floor >= 0.95
    assert all(t["prefix_accuracy"] >= floor for t in res["per_task"].values()), res["per_task"]
    assert res["margins"]["n"] > len(res["per_probe"]) and res["margins"]["median"] > 3.0, res["margins"]
    assert res["fp32_flips"]["changed"] <= 2, res["fp32_flips"]
    assert res["needles"]["context_tokens"] == 512 and res["needles"]["accuracy"] >= 0.8, res["needles"]
    assert meta["build_seconds"] > 0


def test_tokenizer_round_trip(trained):
    from transformers import AutoTokenizer

    _assert_loader_tokenizes_as_trained(trained)
    tok = AutoTokenizer.from_pretrained(trained)
    for text in ["count: 33 34 35", " 37 38 39", "copy: hgd hcd hjc =>", "keys: aF qC ; q", "  two  spaces ", "héllo ☃"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("count: 33")["input_ids"][0] != tok.bos_token_id  # no BOS added on encode
    eos = tok.eos_token_id
    assert tok.decode([eos], skip_special_tokens=True) == ""
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_trained_beats_untrained(trained, untrained):
    """Re-measured here, outside the builder: the trained fixture within 3 points of what its
    builder recorded (same rule; this host may be the other CPU kind), the untrained twin near zero."""
    recorded = json.loads((trained / "fixture.json").read_text())["probe_results"]["prefix_accuracy"]
    assert _greedy_accuracy(trained) >= recorded - 0.03
    assert _greedy_accuracy(untrained) < 0.2
    twin = json.loads((untrained / "fixture.json").read_text())
    assert twin["recipe"]["twin_of"] == "tiny-qwen3" and twin["known_answers_floor"] >= 0.95


def test_untrained_twin_shares_tokenizer_and_probes(trained, untrained):
    for f in ("tokenizer.json", "probes.jsonl", "tokenizer_config.json"):
        assert (trained / f).read_bytes() == (untrained / f).read_bytes(), f
    assert json.loads((untrained / "fixture.json").read_text())["steps"] == 0


def test_cache_reuse(trained):
    assert fixtures.is_built("tiny-qwen3")
    stamp = (trained / "fixture.json").stat().st_mtime_ns
    lines: list[str] = []
    t0 = time.monotonic()
    again = fixtures.build("tiny-qwen3", log=lines.append)
    assert again == trained and time.monotonic() - t0 < 2.0
    assert lines == [] and (trained / "fixture.json").stat().st_mtime_ns == stamp


def test_concurrent_builds_share_one_result(tmp_path):
    code = (
        "import sys; from bakeoff.models.fixtures import build; "
        "print('PATH', build('tiny-qwen3-untrained', log=lambda m: print('LOG', m)))"
    )
    env = {**__import__("os").environ, "BAKEOFF_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {line for o in outs for line in o[0].splitlines() if line.startswith("PATH")}
    assert len(paths) == 1
    built = sum("building into" in o[0] or "copying the shipped weights" in o[0] for o in outs)
    assert built == 1, outs
    root = tmp_path / "fixtures"
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [
        fixtures.folder_for("tiny-qwen3-untrained").name]
    assert not list(root.glob(".tmp-*"))


def _assert_loader_tokenizes_as_trained(folder):
    """AutoTokenizer (which for some model types swaps in its own class and pipeline) must
    tokenize exactly as the trained ``tokenizer.json`` does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    probes = [json.loads(line) for line in (folder / "probes.jsonl").read_text().splitlines()]
    for text in [p["prompt"] for p in probes] + [p["expected"] for p in probes] + ["héllo ☃  x "]:
        assert auto(text)["input_ids"] == raw.encode(text).ids, (type(auto).__name__, text)


def _safetensor_keys(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


MOE_OPT_IN = pytest.mark.skipif(
    os.environ.get("BAKEOFF_MOE_FIXTURES") != "1",
    reason="builds the MoE fixtures (~15 min on 2 cores); set BAKEOFF_MOE_FIXTURES=1 to run")


@pytest.mark.slow
@MOE_OPT_IN
def test_qwen3_moe_fixture():
    folder = fixtures.build("tiny-qwen3-moe")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["num_experts"] == cfg["num_local_experts"] == 8  # both spellings (older loaders)
    keys = _safetensor_keys(folder)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys  # per-expert layout (vLLM, HF hub)
    _assert_loader_tokenizes_as_trained(folder)
    meta = json.loads((folder / "fixture.json").read_text())
    assert meta["steps"] > 0 and meta["probe_results"]["prefix_accuracy"] >= 0.9


@pytest.mark.slow
@MOE_OPT_IN
def test_qwen3_5_moe_two_layouts_same_weights():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    text = fixtures.build("tiny-qwen3.5-moe")
    cg = fixtures.build("tiny-qwen3.5-moe-cg")
    tcfg = json.loads((text / "config.json").read_text())
    ccfg = json.loads((cg / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert set(tcfg["layer_types"]) == {"linear_attention", "full_attention"}
    assert ccfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert ccfg["text_config"]["layer_types"] == tcfg["layer_types"]
    tkeys, ckeys = _safetensor_keys(text), _safetensor_keys(cg)
    assert all(k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.", "mtp."))
               for k in tkeys)
    assert any(k.startswith("model.language_model.layers.") for k in ckeys)
    # the MTP head stays at the top level in both layouts, as released (tests/test_fixtures_mtp.py)
    assert {k for k in tkeys if k.startswith("mtp.")} == {k for k in ckeys if k.startswith("mtp.")} != set()
    assert any(k.startswith("model.visual.") for k in ckeys)
    meta = json.loads((cg / "fixture.json").read_text())
    assert meta["layout"] == "conditional_generation"
    assert meta["sibling"]["name"] == "tiny-qwen3.5-moe"
    assert meta["sibling"]["recipe_hash"] == fixtures.recipe_hash("tiny-qwen3.5-moe")
    for f in ("tokenizer.json", "probes.jsonl"):
        assert (text / f).read_bytes() == (cg / f).read_bytes()
    _assert_loader_tokenizes_as_trained(text)
    _assert_loader_tokenizes_as_trained(cg)
    a = AutoModelForCausalLM.from_pretrained(text).eval()
    b = Qwen3_5MoeForConditionalGeneration.from_pretrained(cg).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
