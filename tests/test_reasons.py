"""Every status but ``qualified`` says why, wherever a verdict is shown: ``bakeoff report``'s
report.md, ``bakeoff compare``'s report.md, index.html and recommendations, and the console
summary of ``bakeoff qualify``. The reasons come from the run directory alone (its checks,
recomputed by today's rule), are one short line in a table (an engine's ``|`` or newline does not
break it; HTML escaped) and whole in a per-run section of the same report."""

from __future__ import annotations

from bakeoff.api.verdict import Check, decide

SKIP_WHY = "the reference answers only 49% of the 300 probes (< 50%): known answers cannot judge this model"


def test_decide_says_why_a_run_was_cut_off():
    """A run that did not finish names the last check it recorded (the telemetry written as the
    session ends is no step of the run); one cut before any check says so."""
    checks = [Check(name="load", status="pass"), Check(name="sanity.tokenizer", status="pass"),
              Check(name="telemetry.gpu", status="skip", summary="no NVIDIA GPU")]
    status, reasons = decide(checks, finished=False)
    assert status == "incomplete" and reasons == ["cut off after check sanity.tokenizer: the run did not finish"]
    failed = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="fail",
                                                        failure_class="garbage-output", summary="0%")]
    assert decide(failed, finished=False)[1] == ["cut off after check sanity.known_answers: the run did not finish",
                                                 "sanity.known_answers: garbage-output: 0%"]
    assert decide([], finished=False) == ("incomplete", ["cut off before its first check: the run did not finish"])
    skipped = [Check(name="load", status="pass"), Check(name="sanity.known_answers", status="skip", summary=SKIP_WHY)]
    assert decide(skipped, finished=True) == ("incomplete", [f"sanity.known_answers: required to qualify, skipped: {SKIP_WHY}"])
    silent = [Check(name="load", status="fail", failure_class="load-failure")]
    assert decide(silent, finished=True) == ("disqualified", ["load: load-failure: (no message recorded)"])
