"""The probes, the transformers reference's outputs on them, and what known answers are judged against.

Fixtures of the evaluations plugin (registered by ``conftest.py``):
- ``probe_set``: the probes as the engine under test is sent them and as the reference computes
  them (:class:`ProbeSet`, :func:`probe_set_of`): the model's shipped probes (``probes.jsonl``),
  else bakeoff's generic probes (:mod:`bakeoff.analysis.generic_probes`, chat form too when a
  checkpoint has a chat template), whose chat form each side renders with its own model's template.
- ``probes``: ``(the engine's probes, source)``.
- ``reference``: greedy outputs of the transformers reference on its probes, with top-k
  logprobs (the tie rule's evidence); cached by model and the prompts it saw. None when the
  backend under test *is* the reference (transformers, same model, default options).
- ``known_answer_baseline``: what ``sanity.known_answers`` compares the backend with
  (see :func:`baseline`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

import backends
from backends._hosting.threads import usable_cpus
from bakeoff.host import envs
from bakeoff.api.errors import EngineFailure
from bakeoff.models.resolve import Probe, ResolvedModel
from bakeoff.analysis.sanity import PROBE_LOGPROBS, probe_correct
from bakeoff.api.specs import BackendConfig
from bakeoff.analysis.generic_probes import chat_template_of, generic_probes
from evaluations.rendering import aligned, common_probes, engine_probes, note_templates
from evaluations.probing import PROBE_CONCURRENCY, PROBE_SLACK_TOKENS, probe_max_tokens, run_probes
from evaluations.tokenizing import reference_tokenizer

# 2: outputs carry top-k logprobs; 3: keyed by the resolved options (float32 on CPU, static batches);
# 4: keyed by each probe's token budget
REFERENCE_CACHE_VERSION = 4


# The reference generates greedy requests in static batches (one left-padded ``generate`` over the
# requests waiting, top-k logprobs read per row from the scores greedy search picks from:
# backends/transformers/static.py), whatever the transformers backend's default: one request at a
# time took 3 of the 10 minutes of a SmolLM2-135M run on 2 cores for its 300 probes (30 layers, a
# launch-bound ~15 tok/s per sequence). Left padding moves float32 logits by rounding only.
# ``--reference-opt batching=...`` changes it. Batches of up to 32, as many probes in flight: SmolLM2-135M's
# 300 probes took 35.3 / 41.2 s on 2 cores against 45.9 / 45.5 s at 16 (alternated), 47.9 s at 64 (more left
# padding), 2026-12-05.
REFERENCE_DEFAULTS = {"batching": "static", "max_batch_size": 32}
# On a CPU the reference computes in float32 whatever the checkpoint's dtype: it is the yardstick, not
# a measured engine; float32 is the most exact and the least host-dependent (bf16 kernels differ between
# the AVX2 and AVX-512 hosts, and an AVX2 CPU emulates bf16 several times slower:
# bakeoff/host/cpu_dtype.py). On CUDA the checkpoint's dtype. ``--reference-opt dtype=...`` changes it.
REFERENCE_CPU_DTYPE = "float32"
# ... and on every usable CPU: the reference is not measured, and computes alone (before the engine under
# test starts, and after it stops for the judge), while an engine under test leaves a core to the client
# (backends/_hosting/threads.py). SmolLM2-135M's 300 probes on the 2-core host: 98 s on one thread, 59 s on
# two (2026-12-05). Thread count moves float32 results by rounding at most, so it is not part of what makes
# a run the reference's own (:func:`is_reference_run`).


def reference_options(settings) -> dict:
    """The reference's options: ``--reference-opt`` over :data:`REFERENCE_DEFAULTS` (and
    :data:`REFERENCE_CPU_DTYPE` on a host without CUDA)."""
    device = settings.reference_options.get("device", "auto")
    cpu = {"dtype": REFERENCE_CPU_DTYPE, "num_threads": usable_cpus()} \
        if device == "cpu" or (device == "auto" and not envs.has_cuda()) else {}
    return {**REFERENCE_DEFAULTS, **cpu, **settings.reference_options}


def is_reference_run(settings) -> bool:
    """The backend under test is the reference itself: transformers on the reference model
    with the reference's options, defaults applied on both sides (``dtype=float32`` or
    ``device=cuda`` against a default or CPU reference, or the backend's default continuous
    batching against the reference's one-at-a-time ``generate``, make it a candidate)."""
    if settings.backend != "transformers" or settings.reference_model.path != settings.model.path:
        return False
    opts = backends.resolve("transformers").Options
    # thread count and batch size move results by rounding at most (left padding), like any two runs' batches
    ours, its = (opts(**o).model_dump(exclude={"num_threads", "max_batch_size"})
                 for o in (settings.options, reference_options(settings)))
    return ours == its


