"""Unit tests of the core contracts: verdict rules, artifacts, redaction, options, sanity."""

from __future__ import annotations

import json
import os

import pytest

import backends
from backends._server import last_error_line, parse_prometheus
from bakeoff.host.artifacts import RunDir, atomic_write_json, list_runs
from bakeoff.api.errors import EngineFailure, UserError
from bakeoff.api.options import parse_kv, parse_options
from bakeoff.host.redact import MASK, redact
from bakeoff.host.run import CheckFailed, RunContext
from bakeoff.analysis.sanity import agreement, detectors, probe_correct
from bakeoff.api.verdict import Check, Verdict, decide


def _check(name, status, fc=None):
    return Check(name=name, status=status, failure_class=fc, summary="s")


def test_decide_rules():
    assert decide([_check("load", "pass"), _check("sanity.known_answers", "pass"), _check("b", "skip")], True)[0] == "qualified"
    status, reasons = decide([_check("load", "pass"), _check("throughput.sweep", "pass")], True)
    assert status == "incomplete" and reasons == ["sanity.known_answers: required to qualify, did not run"]
    assert decide([_check("a", "pass"), _check("b", "fail", "garbage-output")], True)[0] == "disqualified"
    assert decide([_check("load", "fail", "unavailable")], True)[0] == "unavailable"
    assert decide([_check("a", "pass")], False)[0] == "incomplete"
    assert decide([], True)[0] == "incomplete"
    status, reasons = decide([_check("x", "error")], True)
    assert status == "disqualified" and reasons == ["x: error: s"]


def test_run_dirs_are_unique_and_verdict_updates_per_check(tmp_path):
    a = RunDir.create(tmp_path, "vllm", "fixture:tiny-qwen3")
    b = RunDir.create(tmp_path, "vllm", "fixture:tiny-qwen3")
    assert a.path != b.path and a.path.parent == tmp_path / "runs"
    run = RunContext(a, Verdict(run_id=a.run_id, backend="vllm", model="m"))
    assert json.loads((a.path / "verdict.json").read_text())["status"] == "incomplete"
    with run.check("load", "load-failure") as c:
        c.values["startup_s"] = 1.5
    with pytest.raises(CheckFailed):
        with run.check("sanity.known_answers") as c:
            c.evidence("probes.json", [{"x": 1}])
            c.require(False, "accuracy 0%")
    v = json.loads((a.path / "verdict.json").read_text())
    assert v["status"] == "incomplete"  # not finished yet, but everything so far is there
    assert [c["name"] for c in v["checks"]] == ["load", "sanity.known_answers"]
    assert v["checks"][1]["failure_class"] == "garbage-output"
    assert v["checks"][1]["evidence"] == ["evidence/sanity.known_answers/probes.json"]
    run.finish()
    v = json.loads((a.path / "verdict.json").read_text())
    assert v["status"] == "disqualified" and v["finished_at"]
    assert list_runs([tmp_path]) == sorted([a.path], key=lambda p: p.name)


def test_engine_failure_in_check_keeps_class_and_evidence(tmp_path):
    d = RunDir.create(tmp_path, "vllm", "m")
    run = RunContext(d, Verdict(run_id=d.run_id, backend="vllm", model="m"))
    with pytest.raises(EngineFailure):
        with run.check("load", "load-failure"):
            raise EngineFailure("hang", "not ready within 5 s", {"engine.log.tail": "last line"})
    c = run.get("load")
    assert c.status == "fail" and c.failure_class == "hang"
    assert (d.path / "evidence/load/engine.log.tail").read_text() == "last line"


def test_atomic_write_leaves_no_temp_and_redacts(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz123456")
    monkeypatch.setenv("MY_API_KEY", "supersecretvalue")
    p = atomic_write_json(tmp_path / "x.json", {"cmd": "curl -H 'Authorization: Bearer abc.def' x",
                                                "t": os.environ["HF_TOKEN"], "k": "key=supersecretvalue"})
    text = p.read_text()
    assert "hf_abcdefghijklmnopqrstuvwxyz123456" not in text and "supersecretvalue" not in text
    assert "abc.def" not in text and MASK in text
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]


def test_redact_patterns_without_env():
    assert "sk-ant-" not in redact("key sk-ant-abcdefghijklmnopqrstu end", environ={})
    assert redact("plain text 123", environ={}) == "plain text 123"


def test_options_parsing_and_errors():
    assert parse_kv(["a=1", "b=true", "c=x", 'd={"k": 2}']) == {"a": 1, "b": True, "c": "x", "d": {"k": 2}}
    with pytest.raises(UserError, match="malformed --backend-opt 'oops'"):
        parse_kv(["oops"])
    cls = backends.resolve("vllm")
    with pytest.raises(UserError, match="unknown option 'nope' for backend vllm; valid options: .*max_model_len"):
        parse_options("vllm", cls.Options, {"nope": 1})
    with pytest.raises(UserError, match="bad value for option 'gpu_memory_utilization'"):
        parse_options("vllm", cls.Options, {"gpu_memory_utilization": 3})


def test_registry_is_lazy_and_validates():
    with pytest.raises(UserError, match="unknown backend 'nope'; choose one of: .*vllm"):
        backends.validate("nope")
    assert backends.resolve("transformers").name == "transformers"


