"""Adapters by name: the registry jobs and the CLI use instead of branching on strings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import adapters
from adapters.base import Adapter
from bakeoff.api.errors import UserError
from cli.jobs.render import engine_requirements
from cli.jobs.specs import ExportTask, JobTask, PushTarget


def test_every_registered_adapter_implements_the_interface():
    assert adapters.names() == ["awq-int4", "gguf", "openvino", "optimum-onnx", "ort-genai"]
    for name in adapters.names():
        cls = adapters.resolve(name)
        assert issubclass(cls, Adapter) and cls.name == name
        assert cls.requirements() and cls.env_spec().modules, name  # a job installs them; preinstalled is detectable
        cls()  # its defaults are valid options


def test_unknown_adapter_and_bad_options_are_refused_by_name():
    with pytest.raises(UserError, match="unknown adapter 'nope'; choose one of: awq-int4, gguf, openvino, optimum-onnx, ort-genai"):
        adapters.resolve("nope")
    with pytest.raises(ValidationError, match="num_samples"):
        adapters.resolve("awq-int4")({"num_samples": 0})
    with pytest.raises(ValidationError, match="int4_algo"):
        adapters.resolve("ort-genai")({"int4_algo": "bogus"})
    with pytest.raises(ValidationError, match="unknown pipeline"):
        ExportTask(pipeline="nope")


def test_a_job_installs_its_adapters_requirements():
    task = JobTask(kind="export", tag="t", model="fixture:tiny-qwen3", export=ExportTask(pipeline="awq-int4"),
                   push_to=PushTarget(kind="none"))
    assert engine_requirements(task) == [*adapters.resolve("awq-int4").requirements(), "huggingface_hub"]


def test_a_cached_export_is_copied_whole_into_the_output_folder(tmp_path):
    """adapters.base.copy_cached_export: the cache entry (the folder above the export's model folder) lands in
    ``out``, folders and files, and the entry itself is returned and left as it was."""
    from adapters.base import copy_cached_export

    entry = tmp_path / "cache" / "abc123"
    (entry / "model" / "sub").mkdir(parents=True)
    (entry / "model" / "sub" / "w.bin").write_bytes(b"\x01\x02")
    (entry / "export.json").write_text("{}")
    out = tmp_path / "out" / "deep"
    assert copy_cached_export(entry / "model", out) == entry
    assert (out / "model" / "sub" / "w.bin").read_bytes() == b"\x01\x02" and (out / "export.json").read_text() == "{}"
    assert (entry / "model" / "sub" / "w.bin").exists()