def reference_config(settings, workdir, scoring: bool = False) -> BackendConfig:
    """How the transformers reference (and the judge's scorer) starts: ``--reference-opt`` options.

    ``scoring``: the judge's scorer, which runs forward passes (``/v1/score``) and generates the
    reference's own greedy answers to the open-ended prompts: continuous batching's paged attention
    serves generation alone (transformers 5.x ``sdpa_paged`` refuses a standard forward: "called
    without a paged attention cache", seen on the H200 with ``--reference-opt batching=continuous``),
    so that mode becomes one request at a time; static batches score between batches and generate
    the open-ended answers as one batch (one at a time, 8 x 48 tokens took 25 s of SmolLM2-135M's
    judge on 2 cores)."""
    options = reference_options(settings)
    if scoring and options.get("batching") == "continuous":
        options["batching"] = "none"
    return BackendConfig(backend="transformers", model=settings.reference_model.path, options=options,
                         workdir=str(workdir), start_timeout_s=settings.start_timeout_s,
                         progress_timeout_s=settings.progress_timeout_s,
                         request_deadline_factor=settings.request_deadline_factor)


@dataclass
class ProbeSet:
    """The probes of a run, as each side sees them.

    A server renders a chat request with the chat template of the model it serves, so the engine
    under test is sent the chat probes rendered with the template of ``--model`` and the reference
    computes them rendered with its own model's: a checkpoint whose template is wrong then answers
    worse than the reference, as it would in service. Same ids, same order on both sides, so the
    paired comparisons (McNemar, the tie rule) pair each probe with itself.

    Attributes:
        backend: what the engine under test is sent.
        reference: what the reference computes (its outputs are cached by these prompts).
        source: ``model`` (shipped with the model) or ``generic``.
        unsent: probes left out because the engine's API cannot be sent them (:func:`for_api`).
        rendering: how the chat probes were rendered (``chat_template``: whose template the
            engine's were rendered with and why; ``templates_identical``; ``prompts_differ``: how
            many prompts differ between the two sides; ``first_difference``: the first such probe
            with both renderings); recorded in the sanity checks' values.
    """

    backend: list[Probe]
    reference: list[Probe]
    source: str
    rendering: dict[str, Any] = field(default_factory=dict)
    # the engine's-side probes its API cannot be sent as probes (:func:`for_api`): their texts still go
    # through the checks that send text as text (the tokenizer's, the open-ended prompts' choice)
    unsent: list[Probe] = field(default_factory=list)

    def differing_ids(self) -> set[str]:
        """The ids of the probes the two sides see as different prompts."""
        return {b.id for b, r in zip(self.backend, self.reference) if b.prompt != r.prompt}


def _template(model: ResolvedModel) -> tuple[str | None, dict[str, str]]:
    return chat_template_of(model.path) if model.local else (None, {})


