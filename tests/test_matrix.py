"""Config matrices: parsing, presets, errors (bakeoff/analysis/matrix.py) and the qualify CLI's checks."""

from __future__ import annotations

import pytest

from bakeoff.api.errors import UserError
from bakeoff.analysis.matrix import Cell, merge_options, parse_matrix, split_top_level


def test_no_matrix_is_one_empty_cell():
    assert parse_matrix([]) == [Cell()]


def test_cartesian_product_with_presets():
    cells = parse_matrix(["kv_cache_dtype=auto,fp8", "speculative=none,ngram"])
    assert [c.label for c in cells] == ["kv_cache_dtype=auto,speculative=none", "kv_cache_dtype=auto,speculative=ngram",
                                        "kv_cache_dtype=fp8,speculative=none", "kv_cache_dtype=fp8,speculative=ngram"]
    assert cells[0].options == {"kv_cache_dtype": "auto"}  # none -> no key
    assert cells[1].options == {"kv_cache_dtype": "auto", "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}
    assert cells[3].backend_opts() == [
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
    assert merge_options(["max_model_len=2048"], cell) == ["max_model_len=2048", "kv_cache_dtype=fp8"]
    with pytest.raises(UserError, match="also varied by --matrix"):
        merge_options(["kv_cache_dtype=auto"], cell)


@pytest.mark.parametrize("argv, message", [
    (["qualify", "--backends", "vllm", "--matrix", "speculative=eagle"], "unknown --matrix value"),
    (["qualify", "--backends", "vllm", "--matrix", "kv_cache_dtypo=fp8"], "unknown option 'kv_cache_dtypo' for backend vllm"),
    (["qualify", "--backends", "vllm", "--repeats", "0"], "--repeats must be at least 1"),
])
def test_qualify_rejects_bad_matrix_before_running(argv, message, capsys, tmp_path):
    from bakeoff.cli.main import main

    assert main([*argv, "--artifacts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()
