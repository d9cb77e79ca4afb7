"""Load: the engine starts, serves the model and reports what it can (versions, KV capacity).

- ``load``: recorded by the ``engine_state`` fixture (plugin.py) as the engine starts.
- ``load.options_effective``: the options the user set took. An engine may accept an option
  and serve without it (vLLM CPU given ``--attention-backend FLASH_ATTN`` logs ``Cannot use
  AttentionBackendEnum.FLASH_ATTN backend on CPU.`` and serves with its CPU backend); the run
  would then measure a config nobody asked for. The backend reads its own engine's log for such
  statements (``option_report()``, rules in ``backends/<engine>/``, shapes in
  ``backends/_options.py``). Fails ``ineffective-option`` quoting the engine's lines when any
  user-set option was ignored, overridden or fell back; passes only when every option set that
  can be checked was verified (the engine's effective value, a stated figure, or the absence of
  a message the engine's source logs on every path that drops it), naming the ones nothing can
  verify; skips with the reason when no option was set or none can be verified. Measured
  effects other checks judge (spec-decode acceptance, prefix-cache hits, the KV capacity ratio)
  are named, not repeated.
"""

import pytest


@pytest.mark.check("load")
def test_load(engine_state, run):
    check = run.get("load")
    assert check is not None
    if check.status != "pass":
        pytest.fail(f"{check.failure_class}: {check.summary}", pytrace=False)


def _fmt(value) -> str:
    return value if isinstance(value, str) else repr(value)


@pytest.mark.check("load.options_effective")
def test_options_effective(run, engine):
    with run.check("load.options_effective", "ineffective-option") as c:
        report = engine.option_report() if hasattr(engine, "option_report") else None
        if report is None:
            c.skip(f"backend {engine.name} reads no statements about options from its engine")
        c.evidence("option_report.json", report.model_dump())
        ignored = report.ignored()
        c.values.update({"set_options": report.set_options, "verified": report.verified,
                         "unverifiable": report.unverifiable, "judged_elsewhere": report.judged_elsewhere,
                         "ignored": [s.model_dump() for s in ignored],
                         "other_statements": [s.model_dump() for s in report.statements if not s.user_set]})
        if ignored:
            c.evidence("engine.log.tail", engine.log_tail(200))
            c.fail(f"{report.engine} did not apply " + "; ".join(
                f"{s.option}={_fmt(report.set_options.get(s.option))} ({s.kind}): {s.line}" for s in ignored))
        if not report.set_options:
            c.skip("no engine option set (--backend-opt): nothing to verify")
        if not report.verified:
            c.skip(f"none of the options set can be verified from {report.engine}'s statements: "
                   + "; ".join(f"{k}: {v}" for k, v in report.unverifiable.items()))
        c.summary = ("verified: " + "; ".join(f"{k} ({v})" for k, v in report.verified.items())
                     + (f"; not verifiable: {', '.join(report.unverifiable)}" if report.unverifiable else "")
                     + (f"; effect judged by: {', '.join(f'{k} -> {v}' for k, v in report.judged_elsewhere.items())}"
                        if report.judged_elsewhere else ""))