def probe_set_of(settings) -> ProbeSet:
    """The run's :class:`ProbeSet`: shipped probes alike on both sides; generic probes whose chat
    form the engine's side renders with the template of ``settings.model`` and the reference's
    with that of ``settings.reference_model``.

    The engine's side falls back to the reference's rendering, saying why in ``rendering``, when
    the model under test carries no chat template (or is not a local folder) or its template does
    not render here; chat probes only one side has are left out of both (the reference carries
    no template: nothing to compare them with)."""
    shipped = settings.model.probes() or settings.reference_model.probes()
    if shipped:
        shipped, budgets = with_budgets(settings, shipped)
        return ProbeSet(shipped, shipped, "model", {"chat_template": "none: probes shipped with the model",
                                                    "token_budget": budgets})
    ref_template, ref_special = _template(settings.reference_model)
    reference = [Probe(**p) for p in generic_probes(chat_template=ref_template, special=ref_special)]
    model_template, model_special = _template(settings.model)
    same_model = settings.model.path == settings.reference_model.path
    rendering: dict[str, Any] = {"chat_template": "the model under test's"}
    backend = engine_probes(settings, reference, model_template, model_special, same_model, rendering)
    reference, backend = common_probes(reference, backend, rendering)
    reference, rendering["token_budget"] = with_budgets(settings, reference)
    backend = aligned(backend, reference)
    note_templates(rendering, backend, reference, same_model, model_template, ref_template)
    return ProbeSet(backend, reference, "generic", rendering)


def with_budgets(settings, items: list[Probe]) -> tuple[list[Probe], str]:
    """``items`` with their token budgets set (:func:`evaluations.probing.probe_max_tokens`) from the
    reference model's tokenizer, the same for both sides of a probe, and how they were set."""
    tok, why = reference_tokenizer(settings.reference_model.path,
                                   bool(settings.reference_options.get("trust_remote_code", False)))
    try:
        out = [replace(p, max_tokens=probe_max_tokens(p.expected, p.match, tok)) for p in items]
    except Exception as exc:  # noqa: BLE001 - a tokenizer that loads but cannot encode: the character bound
        tok, why = None, f"the reference tokenizer did not encode the answers ({type(exc).__name__}: {str(exc)[:120]})"
        out = [replace(p, max_tokens=probe_max_tokens(p.expected, p.match)) for p in items]
    how = (f"the expected text's tokens + {PROBE_SLACK_TOKENS} (reference tokenizer); chat probes 48" if tok is not None
           else f"len(expected) + 4 characters: {why}")
    return out, how


CHAT_APIS = ("chat", "messages")


def for_api(ps: ProbeSet, api: str) -> ProbeSet:
    """``ps`` as an engine speaking ``api`` can be sent it: a chat API (``chat``, ``messages``) is sent a
    chat probe's raw messages, which its server renders once with its template; a completion probe
    has no chat form it could be sent as (wrapped in a user message, its server would put the chat
    template around text the reference saw bare), so it is left out of both sides, said in
    ``rendering["left_out_for_api"]``."""
    if api not in CHAT_APIS:
        return ps
    keep = {p.id for p in ps.backend if p.messages}
    if len(keep) == len(ps.backend):
        return ps
    why = (f"{len(ps.backend) - len(keep)} of {len(ps.backend)} probes left out: the engine is sent api={api} requests, "
           f"and a completion probe has no chat form ({len(keep)} chat probes sent as raw messages)")
    return ProbeSet([p for p in ps.backend if p.id in keep], [p for p in ps.reference if p.id in keep], ps.source,
                    {**ps.rendering, "left_out_for_api": why}, unsent=[p for p in ps.backend if p.id not in keep])


@pytest.fixture(scope="session")
def probe_set(settings) -> ProbeSet:
    """The run's probes on both sides (:func:`probe_set_of`), as the engine's API can be sent them
    (:func:`for_api`; the API from the run's options: every backend's default is ``completions``)."""
    return for_api(probe_set_of(settings), str(settings.options.get("api") or "completions"))


@pytest.fixture(scope="session")
def probes(probe_set) -> tuple[list[Probe], str]:
    """``(the probes the engine under test is sent, source)``: source ``model`` (shipped with
    the model) or ``generic``."""
    return probe_set.backend, probe_set.source