def test_root_cause_line_skips_engine_wrappers():
    log = "\n".join([
        "(Worker pid=1) ERROR [x.py:1] RuntimeError: Unsupported CPU attention configuration: head_dim=16",
        "(EngineCore pid=2) ERROR [core.py:9] RuntimeError: Worker failed with error 'x', please check the stack trace above",
        "(APIServer pid=3) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace",
    ])
    assert "head_dim=16" in last_error_line(log)
    assert last_error_line("") == "(empty log)"


def test_prometheus_parsing_keeps_labels():
    text = ('# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name="m"} 12.0\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0\n')
    m = parse_prometheus(text)
    assert m["vllm:prefix_cache_hits_total"] == 12.0
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 3.0


def test_sanity_detectors_and_agreement():
    assert probe_correct(" 37 38 39", "37 38") and not probe_correct("36", "37")
    good = detectors(" ".join(str(i) for i in range(40)), None, 48, "length")
    assert good["flags"] == []
    bad = detectors("the " * 40, None, 48, "length")
    assert "repetition" in bad["flags"] and bad["longest_repeat_run"] == 40
    assert "replacement-char" in detectors("ab\ufffd", None, 8, "stop")["flags"]
    assert "control-char" in detectors("ab\x02", None, 8, "stop")["flags"]
    agr = agreement([{"id": "a", "text": "x", "token_ids": [1, 2, 3]}, {"id": "b", "text": "y", "token_ids": [1, 5]}],
                    [{"id": "a", "text": "x", "token_ids": [1, 2, 3]}, {"id": "b", "text": "y", "token_ids": [1, 2]}])
    assert agr["exact_match_rate"] == 0.5 and agr["rows"][1]["first_divergence"] == 1


def test_token_channel_keeps_order_and_batches_without_a_wake_per_item():
    import asyncio
    import threading

    from backends._hosting.worker_server import TokenChannel

    async def main():
        loop = asyncio.get_running_loop()
        chan = TokenChannel(loop)
        wakes = 0
        orig = loop.call_soon_threadsafe

        def counting(*a):
            nonlocal wakes
            wakes += 1
            return orig(*a)

        loop.call_soon_threadsafe = counting
        n = 5000
        t = threading.Thread(target=lambda: [chan.put(i) for i in range(n)] + [chan.put(None)])
        t.start()
        got, batches = [], 0
        while True:
            batch = await chan.get_batch()
            batches += 1
            await asyncio.sleep(0)  # the consumer's own work between batches
            if batch[-1] is None:
                got += batch[:-1]
                break
            got += batch
        t.join()
        return got, batches, wakes

    got, batches, wakes = asyncio.run(main())
    assert got == list(range(5000))
    assert wakes <= batches < 5000  # a wake only when the consumer was parked


def test_start_failure_names_the_import_error_behind_a_failed_inspection():
    from bakeoff.analysis.failures import classify_start

    # shape of vLLM 0.32's log when its model-inspection subprocess cannot import a module
    log = "\n".join([
        "(APIServer pid=1) ERROR 11-30 09:30:27 [registry.py:1120] Error in inspecting model architecture 'Qwen3_5MoeForCausalLM'",
        "(APIServer pid=1) ERROR 11-30 09:30:27 [registry.py:1120] RuntimeError: Error raised in subprocess:",
        '(APIServer pid=1) ERROR 11-30 09:30:27 [registry.py:1120]   File "/x/qwen3_vl.py", line 30, in <module>',
        "(APIServer pid=1) ERROR 11-30 09:30:27 [registry.py:1120] ModuleNotFoundError: No module named 'torchvision'",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, Model architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected. Please check the logs for more details.",
    ])
    f = classify_start(log)
    assert f.failure_class == "load-failure" and f.kind == "engine-import-error"
    assert "No module named 'torchvision'" in f.line and "failed to be inspected" in f.line
    # without an import error it stays an architecture the engine could not inspect
    f = classify_start("\n".join(ln for ln in log.splitlines() if "ModuleNotFound" not in ln))
    assert f.failure_class == "unsupported-architecture"


def test_capabilities_are_typed_fields_not_prose():
    """Evaluations read how many requests an engine serves at once from ``BackendInfo``, not
    from words in its notes (a note saying "one request at a time" alone decides nothing)."""
    from bakeoff.api.specs import BackendInfo
    from evaluations.measuring import serves_one_at_a_time

    class Engine:
        def __init__(self, info):
            self.info = info

    assert serves_one_at_a_time(Engine(BackendInfo(backend="t", engine="e", concurrent_requests=1)))
    prose = BackendInfo(backend="t", engine="e", notes={"scheduling": "one request at a time"})
    assert not serves_one_at_a_time(Engine(prose)) and prose.fallbacks == {}


def test_written_files_take_the_umask_not_mkstemps_0600(tmp_path):
    """Reports and verdicts are shared (CI artifacts, a web folder): written through a temp file
    and a rename, they must get the usual mode (0644 under umask 022), not mkstemp's 0600."""
    import stat

    from bakeoff.host import artifacts

    f = artifacts.atomic_write_text(tmp_path / "report.md", "# hi\n")
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~artifacts._UMASK
