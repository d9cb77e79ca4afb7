"""Config matrices: parsing, presets, errors (bakeoff/analysis/matrix.py) and the qualify CLI's checks."""

from __future__ import annotations

import pytest

from bakeoff.api.errors import UserError
from bakeoff.analysis.matrix import Cell, cells_for, merge_options, parse_matrix, split_top_level
from bakeoff.api.options import format_kv


def test_no_matrix_is_one_empty_cell():
    assert parse_matrix([]) == [Cell()]


def test_cartesian_product_with_presets():
    cells = parse_matrix(["kv_cache_dtype=auto,fp8", "speculative=none,ngram"])
    assert [c.label for c in cells] == ["kv_cache_dtype=auto,speculative=none", "kv_cache_dtype=auto,speculative=ngram",
                                        "kv_cache_dtype=fp8,speculative=none", "kv_cache_dtype=fp8,speculative=ngram"]
    assert cells[0].options == {"kv_cache_dtype": "auto"}  # none -> no key
    assert cells[1].options == {"kv_cache_dtype": "auto", "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}
    assert [format_kv(k, v) for k, v in cells[3].options.items()] == [
        "kv_cache_dtype=fp8", 'speculative_config={"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}']


def test_values_are_json_where_they_parse():
    cells = parse_matrix(["max_num_seqs=4,8", "enable_prefix_caching=true,false"])
    assert cells[0].options == {"max_num_seqs": 4, "enable_prefix_caching": True}
    assert parse_matrix(["prefix_cache=off"])[0].options == {"enable_prefix_caching": False}


def test_json_values_with_commas():
    cells = parse_matrix(['speculative_config={"method":"ngram","num_speculative_tokens":2},{"method":"mtp"}'])
    assert [c.options["speculative_config"]["method"] for c in cells] == ["ngram", "mtp"]
    assert split_top_level('a,"b,c",[1,2]') == ["a", '"b,c"', "[1,2]"]


@pytest.mark.parametrize("items, message", [
    (["kv_cache_dtype"], "malformed --matrix 'kv_cache_dtype': expected key=v1,v2"),
    (["=a,b"], "malformed --matrix '=a,b'"),
    (["kv_cache_dtype=auto,"], "empty value"),
    (["kv_cache_dtype=auto", "kv_cache_dtype=fp8"], "given twice"),
    (["speculative=eagle"], "unknown --matrix value speculative='eagle'; choose from: none, ngram, mtp"),
    (["kv_cache_dtype=fp8,fp8"], "repeats a value"),
    (['speculative_config={"a":1'], "unbalanced"),
    (["speculative=ngram", 'speculative_config={"method":"mtp"}'], "set option 'speculative_config' twice"),
])
def test_errors_are_one_line(items, message):
    with pytest.raises(UserError) as exc:
        parse_matrix(items)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_merge_refuses_a_key_set_twice():
    cell = parse_matrix(["kv_cache_dtype=fp8"])[0]
    assert merge_options({"max_model_len": 2048}, cell) == {"max_model_len": 2048, "kv_cache_dtype": "fp8"}
    with pytest.raises(UserError, match="also varied by --matrix"):
        merge_options({"kv_cache_dtype": "auto"}, cell)


@pytest.mark.parametrize("argv, message", [
    (["qualify", "--backends", "vllm", "--matrix", "speculative=eagle"], "unknown --matrix value"),
    (["qualify", "--backends", "vllm", "--matrix", "kv_cache_dtypo=fp8"], "--matrix kv_cache_dtypo is an option of none of vllm"),
    (["qualify", "--backends", "vllm,ort-genai", "--matrix", "kv_cache_dtype=auto,fp8", "--matrix", "speculativ=none"],
     "--matrix speculativ is an option of none of vllm, ort-genai"),
    (["qualify", "--backends", "vllm", "--repeats", "0"], "--repeats must be at least 1"),
])
def test_qualify_rejects_bad_matrix_before_running(argv, message, capsys, tmp_path):
    from cli.main import main

    assert main([*argv, "--artifacts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_each_backend_varies_only_the_axes_it_has():
    cells = parse_matrix(["kv_cache_dtype=auto,fp8", "speculative=none,mtp"])
    vllm_like = {"kv_cache_dtype", "speculative_config"}.__contains__
    assert cells_for(cells, vllm_like) == (cells, [])
    kv_only, dropped = cells_for(cells, {"kv_cache_dtype"}.__contains__)
    assert [c.label for c in kv_only] == ["kv_cache_dtype=auto", "kv_cache_dtype=fp8"] and dropped == ["speculative"]
    assert kv_only[1].options == {"kv_cache_dtype": "fp8"}
    none, dropped = cells_for(cells, lambda name: False)
    assert none == [Cell()] and dropped == ["kv_cache_dtype", "speculative"]
    assert cells_for([Cell()], lambda name: False) == ([Cell()], [])


def test_qualify_runs_a_backend_once_when_the_matrix_is_not_its_own(tmp_path, monkeypatch, capsys):
    """vLLM gets both KV cells (fp8 against its auto run); ORT GenAI, which has no KV dtype option,
    one run with no --backend-opt from the matrix (the evaluations are stood in for)."""
    import subprocess
    from pathlib import Path

    import cli.main as cli

    import sys

    real_popen, calls = subprocess.Popen, []

    def fake_pytest(cmd, env=None, cwd=None, **kw):  # qualify's child (cli/progress.py), stood in for
        if "pytest" not in cmd:
            return real_popen(cmd, env=env, cwd=cwd, **kw)
        calls.append(cmd)
        run = tmp_path / "art" / "runs" / f"run{len(calls)}"
        run.mkdir(parents=True)
        Path(env["BAKEOFF_RUN_FILE"]).write_text(str(run))
        return real_popen([sys.executable, "-c", "raise SystemExit(0)"], env=env, cwd=cwd, **kw)

    monkeypatch.setattr(subprocess, "Popen", fake_pytest)
    monkeypatch.setattr("bakeoff.reporting.report.write_report", lambda runs, dest: dest)
    monkeypatch.setattr("cli.progress.print_verdicts", lambda runs: [])
    assert cli.main(["qualify", "--backends", "vllm,ort-genai", "--matrix", "kv_cache_dtype=auto,fp8",
                     "--artifacts", str(tmp_path / "art")]) == 0
    backends_run = [next(a for a in c if a.startswith("--backend=")) for c in calls]
    assert backends_run == ["--backend=vllm", "--backend=vllm", "--backend=ort-genai"]
    assert "--backend-opt=kv_cache_dtype=fp8" in calls[1] and f"--baseline-run={tmp_path / 'art' / 'runs' / 'run1'}" in calls[1]
    assert not any(a.startswith("--backend-opt") for a in calls[2])
    assert "ort-genai: --matrix kv_cache_dtype not varied (no such option of ort-genai)" in capsys.readouterr().out


def test_a_scoped_axis_varies_one_backend_only():
    """``--matrix ort-genai:precision=int4,fp32``: ORT GenAI's lossy default beside its lossless export,
    optimum-ort (which has a ``precision`` option too) once, vLLM once."""
    from evaluations.inputs import Request, check_request

    c = check_request(Request(entry="qualify", backends=["ort-genai", "optimum-ort", "vllm"], model="fixture:tiny-qwen3",
                              matrix=["ort-genai:precision=int4,fp32"]))
    assert [(r.backend, r.options) for r in c.runs] == [
        ("ort-genai", {"precision": "int4"}), ("ort-genai", {"precision": "fp32"}), ("optimum-ort", {}), ("vllm", {})]


@pytest.mark.parametrize("items, message", [
    (["openvino:precision=int4,fp32"], "scoped to 'openvino', not a backend of this run"),
    (["vllm:precision=int4,fp32"], "--matrix vllm:precision is not an option of vllm"),
])
def test_a_bad_scope_is_one_line(items, message):
    from evaluations.inputs import Request, check_request

    with pytest.raises(UserError, match=message):
        check_request(Request(entry="qualify", backends=["ort-genai", "vllm"], model="fixture:tiny-qwen3", matrix=items))