@pytest.fixture(scope="session")
def probe_texts(probe_set) -> tuple[list[Probe], str]:
    """``(every probe of the engine's side, sent as a probe or not, source)``: the texts the checks that
    send text as text use (``sanity.tokenizer``, the open-ended prompts of ``sanity.degeneration``)."""
    return probe_set.backend + probe_set.unsent, probe_set.source


def _model_stamp(model: ResolvedModel) -> list:
    if not model.local:
        return [model.path]
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model.path).iterdir() if p.is_file())


def reference_cache_key(settings, probe_set: ProbeSet) -> str:
    """The reference outputs' cache key: the reference model (its files), its resolved options and
    the probes as the reference computes them (:attr:`ProbeSet.reference`: its own rendering)."""
    return hashlib.sha256(json.dumps([REFERENCE_CACHE_VERSION, settings.reference_model.path,
                                      _model_stamp(settings.reference_model), reference_options(settings),
                                      [[p.prompt, p.expected, p.match, p.max_tokens] for p in probe_set.reference]]).encode()
                          ).hexdigest()[:16]


@pytest.fixture(scope="session")
def reference(settings, run, probe_set):
    """Greedy outputs (with top-k logprobs) of the transformers reference on its probes
    (:attr:`ProbeSet.reference`, cached by the prompts it saw), or None when the backend under
    test is the reference. Runs before the engine starts, then stops, so the two never hold the
    device at once (a backend that attaches to a running server asks for it later, at the first
    check that needs it). Not computed (``ok`` False, the reason in ``error``) once a check
    failed as ``hang``."""
    if is_reference_run(settings):
        return None
    hung = next((c for c in run.verdict.checks if c.failure_class == "hang"), None)
    if hung is not None:  # nothing the engine answers can be compared: no minutes spent on a reference
        return {"ok": False, "error": f"not computed: the engine under test hung ({hung.name}: {hung.summary[:200]})",
                "log_tail": ""}

    items = probe_set.reference
    if not items:  # nothing the engine could be sent (evaluations/reference.py for_api): nothing to compute
        return {"ok": True, "outputs": [], "engine": None}
    cache = envs.cache_root() / "reference" / f"{reference_cache_key(settings, probe_set)}.json"
    cached = _cached_reference(cache, len(items))
    if cached is not None:
        return cached
    ref = backends.resolve("transformers")(reference_config(settings, run.dir.path / "engine" / "reference"))
    try:
        info = ref.start()
        in_flight = max(PROBE_CONCURRENCY, int(reference_options(settings).get("max_batch_size") or 0))
        result = {"ok": True, "outputs": run_probes(ref, items, logprobs=PROBE_LOGPROBS, concurrency=in_flight),
                  "engine": {"device": info.device, "engine_version": info.engine_version,
                             "options": reference_options(settings), "dtype": info.notes.get("dtype")}}
    except EngineFailure as exc:
        result = {"ok": False, "error": f"{exc.failure_class}: {exc.message}", "log_tail": ref.log_tail(60)}
    finally:
        ref.stop()
    if result["ok"] and all(o["status"] == "ok" for o in result["outputs"]):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False) as tmp:
                tmp.write(json.dumps(result))
            os.replace(tmp.name, cache)
        except OSError as exc:  # a read-only or full cache costs the next run time, never this run's checks
            print(f"bakeoff: the reference's outputs were not cached ({exc.strerror or exc}: {cache.parent}); "
                  "the next run computes them again", file=sys.stderr)
    return result


