"""Export caches keyed by the schema version of their metadata (issue 30): an entry written by a
bakeoff whose result model has other fields (seen: a newer ``graph.input_shapes`` refused by an
older ``extra="forbid"`` model) is neither reused nor refused; the current version's entry is.

The three exporters (ort-genai's model builder, optimum's ONNX and OpenVINO exports) run for real
in ``tests/test_ort_genai.py``, ``test_optimum_ort.py`` and ``test_openvino.py``; here their tools
are stand-ins (named so: the environment, the exporter's command, the inspection) so that the
cache's lookup runs in a second without an engine environment."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from pydantic import Field

from adapters import _optimum
from adapters.openvino_export.specs import OpenVinoExportOptions, OpenVinoExportResult
from adapters.optimum_onnx_export.specs import OptimumOnnxOptions, OptimumOnnxResult
from adapters.ort_genai_export import cache
from adapters.ort_genai_export.specs import ExportOptions, ExportResult, GraphReport

# the modules (each package's __init__ exports a function of the same name as the module)
og_export = importlib.import_module("adapters.ort_genai_export.export")
ov_build = importlib.import_module("adapters.openvino_export.build")
onnx_build = importlib.import_module("adapters.optimum_onnx_export.build")


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A checkpoint folder (a config and a weight file: what the key hashes) and an empty cache."""
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    (src / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return src


def _fake_ort_genai(monkeypatch, calls: list):
    """Stand-ins for the ort-genai environment, the model builder and the graph inspection."""
    monkeypatch.setattr(og_export.envs, "ensure", lambda spec, log=None, **k: Path("/nonexistent/python"))
    monkeypatch.setattr(og_export, "_versions", lambda python: {"onnxruntime-genai": "0.0-fake"})

    def run_builder(cmd, log_path, timeout_s):
        calls.append(cmd)
        out = Path(cmd[cmd.index("-o") + 1])
        out.mkdir(parents=True)
        (out / "genai_config.json").write_text("{}")
        Path(log_path).write_text("fake builder\n")
        return 0, 0.01

    monkeypatch.setattr(og_export, "_run_builder", run_builder)
    monkeypatch.setattr(og_export, "inspect_graph", lambda d, o, log=None: GraphReport(onnx_file="model.onnx"))


def _fake_optimum(monkeypatch, calls: list, module):
    """Stand-ins for an optimum exporter's environment, its CLI and the inspection of its output."""
    monkeypatch.setattr(module.envs, "ensure", lambda spec, log=None, **k: Path("/nonexistent/python"))
    monkeypatch.setattr(_optimum, "versions", lambda python, names: {"optimum": "0.0-fake"})

    def run_cli(cmd, log_path, timeout_s, extra_env=None):
        calls.append(cmd)
        out = Path(cmd[-1])
        out.mkdir(parents=True)
        for name in ("openvino_model.xml", "model.onnx"):
            (out / name).write_text("fake")
        Path(log_path).write_text("fake exporter\n")
        return 0, 0.01

    monkeypatch.setattr(_optimum, "run_cli", run_cli)
    if module is ov_build:
        monkeypatch.setattr(ov_build, "inspect_ir", lambda python, out: {"tokenizer_ir": True, "op_counts": {}})
    else:
        monkeypatch.setattr(onnx_build, "inspect", lambda d, o, python=None: GraphReport(onnx_file="model.onnx"))


def _ort_genai_entry(src: Path, schema: str | None) -> Path:
    opts = ExportOptions()
    return cache.export_dir(src, opts, cache.cache_key(cache.checkpoint_hash(src), opts, og_export.ORT_GENAI_VERSION, schema))


def _optimum_entry(module, kind: str, tag: str, options, src: Path, schema: str) -> Path:
    key = _optimum.cache_key(cache.checkpoint_hash(src), options.model_dump(mode="json"),
                             {"env": ",".join(module.env_spec().requirements)}, schema)
    return _optimum.export_dir(kind, src, tag, key)


CASES = {
    "ort-genai": (lambda mp, calls: _fake_ort_genai(mp, calls), og_export.export, ExportResult,
                  lambda src, schema: _ort_genai_entry(src, schema)),
    "openvino": (lambda mp, calls: _fake_optimum(mp, calls, ov_build), ov_build.export, OpenVinoExportResult,
                 lambda src, schema: _optimum_entry(ov_build, "openvino", OpenVinoExportOptions().weight_format,
                                                    OpenVinoExportOptions(), src, schema)),
    "optimum-onnx": (lambda mp, calls: _fake_optimum(mp, calls, onnx_build), onnx_build.export, OptimumOnnxResult,
                     lambda src, schema: _optimum_entry(onnx_build, "optimum-onnx", OptimumOnnxOptions().precision,
                                                        OptimumOnnxOptions(), src, schema)),
}


@pytest.mark.parametrize("exporter", sorted(CASES))
def test_an_entry_of_another_schema_version_is_neither_reused_nor_refused(source, monkeypatch, exporter):
    fake, export, result_model, entry = CASES[exporter]
    calls: list = []
    fake(monkeypatch, calls)
    first = export(source, log=lambda s: None)
    assert len(calls) == 1 and not first.cached
    current = entry(source, None if exporter == "ort-genai" else cache.schema_version(result_model))
    assert Path(first.output_dir).parent == current  # the entry sits under the current schema's key
    # a newer bakeoff's entry: the same export with a field this bakeoff's model does not know,
    # under its own schema version (the other key); this bakeoff neither finds it nor refuses it
    meta = json.loads((current / "export.json").read_text())
    newer = entry(source, "a-newer-one0")
    assert newer != current
    newer.mkdir(parents=True)
    (newer / "export.json").write_text(json.dumps({**meta, "field_of_a_newer_bakeoff": [1, 2]}))
    again = export(source, log=lambda s: None)
    assert again.cached and len(calls) == 1  # the current version's entry is reused
    assert json.loads((newer / "export.json").read_text())["field_of_a_newer_bakeoff"] == [1, 2]  # left as it was


@pytest.mark.parametrize("exporter", sorted(CASES))
def test_an_entry_that_does_not_read_as_this_model_is_made_again_not_refused(source, monkeypatch, exporter):
    """Under the current key, a result file this bakeoff's model refuses (an unknown field, damage)
    is exported again and replaced, with one line saying why."""
    fake, export, result_model, _entry = CASES[exporter]
    calls: list = []
    fake(monkeypatch, calls)
    first = export(source, log=lambda s: None)
    result = Path(first.output_dir).parent / "export.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "field_of_a_newer_bakeoff": 1}))
    lines: list[str] = []
    again = export(source, log=lines.append)
    assert not again.cached and len(calls) == 2
    assert any("does not read as this bakeoff's" in x and "exporting again" in x for x in lines), lines
    assert "field_of_a_newer_bakeoff" not in result.read_text()  # replaced by this bakeoff's entry
    assert export(source, log=lambda s: None).cached and len(calls) == 2


def test_the_schema_version_follows_the_fields_not_the_docs():
    """A field added (as ``graph.input_shapes`` was) changes the version; a docstring does not."""

    class Documented(GraphReport):
        """The same fields, other words."""

    class Grown(GraphReport):
        future_field: list[int] = Field(default_factory=list)

    class Result(ExportResult):
        graph: Grown

    base = cache.schema_version(GraphReport)
    assert cache.schema_version(Documented) == base != cache.schema_version(Grown)
    assert cache.schema_version(Result) != cache.schema_version(ExportResult)  # nested models count
    assert cache.cache_key("h", ExportOptions(), "0.18.0") == cache.cache_key("h", ExportOptions(), "0.18.0",
                                                                              cache.schema_version(ExportResult))
    assert cache.cache_key("h", ExportOptions(), "0.18.0", "other") != cache.cache_key("h", ExportOptions(), "0.18.0")


@pytest.mark.parametrize("damage", ["truncate", "remove"])
@pytest.mark.parametrize("exporter", sorted(CASES))
def test_a_damaged_entry_is_exported_again_not_loaded(source, monkeypatch, exporter, damage):
    """A cached export cut short or missing a file (issue 36's census: a truncated cached ORT GenAI export
    ended ``disqualified`` ``load-failure``, the engine blamed): every file the entry's result lists is
    checked at its recorded size on use; a damaged entry is said and exported again."""
    fake, export, _model, _entry = CASES[exporter]
    calls: list = []
    fake(monkeypatch, calls)
    first = export(source, log=lambda s: None)
    victim = sorted(p for p in Path(first.output_dir).rglob("*") if p.is_file())[0]
    victim.write_text("") if damage == "truncate" else victim.unlink()
    lines: list[str] = []
    again = export(source, log=lines.append)
    assert not again.cached and len(calls) == 2, lines
    assert any("is damaged (" in x and victim.name in x and "exporting again" in x for x in lines), lines
    assert export(source, log=lambda s: None).cached and len(calls) == 2


@pytest.mark.parametrize("exporter", sorted(CASES))
def test_a_cache_copied_elsewhere_is_used_where_it_is(source, monkeypatch, tmp_path, exporter):
    """``BAKEOFF_CACHE`` a copy of the cache, the old one gone (issue 36's census: the engine loaded the
    export from the old place, and once that was gone the verdict was ``load-failure``): the entry's
    export is used where the entry is now, without exporting again."""
    import shutil

    fake, export, _model, _entry = CASES[exporter]
    calls: list = []
    fake(monkeypatch, calls)
    first = export(source, log=lambda s: None)
    shutil.copytree(tmp_path / "cache", tmp_path / "moved", symlinks=True)
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setenv("BAKEOFF_CACHE", str(tmp_path / "moved"))
    lines: list[str] = []
    again = export(source, log=lines.append)
    assert again.cached and len(calls) == 1, lines
    assert Path(again.output_dir).is_dir() and Path(again.output_dir).is_relative_to(tmp_path / "moved"), again.output_dir
    assert Path(again.output_dir).name == Path(first.output_dir).name
