"""What a child server's failure says: the root-cause line of its log (:func:`last_error_line`,
:func:`death_cause`), a CUDA failure named in it (:func:`cuda_evidence`), a kernel refusing the
model's shapes (:func:`shape_refusal`). :mod:`backends._server` applies them at start and while
serving, and re-exports them."""

from __future__ import annotations

import re

from bakeoff.api.errors import EngineFailure
from bakeoff.analysis.failures import kernel_refusal
from bakeoff.host.procs import died_by_signal
from bakeoff.analysis.cuda_errors import classify, describe


EXC_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception|Exit)):\s*(.+)")
WRAPPER_HINTS = ("See stack trace", "check the stack trace", "EngineDeadError", "EngineCore encountered an issue",
                 "Engine core initialization failed", "Worker failed with error")
OTHER_MARKERS = ("CUDA error", "out of memory", "Killed", "Segmentation fault", "core dumped")


def shape_refusal(exc: EngineFailure, log: str) -> EngineFailure:
    """A serving failure whose log shows a kernel refusing the model's shapes
    (:func:`bakeoff.analysis.failures.kernel_refusal`: vLLM CPU's gated-delta-net kernel at head
    dim 32) is ``incompatible-features``, naming the kernel's line, not a ``runtime-crash``: the
    engine did not crash, it said it cannot run these shapes here. Returns ``exc``."""
    found = kernel_refusal(log)
    if found is not None and exc.failure_class == "runtime-crash":
        exc.failure_class = found.failure_class
        if found.line not in exc.message:  # the kernel's words first: a verdict line is read from its start
            exc.message = f"{found.line} | {exc.message}"
        exc.evidence["kernel_refusal.txt"] = f"{found.line}\nrecognised: {found.kind} -> {found.failure_class}"
    return exc


def cuda_evidence(exc: EngineFailure, text: str, phase: str) -> EngineFailure:
    """Attach a CUDA failure named in ``text`` (:mod:`bakeoff.analysis.cuda_errors`) to ``exc``: its class
    for the phase (``load-failure`` at start, ``runtime-crash`` while serving) unless ``exc``
    already names a hang, and ``cuda_error.json`` with the line as evidence. Returns ``exc``."""

    err = classify(text, "start" if phase == "start" else "serving")
    if err is not None:
        if exc.failure_class != "hang":
            exc.failure_class = err.failure_class
        if err.line not in exc.message:
            exc.message = f"{exc.message} | {describe(err)}"
        exc.evidence["cuda_error.json"] = err.model_dump_json(indent=2)
    return exc


def death_cause(code: int | None, log: str) -> str:
    """What the log says about an exit: its root-cause line (:func:`last_error_line`); for a death
    by signal only when the log names a crash (segfault, OOM, CUDA), since the last warning
    before an outside kill is not its cause."""

    if died_by_signal(code) and classify(log) is None and not any(m in log for m in OTHER_MARKERS):
        hint = " (an outside kill, or the OOM killer: see dmesg)" if code in (-9, 137) else ""
        return f"its log names no error before the signal{hint}"
    return last_error_line(log)


def last_error_line(log: str) -> str:
    """The root cause in a log tail.

    Engines wrap the real exception (vLLM: ``RuntimeError: Worker failed with error ...,
    please check the stack trace above``, then ``EngineDeadError``), so the last exception
    line that is not such a wrapper is returned; else the last line naming an error; else
    the last line. The engine's log prefix (``(Worker pid=1) ERROR 11-30 ... [file.py:12]``)
    is kept: it says which process failed.
    """

    cuda = classify(log)
    if cuda is not None and cuda.kind != "cuda-error":  # OOM, illegal access, assert, NCCL: the root cause
        return cuda.line
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    exc = [ln for ln in lines if EXC_LINE.search(ln) and "Traceback" not in ln]
    root = [ln for ln in exc if not any(h in ln for h in WRAPPER_HINTS)]
    for group in (root, exc, [ln for ln in lines if any(m in ln for m in OTHER_MARKERS)]):
        if group:
            return group[-1][:400]
    return lines[-1][:400] if lines else "(empty log)"