def _cached_reference(path: Path, n_probes: int) -> dict | None:
    """The cached reference outputs, or None when absent or damaged (unreadable JSON, another shape,
    not one whole output per probe): then the reference runs again and rewrites the entry. A damaged
    cache entry costs the reference's minutes, never a verdict (issue 36)."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    outs = got.get("outputs") if isinstance(got, dict) and got.get("ok") is True else None
    whole = isinstance(outs, list) and len(outs) == n_probes and all(
        isinstance(o, dict) and o.get("status") == "ok" and isinstance(o.get("text"), str) for o in outs)
    return got if whole else None


# A baseline answering fewer than this share of its probes cannot judge anyone's answers: below
# half, its mistakes outnumber its answers and the set does not measure the model. Kept at 50% with
# the generic families of bakeoff/analysis/generic_probes.py: SmolLM2-135M-Instruct answers 94.7%
# of them in float32 and 95.0% in bfloat16, so a host's numerics do not move it across the bar.
MIN_BASELINE_ACCURACY = 0.5


@dataclass
class Baseline:
    """What a backend's known answers are compared with.

    Attributes:
        kind: ``builder`` (the fixture builder's per-probe record, paired), ``floor`` (a
            negative-control fixture: the accuracy its trained twin promises, unpaired),
            ``reference`` (the reference run's per-probe correctness, paired), ``self`` (the
            backend is the reference: nothing to pair with), or ``none``.
        correct: per-probe correctness, in probe order (paired kinds).
        accuracy: the baseline's accuracy (or the floor).
        source: one line saying where it comes from.
        skip_reason: set when the baseline cannot judge (it fails most probes, or is missing).
    """

    kind: str
    accuracy: float | None = None
    correct: list[bool] = field(default_factory=list)
    source: str = ""
    skip_reason: str | None = None


def _fixture_meta(settings) -> dict[str, Any] | None:
    if not settings.model.local:
        return None
    path = Path(settings.model.path) / "fixture.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def baseline(settings, reference, items: list[Probe]) -> Baseline:
    """The known-answer baseline of this run (rules in ``evaluations/test_sanity.py``).

    - A bakeoff fixture with a per-probe record (``fixture.json`` ``probe_results.per_probe``,
      measured by its builder with transformers on the saved weights): that record, paired.
      A record below ``MIN_BASELINE_ACCURACY`` makes the check skip (the fixture did not learn).
    - A negative-control fixture (recipe ``twin_of``): the known-answer floor of its trained
      twin, unpaired (the untrained twin must fail it).
    - Otherwise the reference run on the same probes, paired; the reference answering fewer
      than ``MIN_BASELINE_ACCURACY`` of them makes the check skip; the reference itself under
      test is judged on its own accuracy against that bar.
    """
    meta = _fixture_meta(settings)
    if meta is not None:
        recipe = meta.get("recipe") or {}
        if recipe.get("twin_of"):
            floor = meta.get("known_answers_floor") or recipe.get("known_answers_floor")
            if floor:
                return Baseline("floor", accuracy=float(floor),
                                source=f"negative control of {recipe['twin_of']}: the accuracy its builder must reach")
        record = (meta.get("probe_results") or {}).get("per_probe")
        if isinstance(record, dict) and all(p.id in record for p in items):
            correct = [bool(record[p.id]) for p in items]
            acc = sum(correct) / len(correct)
            skip = (f"the fixture's builder measured {acc:.0%} on its own probes (< {MIN_BASELINE_ACCURACY:.0%}): "
                    "it did not learn its tasks; rebuild it") if acc < MIN_BASELINE_ACCURACY else None
            return Baseline("builder", accuracy=acc, correct=correct, skip_reason=skip,
                            source=f"the fixture builder's record ({meta.get('built_at', '?')}, "
                                   f"transformers {((meta.get('versions') or {}).get('transformers', '?'))}, bf16)")
    if reference is None:
        return Baseline("self", source="the backend is the reference")
    if not reference.get("ok"):
        return Baseline("none", skip_reason=f"the transformers reference could not run: {reference.get('error')}")
    correct = [o["status"] == "ok" and probe_correct(o["text"], p.expected, p.match)
               for o, p in zip(reference["outputs"], items)]
    acc = sum(correct) / len(correct) if correct else 0.0
    skip = (f"the reference answers only {acc:.0%} of the {len(correct)} probes (< {MIN_BASELINE_ACCURACY:.0%}): "
            "known answers cannot judge this model") if acc < MIN_BASELINE_ACCURACY else None
    return Baseline("reference", accuracy=acc, correct=correct, skip_reason=skip,
                    source="the transformers reference on the same probes")
